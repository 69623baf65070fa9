"""One timer per connection, moved lazily.

A connection arms a timeout for every request it carries and disarms it when
the response is done. Creating and cancelling a loop timer for each of those
costs more than the request's own bookkeeping, so a connection keeps a single
:class:`ConnectionTimer`: arming only replaces the loop timer when it would fire
too late, disarming only forgets the deadline, and a loop timer that fires early
aims itself again at the deadline now in force.
"""

from __future__ import annotations

import asyncio
from typing import Callable

_NEVER = float("inf")


class ConnectionTimer:
    """A connection's one timeout: ``arm_at(due)``, ``disarm()``; ``on_expiry`` is called once
    the loop's clock has passed the armed deadline (the deadline is cleared first, so it may
    arm again). ``close()`` when the connection is gone: it lets go of the callback, which
    refers back to the connection."""

    __slots__ = ("_loop", "_on_expiry", "_handle", "fires", "due")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_expiry: Callable[[], None]) -> None:
        self._loop = loop
        self._on_expiry: Callable[[], None] | None = on_expiry
        self._handle: asyncio.TimerHandle | None = None
        # When the loop timer fires (its ``when()``, kept: no call to ask it). A deadline at or
        # after it needs no new loop timer: the connections' hot paths then only set ``due``.
        self.fires = _NEVER
        # The armed deadline (loop time); None = disarmed. Disarming is setting it to None,
        # which the connections' hot paths do inline rather than calling ``disarm``.
        self.due: float | None = None

    def arm_at(self, due: float) -> None:
        """Expire at ``due`` (loop time), replacing any earlier deadline."""
        self.due = due
        if self.fires <= due:
            return  # the loop timer fires in time; it re-aims then
        handle = self._handle
        if handle is not None:
            handle.cancel()
        self._handle = self._loop.call_at(due, self._fire)
        self.fires = due

    def arm(self, delay: float) -> None:
        """Expire ``delay`` seconds from now; a delay of 0 (or less) disarms."""
        if delay > 0:
            due = self.due = self._loop.time() + delay  # arm_at's, inline: a keep-alive request arms twice
            if self.fires <= due:
                return
            handle = self._handle
            if handle is not None:
                handle.cancel()
            self._handle = self._loop.call_at(due, self._fire)
            self.fires = due
        else:
            self.due = None

    def disarm(self) -> None:
        """No deadline; the loop timer, if any, is left to fire into nothing or to re-aim."""
        self.due = None

    def close(self) -> None:
        self.due = None
        self._on_expiry = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.fires = _NEVER

    def _fire(self) -> None:
        self._handle = None
        self.fires = _NEVER
        due = self.due
        if due is None or self._on_expiry is None:
            return
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._fire)
            self.fires = due
            return
        self.due = None
        self._on_expiry()
