"""The console's memory of recent requests: a bounded ring of small summaries, filled only
while someone looks.

The console (``api/console.py``) shows the traffic of the last seconds and each recent
request's path. Keeping that for every request would cost the hot path a dict and an append
per request forever, for a page nobody may open. So the ring is off until a console reads it
(:meth:`RecentRequests.look`), and goes off again, emptied, once nobody has looked for
``watch_seconds``: the request path pays one attribute test (``recent.on``) while it is off.

A summary holds what the access log already shows of a request (id, path, model, status,
outcome, the instances of its legs, its stage times, tokens, the turn's multi-turn KV reuse
outcome), where its last attempt's legs were placed and why (``placement/decision.py``), and
nothing more: no client address, no key, no body.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from epd_proxy.observe.record import RequestRecord

CAPACITY = 1024  # summaries kept per process: the traffic window's sample when busy
WATCH_SECONDS = 30.0  # recording stops this long after the console's last look


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def captured(rec: RequestRecord, status: int, tokens: tuple, nbytes: int, seconds: float, end: float) -> tuple:
    """What the ring keeps of a finished request, cheaply (a tuple; :func:`as_summary` reads it)."""
    ctx = rec.ctx
    if ctx is None:
        legs: tuple = ()
        timings: dict = {}
        kv = placement = None
    else:
        placement = ctx.placement  # the last attempt's (read as plain data only when shown)
        kv = ctx.kv_outcome  # multi-turn KV reuse (request/turns/outcomes.py), None: not looked up
        excluded = ctx.excluded
        legs = tuple((inst.role, inst.url, inst in excluded) for inst in ctx.legs)
        timings = ctx.timings  # the request is over: nothing adds to it any more
    return (rec.request_id, rec.method, rec.path, rec.model, status, rec.outcome, rec.stream, end, seconds,
            rec.first_byte, rec.gap, tokens, rec.items, legs, timings, nbytes, kv, placement, rec.moves)


def as_summary(kept: tuple) -> dict:
    """One finished request as the console shows it (plain data, JSON-ready). ``end``: wall
    time at its end; ``legs``: each instance called, in order, as ``[role, url, failed]``
    (``failed``: it failed this request, which went on elsewhere or ended in error); ``kv_outcome``:
    what became of the turn's chance to reuse decode's KV (``turns/outcomes.py``; None: not looked up);
    ``placement``: per leg, the instance and why it went there (None: never placed); ``moves``: a
    stream continued on another decode, per move its reason, result, the decode it left and the
    one it went to, when (from arrival) and the time the move took (request/migration.py; None:
    never moved)."""
    (rid, method, path, model, status, outcome, stream, end, seconds, first_byte, gap, tokens, items, legs,
     timings, nbytes, kv, placement, moves) = kept
    prompt, completion, cached = tokens
    return {"id": rid, "method": method, "path": path, "model": model, "status": status, "outcome": outcome,
            "stream": stream, "end": round(end, 3), "total_ms": _ms(seconds), "first_byte_ms": _ms(first_byte),
            "itl_ms": _ms(gap), "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
            "items": items, "legs": [list(leg) for leg in legs],
            "stages_ms": {stage: round(s * 1000, 3) for stage, s in timings.items()}, "bytes": nbytes,
            "kv_outcome": kv, "placement": None if placement is None else placement.summary(),
            "moves": None if moves is None else [
                {"reason": m[0], "result": m[1], "from": m[2], "to": m[3], "at_ms": _ms(m[4]), "ms": _ms(m[5])}
                for m in moves]}


def summary(rec: RequestRecord, status: int, tokens: tuple, nbytes: int, seconds: float, end: float) -> dict:
    """:func:`as_summary` of :func:`captured`."""
    return as_summary(captured(rec, status, tokens, nbytes, seconds, end))


def refused(request_id: str, method: str, path: str, status: int, seconds: float, end: float) -> tuple:
    """A request refused before it was parsed (admission's 429, a 503 while shutting down)."""
    return (request_id, method, path, None, status, "error", False, end, seconds, None, None, (None, None, None), 0,
            (), {}, 0, None, None, None)


class RecentRequests:
    """The ring, on only while a console looks. ``clock``: monotonic, for the watch; wall
    time (``wall``) stamps each summary, so the workers' rings line up."""

    def __init__(self, capacity: int = CAPACITY, watch_seconds: float = WATCH_SECONDS,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.on = False  # the request path's one test
        self.capacity = capacity
        self.watch_seconds = watch_seconds
        self._clock = clock
        self._wall = wall
        self._ring: deque[tuple] = deque(maxlen=capacity)  # captured(), read as summaries
        self._looked = 0.0
        self.since = 0.0  # wall time recording (re)started: the traffic window starts no earlier

    def look(self) -> None:
        """A console read the ring: record (on) for ``watch_seconds`` more."""
        self._looked = self._clock()
        if not self.on:
            self.on = True
            self.since = self._wall()

    def _watched(self) -> bool:
        if self._clock() - self._looked <= self.watch_seconds:
            return True
        self.on = False
        self._ring.clear()
        return False

    def add(self, rec: RequestRecord, status: int, tokens: tuple, nbytes: int, seconds: float) -> None:
        """A finished request (called only while ``on``)."""
        if self._watched():
            self._ring.append(captured(rec, status, tokens, nbytes, seconds, self._wall()))

    def add_refused(self, request_id: str, method: str, path: str, status: int, seconds: float) -> None:
        if self._watched():
            self._ring.append(refused(request_id, method, path, status, seconds, self._wall()))

    @property
    def saturated(self) -> bool:
        """The ring is full: its oldest summary, not the window, bounds what it covers."""
        return len(self._ring) == self.capacity

    @property
    def oldest(self) -> float | None:
        """Wall time the oldest request kept ended."""
        return self._ring[0][7] if self._ring else None

    def records(self, since: float = 0.0) -> list[dict]:
        """The summaries of the requests that ended at ``since`` (wall time) or later, oldest first."""
        newest = []
        for kept in reversed(self._ring):
            if kept[7] < since:
                break
            newest.append(kept)
        return [as_summary(kept) for kept in reversed(newest)]

    def latest(self, n: int) -> list[dict]:
        """The ``n`` newest summaries, oldest first."""
        ring = self._ring
        return [as_summary(ring[i]) for i in range(max(0, len(ring) - n), len(ring))]

    def find(self, request_id: str) -> list[dict]:
        """The summaries with this id, newest first (a client may reuse an id)."""
        return [as_summary(kept) for kept in reversed(self._ring) if kept[0] == request_id]
