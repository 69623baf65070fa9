"""The hedge rules alone (placement/hedge.py): the delay, the budget and the target."""

from epd_proxy.placement.hedge import (
    MIN_SAMPLES,
    REFRESH,
    SAMPLES,
    HedgeBudget,
    Latencies,
    hedge_delay,
    hedge_target,
    percentile,
)


def test_the_delay_is_the_p95_within_its_bounds_and_the_ceiling_while_cold():
    assert percentile([], 0.95) == 0.0
    assert percentile(range(1, 101), 0.95) == 95
    assert percentile([3.0], 0.95) == 3.0
    assert hedge_delay([0.5] * (MIN_SAMPLES - 1), 0.1, 2.0) == 2.0  # cold start: the ceiling
    samples = [0.2] * 95 + [9.0] * 5
    assert hedge_delay(samples, 0.1, 2.0) == 0.2  # the slowest 5 % are what is hedged
    assert hedge_delay([0.01] * 100, 0.1, 2.0) == 0.1  # never below the floor
    assert hedge_delay([5.0] * 100, 0.1, 2.0) == 2.0  # never above the ceiling


def test_latencies_keep_the_last_samples_and_refresh_the_delay_every_few_answers():
    lat = Latencies(0.05, 1.0)
    assert lat.delay == 1.0
    for _ in range(MIN_SAMPLES + REFRESH):
        lat.add(0.3)
    assert lat.delay == 0.3
    for _ in range(SAMPLES):  # the ring forgets: the stage got faster
        lat.add(0.06)
    assert len(lat.samples) == SAMPLES and lat.delay == 0.06
    assert Latencies(2.0, 1.0).ceiling == 2.0  # a ceiling below the floor is the floor


def test_the_budget_is_a_share_of_the_requests_over_two_windows_with_one_always_allowed():
    b = HedgeBudget(5.0, window=10.0)
    b.note(0.0)
    assert b.allows(0.0)  # one hedge, however quiet the cluster
    b.spend()
    assert not b.allows(0.1)
    for i in range(99):
        b.note(1.0 + i * 0.01)
    assert b.allows(2.0)  # 100 requests: 5 hedges
    for _ in range(4):
        b.spend()
    assert not b.allows(2.0)
    b.note(12.0)  # the next window: the last one's requests and hedges still count
    assert not b.allows(12.0)
    for _ in range(20):
        b.note(12.5)
    assert b.allows(12.5)  # 121 requests over the two windows: a sixth hedge
    b.spend()
    assert not b.allows(12.6)
    assert b.allows(40.0)  # a quiet spell: nothing of it counts, one allowed again


def test_a_zero_budget_still_allows_the_single_hedge_and_no_second():
    b = HedgeBudget(0.0)
    for _ in range(1000):
        b.note(1.0)
    assert b.allows(1.0)
    b.spend()
    assert not b.allows(1.0)


def test_the_target_is_the_first_alternative_not_failed_and_below_the_bound():
    a, b, c = "prefill-a", "prefill-b", "prefill-c"  # only identity matters here
    assert hedge_target([a, b, c], set(), {}, 2) == (a, False)
    assert hedge_target([a, b, c], {a}, {}, 2) == (b, False)
    assert hedge_target([a, b, c], {a}, {b: 2}, 2) == (c, False)
    assert hedge_target([a, b], {a}, {b: 2}, 2) == (None, True)  # only the bound stood in the way
    assert hedge_target([a], {a}, {}, 2) == (None, False)
    assert hedge_target([a], set(), {a: 100}, 0) == (a, False)  # 0: no bound


def test_a_placement_says_where_a_hedge_took_its_prefill_and_why():
    """The console's waterfall and the debug log read these (placement/decision.py)."""
    from types import SimpleNamespace

    from epd_proxy.placement.decision import Placement

    first, second, decode = (SimpleNamespace(url=u) for u in ("http://p0", "http://p1", "http://d0"))
    placed = Placement(decode, "least-loaded", first, "least-loaded", "nixl")  # type: ignore[arg-type]
    assert "hedged" not in placed.summary() and "hedged" not in placed.reasons()
    placed.prefill, placed.prefill_why, placed.hedged = second, "hedge: http://p0 had not answered in 100 ms", first
    summary = placed.summary()
    assert summary["prefill"] == {"instance": "http://p1", "why": "hedge: http://p0 had not answered in 100 ms"}
    assert summary["hedged"] == "http://p0" and placed.reasons()["hedged"] == "http://p0"
