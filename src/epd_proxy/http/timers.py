"""One timer per connection, moved lazily.

A connection arms a timeout for every request it carries and disarms it when
the response is done. Creating and cancelling a loop timer for each of those
costs more than the request's own bookkeeping, so a connection keeps a single
timer: arming only replaces it when it would fire too late, and a timer that
fires early looks at what is due now and aims itself again.
"""

from __future__ import annotations

import asyncio
from typing import Callable


def aim(loop: asyncio.AbstractEventLoop, timer: asyncio.TimerHandle | None, due: float,
        callback: Callable[[], None]) -> asyncio.TimerHandle:
    """A timer that fires no later than ``due`` (loop time): ``timer`` itself when it
    already fires by then (its callback re-aims), else a new one in its place."""
    if timer is not None:
        if timer.when() <= due:
            return timer
        timer.cancel()
    return loop.call_at(due, callback)
