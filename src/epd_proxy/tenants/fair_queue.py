"""Pure: who gets the next free admission slot when the proxy is saturated.

Waiters are grouped by priority class (higher rank first: a lower class waits while any
higher one does) and, within a class, by flow (the client key): flows are served in
weighted fair order by start-time fair queueing. Each flow has a finish tag; a flow with
waiters starts at ``max(its finish, the class's virtual time)``, the flow with the smallest
start is served, and its finish moves on by ``1 / weight``. Two backlogged keys of weights
3 and 1 are thus served 3 : 1, a key that was idle starts at the present rather than
claiming the turns it missed, and one key's flood waits behind the others' few requests
instead of in front of them. One flow is a plain FIFO (what admission was before).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Any


class _Band:
    """One class's flows."""

    __slots__ = ("flows", "finish", "heads", "heap", "vtime", "waiting")

    def __init__(self) -> None:
        self.flows: dict[str, deque] = {}  # flow -> its waiters, oldest first
        self.finish: dict[str, float] = {}  # flow -> its finish tag
        self.heads: dict[str, tuple[float, int]] = {}  # flow with waiters -> its heap entry's (start, seq)
        self.heap: list[tuple[float, int, str, float]] = []  # (start, seq, flow, weight)
        self.vtime = 0.0
        self.waiting = 0


class FairQueue:
    """Waiters (any objects) by class rank and flow; :meth:`pop` gives the next to serve."""

    def __init__(self) -> None:
        self._bands: dict[int, _Band] = {}
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def waiting(self, rank: int) -> int:
        band = self._bands.get(rank)
        return 0 if band is None else band.waiting

    def waiting_from(self, rank: int) -> int:
        """Waiters of ``rank`` and above: those a request of ``rank`` may not overtake."""
        return sum(band.waiting for r, band in self._bands.items() if r >= rank)

    def top_rank(self) -> int | None:
        """The highest rank with a waiter (the next to be served), None when empty."""
        ranks = [r for r, band in self._bands.items() if band.waiting]
        return max(ranks) if ranks else None

    def push(self, item: Any, flow: str = "", rank: int = 0, weight: float = 1.0) -> None:
        band = self._bands.get(rank)
        if band is None:
            band = self._bands[rank] = _Band()
        waiters = band.flows.get(flow)
        if waiters is None:
            waiters = band.flows[flow] = deque()
        waiters.append(item)
        band.waiting += 1
        self._len += 1
        if flow not in band.heads:
            self._schedule(band, flow, max(band.finish.get(flow, 0.0), band.vtime), weight)

    def _schedule(self, band: _Band, flow: str, start: float, weight: float) -> None:
        seq = next(self._seq)
        band.heads[flow] = (start, seq)
        heapq.heappush(band.heap, (start, seq, flow, weight))

    def pop(self) -> Any:
        """The next waiter to serve (highest class, then the fairest flow), or None."""
        if not self._len:
            return None
        for rank in sorted(self._bands, reverse=True):
            band = self._bands[rank]
            while band.heap:
                start, seq, flow, weight = heapq.heappop(band.heap)
                if band.heads.get(flow) != (start, seq):
                    continue  # stale: the flow emptied (its waiters left) or was rescheduled
                waiters = band.flows[flow]
                item = waiters.popleft()
                band.waiting -= 1
                self._len -= 1
                band.vtime = start
                finish = band.finish[flow] = start + 1.0 / weight
                if waiters:
                    self._schedule(band, flow, finish, weight)
                else:
                    self._idle(band, flow)
                return item
        return None

    def _idle(self, band: _Band, flow: str) -> None:
        del band.heads[flow]
        del band.flows[flow]
        if len(band.finish) > 2 * len(band.flows) + 64:  # finish tags at or below the virtual time are no use
            band.finish = {f: t for f, t in band.finish.items() if t > band.vtime or f in band.flows}

    def remove(self, item: Any, flow: str = "", rank: int = 0) -> bool:
        """Take a waiter out (it timed out or left); False when it was not waiting."""
        band = self._bands.get(rank)
        waiters = band.flows.get(flow) if band is not None else None
        if waiters is None:
            return False
        try:
            waiters.remove(item)
        except ValueError:
            return False
        band.waiting -= 1  # type: ignore[union-attr]  # band is set when waiters is
        self._len -= 1
        if not waiters:
            self._idle(band, flow)  # type: ignore[arg-type]
        return True

    def lowest_below(self, rank: int) -> tuple[Any, str, int] | None:
        """The newest waiter of the lowest class below ``rank`` from its most backlogged flow:
        who a full queue gives up for a higher class's newcomer. None when no class is lower."""
        for low in sorted(self._bands):
            if low >= rank:
                return None
            band = self._bands[low]
            if band.waiting:
                flow = max(band.flows, key=lambda f: len(band.flows[f]))
                return band.flows[flow][-1], flow, low
        return None

    def drain(self) -> list[Any]:
        """Every waiter, the queue emptied (shutdown)."""
        out = [item for band in self._bands.values() for waiters in band.flows.values() for item in waiters]
        self._bands.clear()
        self._len = 0
        return out
