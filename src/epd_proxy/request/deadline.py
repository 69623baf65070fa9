"""The pre-commit deadline (``--first-byte-timeout``) of every request, enforced by one sweep.

A timer per request would cost more than the rest of admission: arming and
cancelling a uvloop timer takes about 3 µs, ``asyncio.timeout`` about 5 µs. Here
a request costs a dict insert and delete, and one task wakes up every ``tick``
(a tenth of the timeout, at most a second) to cancel the requests past their
deadline. A deadline therefore fires up to one tick late, which is nothing
next to a timeout of minutes.
"""

from __future__ import annotations

import asyncio


class Deadlines:
    """Requests before their commit point, and when each must have got there."""

    __slots__ = ("seconds", "tick", "_due", "_expired", "_sweeper", "_loop")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.tick = min(1.0, max(0.005, seconds / 10))
        self._due: dict[asyncio.Task, float] = {}
        self._expired: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def enter(self, task: asyncio.Task | None = None) -> asyncio.Task:
        """Start ``task``'s clock (default: the running task) and return the task."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        if task is None:
            # With the loop given, no get_running_loop(): in CPython 3.11 that is a getpid()
            # system call, once per request on this path.
            task = asyncio.current_task(loop)
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep())
        # current_task() inside a task is never None (no check on this path).
        self._due[task] = loop.time() + self.seconds  # type: ignore[index]
        return task  # type: ignore[return-value]

    def leave(self, task: asyncio.Task) -> None:
        self._due.pop(task, None)
        if self._expired:
            self._expired.discard(task)

    def expired(self, task: asyncio.Task) -> bool:
        """Whether this task's cancellation was the deadline's (not its client leaving)."""
        return task in self._expired

    async def _sweep(self) -> None:
        loop = self._loop
        assert loop is not None  # set by the enter that started the sweep
        while True:
            await asyncio.sleep(self.tick)
            if not self._due:
                continue
            now = loop.time()
            late = [task for task, due in self._due.items() if due <= now]
            for task in late:
                del self._due[task]
                self._expired.add(task)
                task.cancel()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
