"""Which media items of one request the encoders failed alike: the item's fault or theirs (pure).

An encoder that times out on an item, or answers vLLM's 500 for it, may be at fault, or the
item may be (an image that hangs the vision encoder, a URL that never answers vLLM's fetch).
One failure cannot tell them apart; two different encoders failing the same item so can: the
item is then taken as the cause, and neither encoder is blamed. ``EncodeFailures`` keeps, for
one request's encode stage, the encoders that failed it and the failures an item may have
caused, with their held health signals, until the verdict.
"""

from __future__ import annotations

from typing import Hashable, Sequence

# Two different encoders failing the same item alike: the item is the likely cause.
ALIKE = 2


class EncodeFailures:
    """What failed in one request's encode stage."""

    __slots__ = ("encoders", "_by_item", "_held")

    def __init__(self) -> None:
        self.encoders: set = set()  # failed an item of this request: none gets its items again
        self._by_item: dict[int, set] | None = None  # item index -> the encoders that failed it alike
        self._held: list[tuple[object, Sequence[int]]] | None = None  # (a held signal, its items)

    def failed(self, encoder: Hashable, items: Sequence[int], held: object | None = None) -> list[int]:
        """``encoder`` failed a sub-request of ``items`` (their indexes); ``held``: the held
        signal of a failure the items may have caused (a timeout, vLLM's 500), None for one
        that is the encoder's alone (a refused connection, a gateway status). Returns the
        items ``ALIKE`` encoders have now failed so (the items are the cause, [] when none);
        the held signals of the failures they were part of are let go (:meth:`blamed` leaves
        them out: no encoder is blamed for an item)."""
        self.encoders.add(encoder)
        if held is None:
            return []
        by_item = self._by_item
        if by_item is None:
            by_item = self._by_item = {}
        bad = []
        for index in items:
            seen = by_item.get(index)
            if seen is None:
                seen = by_item[index] = set()
            seen.add(encoder)
            if len(seen) >= ALIKE:
                bad.append(index)
        kept = self._held
        if kept is None:
            kept = self._held = []
        kept.append((held, items))
        if bad:
            gone = set(bad)
            self._held = [(h, its) for h, its in kept if gone.isdisjoint(its)]
        return bad

    def blamed(self) -> list:
        """The held signals still standing: their items were encoded elsewhere (or the request
        ended before a verdict, as before there was one): the encoders' fault."""
        return [h for h, _ in self._held] if self._held else []
