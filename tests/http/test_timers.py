"""The lazily moved connection timer."""

import asyncio

from epd_proxy.http.timers import aim


async def test_aim_keeps_a_timer_that_fires_in_time_and_replaces_a_late_one():
    loop = asyncio.get_running_loop()
    fired = []
    now = loop.time()
    first = aim(loop, None, now + 10, lambda: fired.append("first"))
    assert aim(loop, first, now + 20, lambda: fired.append("x")) is first  # fires earlier: kept
    second = aim(loop, first, now + 0.01, lambda: fired.append("second"))  # would be late: replaced
    assert second is not first and first.cancelled() and not second.cancelled()
    await asyncio.sleep(0.05)
    assert fired == ["second"]
