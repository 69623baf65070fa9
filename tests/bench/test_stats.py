import math

import pytest

from epd_proxy.bench.stats import cdf_points, linear_fit, median_range, percentile, poisson_schedule, ratio, summarize


def test_percentile_interpolates_like_numpy_default():
    data = [1.0, 2.0, 3.0, 4.0]
    assert percentile(data, 0) == 1.0
    assert percentile(data, 100) == 4.0
    assert percentile(data, 50) == 2.5
    assert percentile(data, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(data, 101)


def test_percentile_of_1_to_100():
    data = [float(i) for i in range(1, 101)]
    assert percentile(data, 99) == pytest.approx(99.01)
    assert percentile(data, 50) == pytest.approx(50.5)


def test_summarize_scales_and_orders():
    s = summarize([0.003, 0.001, 0.002], scale=1000.0)
    assert s["count"] == 3
    assert s["min"] == pytest.approx(1.0)
    assert s["max"] == pytest.approx(3.0)
    assert s["p50"] == pytest.approx(2.0)
    assert s["mean"] == pytest.approx(2.0)
    assert s["p50"] <= s["p90"] <= s["p99"] <= s["max"]


def test_summarize_empty():
    s = summarize([])
    assert s["count"] == 0
    assert math.isnan(s["p99"])


def test_median_range_ignores_nan():
    mr = median_range([3.0, float("nan"), 1.0, 2.0, None])
    assert mr == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert median_range([])["n"] == 0


def test_poisson_schedule_is_seeded_and_has_the_rate():
    a = poisson_schedule(100.0, count=5000, seed=7)
    b = poisson_schedule(100.0, count=5000, seed=7)
    c = poisson_schedule(100.0, count=5000, seed=8)
    assert a == b
    assert a != c
    assert len(a) == 5000
    assert all(x < y for x, y in zip(a, a[1:]))
    # Mean inter-arrival 1/rate within a few percent for 5000 arrivals.
    assert a[-1] / len(a) == pytest.approx(0.01, rel=0.05)


def test_poisson_schedule_by_duration():
    s = poisson_schedule(50.0, duration=10.0, seed=1)
    assert s and s[-1] <= 10.0
    assert 400 < len(s) < 600
    with pytest.raises(ValueError):
        poisson_schedule(0.0, count=3)
    with pytest.raises(ValueError):
        poisson_schedule(1.0)


def test_linear_fit_exact_line():
    fit = linear_fit([0.25, 0.5, 1, 2, 4], [1.5 + 2 * x for x in [0.25, 0.5, 1, 2, 4]])
    assert fit["slope"] == pytest.approx(2.0)
    assert fit["intercept"] == pytest.approx(1.5)
    assert fit["r2"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        linear_fit([1.0], [1.0])


def test_cdf_points_end_at_one():
    xs, ys = cdf_points(range(1000), max_points=100)
    assert len(xs) <= 102
    assert ys[-1] == 1.0 and xs[-1] == 999
    assert all(a <= b for a, b in zip(xs, xs[1:]))
    assert cdf_points([]) == ([], [])


def test_ratio():
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0))
