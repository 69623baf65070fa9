"""The lazily moved connection timer, on a hand-driven clock (and once on the real loop)."""

import asyncio

from epd_proxy.http.timers import ConnectionTimer


class _Handle:
    def __init__(self, when: float, callback) -> None:
        self._when, self.callback, self._cancelled = when, callback, False

    def when(self) -> float:
        return self._when

    def cancel(self) -> None:
        self._cancelled = True

    def cancelled(self) -> bool:
        return self._cancelled


class ClockLoop:
    """What the timer uses of an event loop: ``time`` and ``call_at``; ``advance`` runs what is due."""

    def __init__(self) -> None:
        self.now = 100.0
        self.handles: list[_Handle] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback) -> _Handle:
        handle = _Handle(when, callback)
        self.handles.append(handle)
        return handle

    def pending(self) -> list[_Handle]:
        return [h for h in self.handles if not h.cancelled()]

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while True:
            due = [h for h in self.pending() if h.when() <= end]
            if not due:
                break
            handle = min(due, key=_Handle.when)
            self.handles.remove(handle)
            self.now = max(self.now, handle.when())
            handle.callback()
        self.now = end


def test_arming_keeps_a_loop_timer_that_fires_in_time_and_replaces_a_late_one():
    loop, fired = ClockLoop(), []
    timer = ConnectionTimer(loop, lambda: fired.append(loop.now))
    timer.arm_at(110)
    first = timer._handle
    timer.arm_at(120)  # fires earlier: kept
    assert timer._handle is first and timer.due == 120 and len(loop.pending()) == 1
    timer.arm_at(101)  # would be late: replaced
    assert first.cancelled() and loop.pending() == [timer._handle] and timer._handle.when() == 101
    loop.advance(30)
    assert fired == [101] and timer.due is None and loop.pending() == []


def test_a_loop_timer_that_fires_early_re_aims_at_the_deadline_in_force():
    loop, fired = ClockLoop(), []
    timer = ConnectionTimer(loop, lambda: fired.append(loop.now))
    timer.arm(5)
    timer.arm(20)  # one keep-alive request later: no loop-timer operation
    assert len(loop.handles) == 1
    loop.advance(10)
    assert fired == [] and [h.when() for h in loop.pending()] == [120]
    loop.advance(15)
    assert fired == [120]


def test_disarmed_and_closed_timers_fire_into_nothing():
    loop, fired = ClockLoop(), []
    timer = ConnectionTimer(loop, lambda: fired.append(loop.now))
    timer.arm(1)
    timer.disarm()
    loop.advance(2)
    assert fired == [] and loop.pending() == []  # fired, nothing was due, did not re-aim
    timer.arm(0)  # 0 = no bound
    assert timer.due is None and loop.pending() == []
    timer.arm(1)
    timer.close()
    assert loop.pending() == [] and timer._on_expiry is None  # lets go of its connection
    timer.arm(1)  # a late arm after close is harmless
    loop.advance(2)
    assert fired == []


def test_expiry_may_arm_again():
    loop, fired = ClockLoop(), []

    def expired() -> None:
        fired.append(loop.now)
        if len(fired) < 3:
            timer.arm(1)

    timer = ConnectionTimer(loop, expired)
    timer.arm(1)
    loop.advance(10)
    assert fired == [101, 102, 103]


async def test_on_the_event_loop():
    loop = asyncio.get_running_loop()
    fired = asyncio.Event()
    timer = ConnectionTimer(loop, fired.set)
    timer.arm(30)
    timer.arm(0.01)
    await asyncio.wait_for(fired.wait(), 5)
    timer.close()
