"""Starting the event loop: one way for every command and child process.

uvloop when it is installed (a dependency on Linux and macOS: the proxy's measured
cost per request assumes it), the stock loop otherwise. The loop is made by a
factory handed to ``asyncio.Runner``, so no process-wide event loop policy is
changed, and ``run`` has ``asyncio.run``'s semantics (Ctrl-C cancels the main
task; the loop's async generators and executor are shut down at the end).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Coroutine, TypeVar

T = TypeVar("T")


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - not Linux or macOS
        return None  # asyncio's default loop
    return uvloop.new_event_loop


LOOP_FACTORY = _uvloop_factory()


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a new event loop and close the loop."""
    with asyncio.Runner(loop_factory=LOOP_FACTORY) as runner:
        return runner.run(main)
