"""Where the limits' counters live: the interface, and the in-process counters.

``take`` is the one decision a store makes: every counter a request touches has room
(``limits.fits``), then all are counted, atomically; refused, none is. ``add`` settles an
answer's tokens afterwards. The in-process counters serve one process (with ``--workers N``
each worker counts for itself); ``redis_counters.py`` shares them between processes and
replicas.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

from epd_proxy.tenants.limits import Hit, fits


class StoreUnavailable(Exception):
    """The shared store did not answer (in time): the limiter fails open or closed."""


class Counters(Protocol):
    async def take(self, hits: list[Hit]) -> tuple[bool, list[int]]:
        """(True, the values after counting) when every counter has room, else (False, the
        values as they stand, nothing counted). May raise :class:`StoreUnavailable`."""

    async def add(self, adds: list[tuple[Hit, int]]) -> None:
        """Add to counters (an answer's tokens, settled); may raise :class:`StoreUnavailable`."""

    async def read(self, hits: list[Hit]) -> list[int]:
        """The counters' values (for /status); may raise :class:`StoreUnavailable`."""

    async def close(self) -> None: ...


class LocalCounters:
    """Counters in this process: a dict of window keys, each dropped once its window has
    passed (swept when the dict has doubled since the last sweep)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._values: dict[str, int] = {}
        self._ends: dict[str, float] = {}
        self._clock = clock
        self._sweep_at = 1024

    def take_now(self, hits: list[Hit]) -> tuple[bool, list[int]]:
        values = self._values
        current = [values.get(h.key, 0) for h in hits]
        for hit, value in zip(hits, current):
            if not fits(value, hit.amount, hit.limit):
                return False, current
        for i, hit in enumerate(hits):
            if hit.amount:
                current[i] = self._bump(hit, hit.amount)
        return True, current

    def _bump(self, hit: Hit, amount: int) -> int:
        key = hit.key
        value = self._values[key] = self._values.get(key, 0) + amount
        if key not in self._ends:
            self._ends[key] = hit.reset_at
            if len(self._ends) >= self._sweep_at:
                self._sweep()
        return value

    def _sweep(self) -> None:
        now = self._clock()
        for key in [k for k, end in self._ends.items() if end <= now]:
            del self._ends[key]
            self._values.pop(key, None)
        self._sweep_at = max(1024, 2 * len(self._ends))

    async def take(self, hits: list[Hit]) -> tuple[bool, list[int]]:
        return self.take_now(hits)

    def add_now(self, adds: list[tuple[Hit, int]]) -> None:
        for hit, amount in adds:
            self._bump(hit, amount)

    async def add(self, adds: list[tuple[Hit, int]]) -> None:
        self.add_now(adds)

    async def read(self, hits: list[Hit]) -> list[int]:
        return [self._values.get(h.key, 0) for h in hits]

    async def close(self) -> None:
        pass
