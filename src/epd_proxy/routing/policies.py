"""The small policies: rotation, least-loaded, load-aware and power-of-two choices.

Each keeps only its own cursor or random generator; none reads the request.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Sequence

from epd_proxy.routing.candidate import C, score_of
from epd_proxy.routing.view import EMPTY_VIEW, RequestView

if TYPE_CHECKING:  # pragma: no cover - typing only
    from epd_proxy.encode.multimodal import MediaItem


def assign_round_robin(cursor: int, n_encoders: int, count: int) -> tuple[list[int], int]:
    """Encoder indices for ``count`` consecutive items from ``cursor``, and the next cursor
    (modulo ``n_encoders``): the reference proxy's spread, a cursor shared by all requests
    (docs/protocol.md §4.3: a per-request cursor would send every single-image request to
    E0, #52484)."""
    if n_encoders < 1:
        raise ValueError("n_encoders must be >= 1")
    if count < 0:
        raise ValueError("count must be >= 0")
    start = cursor % n_encoders
    indices = [(start + i) % n_encoders for i in range(count)]
    return indices, (start + count) % n_encoders



class RoundRobin:
    """Strict rotation; the cursor persists across requests (for encoders: per item, which is
    the reference proxy's spread, #52484)."""

    name = "round-robin"
    uses_view = False
    uses_signals = False

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, candidates: list[C], view: RequestView = EMPTY_VIEW) -> C:
        inst = candidates[self._cursor % len(candidates)]
        self._cursor += 1
        return inst

    def assign(self, candidates: list[C], items: Sequence[MediaItem]) -> list[C]:
        indices, self._cursor = assign_round_robin(self._cursor, len(candidates), len(items))
        return [candidates[i] for i in indices]


class _Scored:
    """Lowest score wins; a tie goes to the instance that has served the fewest requests,
    so an idle cluster spreads requests evenly instead of piling on the first, and counts
    stay level when load is light (the search starts at a rotating position, so equal
    counts rotate too). Items of one request count against each other."""

    uses_view = False
    uses_signals = False

    def __init__(self) -> None:
        self._cursor = 0

    @staticmethod
    def score(inst: C) -> float:
        return inst.inflight

    def choose(self, candidates: list[C], view: RequestView = EMPTY_VIEW) -> C:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        start = self._cursor % n
        self._cursor += 1
        score = self.score
        best = candidates[start]
        low = score(best)
        for i in range(1, n):
            c = candidates[(start + i) % n]
            s = score(c)
            if s < low or (s == low and c.requests < best.requests):
                best, low = c, s
        return best

    def assign(self, candidates: list[C], items: Sequence[MediaItem]) -> list[C]:
        n = len(candidates)
        scores = [self.score(c) for c in candidates]
        out = []
        for _ in items:
            start = self._cursor % n
            self._cursor += 1
            best = start
            for i in range(1, n):
                j = (start + i) % n
                if scores[j] < scores[best] or (scores[j] == scores[best]
                                                and candidates[j].requests < candidates[best].requests):
                    best = j
            scores[best] += 1
            out.append(candidates[best])
        return out


class LeastLoaded(_Scored):
    """Fewest requests in flight from this proxy."""

    name = "least-loaded"


class LoadAware(_Scored):
    """This proxy's in-flight count plus the instance's scraped queue and KV-cache usage."""

    name = "load-aware"
    uses_signals = True
    score = staticmethod(score_of)


class PowerOfTwo:
    """Two candidates at random, the lower load-aware score wins: spreads like least-loaded
    without every replica herding onto the one instance that looked idle at the last scrape."""

    name = "power-of-two"
    uses_view = False
    uses_signals = True

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed).random

    def choose(self, candidates: list[C], view: RequestView = EMPTY_VIEW) -> C:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        r = self._random
        i = int(r() * n)
        j = int(r() * (n - 1))
        if j >= i:
            j += 1
        a, b = candidates[i], candidates[j]
        return b if score_of(b) < score_of(a) else a

    def assign(self, candidates: list[C], items: Sequence[MediaItem]) -> list[C]:
        return [self.choose(candidates) for _ in items]
