"""One event stream's sequence numbers: what each message means for the index.

vLLM numbers its event batches 0, 1, 2, ... per engine (and per data-parallel rank) and
keeps the last 10,000 (``buffer_steps``) for replay. A subscriber sees them in order,
except that a PUB socket drops messages silently (a slow subscriber, a reconnect, the
first messages before the subscription took effect), and that an engine restart starts
again at 0. So each live message is one of:

* ``APPLY``: the next one expected;
* ``GAP``: later than expected: messages were lost; replay from :attr:`expected` first;
* ``DUPLICATE``: earlier than expected but within what a replay just delivered (the
  same messages, also on their way through the live socket): dropped;
* ``RESTART``: earlier than expected otherwise: the engine restarted; what it held is
  gone (clear the instance, replay from 0).

A replay that cannot go back far enough (its first message is later than expected) has
lost messages for good: the instance's blocks are cleared, since a missed removal would
leave blocks the engine no longer holds. Pure: the clock is passed in.
"""

from __future__ import annotations

APPLY, GAP, DUPLICATE, RESTART = "apply", "gap", "duplicate", "restart"
# How long after a replay a live message it covered still counts as a duplicate.
DUPLICATE_WINDOW = 5.0


class SequenceTracker:
    """The next sequence number expected, and the range the last replay delivered."""

    __slots__ = ("expected", "_replayed", "last_digest")

    def __init__(self) -> None:
        self.expected: int | None = None  # None: nothing seen yet
        self._replayed: tuple[int, int, float] | None = None  # (first, last, when)
        self.last_digest = 0  # a digest of the last applied payload (to recognise it in a replay)

    def classify(self, seq: int, now: float) -> str:
        """What a live message numbered ``seq`` is."""
        expected = self.expected
        if expected is None or seq == expected:
            return APPLY
        if seq > expected:
            return GAP
        replayed = self._replayed
        if replayed is not None and replayed[0] <= seq <= replayed[1] and now - replayed[2] <= DUPLICATE_WINDOW:
            return DUPLICATE
        return RESTART

    def applied(self, seq: int, digest: int = 0) -> None:
        self.expected = seq + 1
        self.last_digest = digest

    def replayed(self, first: int, last: int, now: float) -> None:
        """A replay delivered ``first``..``last``."""
        self._replayed = (first, last, now)

    def reset(self) -> None:
        """The engine restarted: expect its first message."""
        self.expected = 0
        self._replayed = None
        self.last_digest = 0
