"""When a leg that has not answered gets a second attempt (a hedge), where, and whether the
cluster can afford it: pure rules over plain data, the clock passed in.

* **The delay** (:func:`hedge_delay`): the 95th percentile of the last ``SAMPLES`` answers of
  that stage for that model (:class:`Latencies`, per role and model), bounded below by
  ``floor`` (``--hedge-min-delay``: noise is no reason to double work) and above by
  ``ceiling`` (``--hedge-max-delay``: a wedged instance is found that fast at the latest);
  with fewer than ``MIN_SAMPLES`` answers seen (a cold start, a new model), ``ceiling``. The
  p95 hedges the stage's own slowest 5 %, which the default budget (5 %) pays for.
* **Where**: the next of the placement's alternatives for the leg
  (``Placement.alternatives``, least loaded first) that has not failed this request and has
  fewer than ``--hedge-max-per-instance`` hedges in flight (:func:`hedge_target`).
* **Whether** (:class:`HedgeBudget`): hedges over the last two windows of ``window`` seconds
  stay within ``share`` (``--hedge-budget``, a percentage) of the requests that could have
  been hedged over the same windows, with one hedge allowed in any case (a quiet cluster with
  one wedged instance still hedges): however sick the cluster, hedging adds at most that share
  to its load.

A hedge never duplicates a decode: it applies to a leg whose answer is a hand-over (a
prefill's KV parameters, an encoder's embeddings), before anything reaches the client.
"""

from __future__ import annotations

from typing import Collection, Iterable

from epd_proxy.instances.instance import Instance

SAMPLES = 128  # the answers the delay is derived from, per role and model
MIN_SAMPLES = 20  # fewer: the delay is the ceiling (cold start)
REFRESH = 16  # the percentile is computed again every this many answers
WINDOW = 10.0  # seconds: the budget's window

# Why a hedge did or did not run, and how it ended (epd_proxy_hedges_total{role,result}).
WON = "won"  # the hedge answered first: the first attempt was aborted
LOST = "lost"  # the first attempt answered first: the hedge was aborted
FAILED = "failed"  # the hedge failed; the first attempt was waited for
BUDGET_EXHAUSTED = "budget_exhausted"  # the cluster-wide share was spent: no hedge
INSTANCE_BOUND = "instance_bound"  # every alternative had its hedges in flight: no hedge
NO_ALTERNATIVE = "no_alternative"  # the placement had no other instance: no hedge
RESULTS = (WON, LOST, FAILED, BUDGET_EXHAUSTED, INSTANCE_BOUND, NO_ALTERNATIVE)


def percentile(samples: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples`` (nearest rank), 0 without any."""
    ordered = sorted(samples)
    if not ordered:
        return 0.0
    rank = max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))
    return ordered[rank]


def hedge_delay(samples: Collection[float], floor: float, ceiling: float) -> float:
    """The delay after which a leg gets a hedge: the p95 of ``samples``, within
    ``floor``..``ceiling``; ``ceiling`` with fewer than ``MIN_SAMPLES`` of them."""
    if len(samples) < MIN_SAMPLES:
        return ceiling
    return min(ceiling, max(floor, percentile(samples, 0.95)))


class Latencies:
    """The last ``SAMPLES`` answer times of one stage for one model, and the delay they give
    (recomputed every ``REFRESH`` answers, so a request pays a list write, not a sort)."""

    __slots__ = ("samples", "next", "count", "delay", "floor", "ceiling")

    def __init__(self, floor: float, ceiling: float) -> None:
        self.samples: list[float] = []
        self.next = 0  # where the next answer goes once the ring is full
        self.count = 0
        self.floor = floor
        self.ceiling = max(floor, ceiling)
        self.delay = self.ceiling  # cold start

    def add(self, seconds: float) -> None:
        samples = self.samples
        if len(samples) < SAMPLES:
            samples.append(seconds)
        else:
            samples[self.next] = seconds
            self.next = (self.next + 1) % SAMPLES
        self.count += 1
        if self.count % REFRESH == 0:
            self.delay = hedge_delay(samples, self.floor, self.ceiling)


class HedgeBudget:
    """The cluster-wide share of hedges (plain data; ``now``: seconds on a monotonic clock)."""

    __slots__ = ("share", "window", "start", "requests", "previous", "spent", "spent_before")

    def __init__(self, percent: float, window: float = WINDOW) -> None:
        self.share = max(0.0, percent) / 100.0
        self.window = window
        self.start = 0.0
        self.requests = 0  # in the current window
        self.previous = 0  # in the one before
        self.spent = 0  # hedges in the current window
        self.spent_before = 0

    def _roll(self, now: float) -> None:
        elapsed = now - self.start
        if elapsed < self.window:
            return
        if elapsed < 2 * self.window:
            self.previous, self.spent_before = self.requests, self.spent
        else:  # a quiet spell: nothing of it counts
            self.previous = self.spent_before = 0
        self.requests = self.spent = 0
        self.start = now

    def note(self, now: float) -> None:
        """A request that could be hedged (its leg started)."""
        if now - self.start >= self.window:
            self._roll(now)
        self.requests += 1

    def allows(self, now: float) -> bool:
        """Whether one more hedge stays within the share (or is the one always allowed)."""
        self._roll(now)
        spent = self.spent + self.spent_before
        return spent < 1 or spent + 1 <= self.share * (self.requests + self.previous)

    def spend(self) -> None:
        self.spent += 1


def hedge_target(alternatives: Iterable[Instance], failed: Collection[Instance], in_flight: dict[Instance, int],
                 bound: int) -> tuple[Instance | None, bool]:
    """The instance a hedge goes to: the first alternative that has not failed this request and
    has fewer than ``bound`` hedges in flight (0: no bound). Also whether some alternative was
    passed over only for the bound (the reason there is none)."""
    bounded = False
    for inst in alternatives:
        if inst in failed:
            continue
        if bound and in_flight.get(inst, 0) >= bound:
            bounded = True
            continue
        return inst, False
    return None, bounded
