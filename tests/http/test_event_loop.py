"""The one way a command starts its event loop."""

import asyncio

import uvloop

from epd_proxy.http import event_loop


def test_run_returns_what_main_returns_on_a_uvloop_loop_and_closes_it():
    seen = []

    async def main():
        loop = asyncio.get_running_loop()
        seen.append(loop)
        return isinstance(loop, uvloop.Loop)

    assert event_loop.run(main()) is True
    assert seen[0].is_closed()
