"""Percentiles, summaries, fits and arrival schedules: pure functions."""

from __future__ import annotations

import math
import random
from typing import Iterable, Sequence

QUANTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, linearly
    interpolated between closest ranks (numpy's default). NaN when empty."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError("q must be within [0, 100]")
    if n == 1:
        return float(sorted_values[0])
    pos = (n - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo]) + (float(sorted_values[hi]) - float(sorted_values[lo])) * frac


def summarize(values: Iterable[float], scale: float = 1.0) -> dict:
    """count, mean, min, p50, p90, p99, max of ``values`` times ``scale``
    (e.g. 1000 for seconds -> milliseconds). Empty input gives count 0 and NaNs."""
    data = sorted(v * scale for v in values)
    n = len(data)
    out: dict[str, float] = {"count": n}
    if n == 0:
        out.update(mean=math.nan, min=math.nan, max=math.nan, **{f"p{q}": math.nan for q in QUANTILES})
        return out
    out["mean"] = sum(data) / n
    out["min"] = data[0]
    for q in QUANTILES:
        out[f"p{q}"] = percentile(data, q)
    out["max"] = data[-1]
    return out


def median_range(values: Iterable[float]) -> dict:
    """Median with min and max, ignoring NaN/None: how repeats are reported."""
    data = sorted(v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)))
    if not data:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": percentile(data, 50), "min": data[0], "max": data[-1], "n": len(data)}


def poisson_schedule(rate: float, *, count: int | None = None, duration: float | None = None,
                     seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of a Poisson process with ``rate`` per
    second, until ``count`` arrivals or ``duration`` seconds, whichever is first.
    The same seed gives the same schedule."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if count is None and duration is None:
        raise ValueError("a Poisson schedule needs a count or a duration")
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while count is None or len(out) < count:
        t += rng.expovariate(rate)
        if duration is not None and t > duration:
            break
        out.append(t)
    return out


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict:
    """Least-squares line y = slope * x + intercept, with R^2."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError("need at least two (x, y) pairs")
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all x are equal")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return {"slope": slope, "intercept": intercept, "r2": r2}


def cdf_points(values: Iterable[float], max_points: int = 400) -> tuple[list[float], list[float]]:
    """(x, F(x)) of the empirical CDF, thinned to at most ``max_points`` points."""
    data = sorted(values)
    n = len(data)
    if n == 0:
        return [], []
    step = max(1, n // max_points)
    xs = data[::step]
    ys = [(i * step + 1) / n for i in range(len(xs))]
    if xs[-1] != data[-1] or ys[-1] != 1.0:
        xs.append(data[-1])
        ys.append(1.0)
    return xs, ys


def ratio(a: float, b: float) -> float:
    """a / b, NaN when undefined."""
    if b is None or a is None or b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b
