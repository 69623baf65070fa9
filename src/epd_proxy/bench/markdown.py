"""Figures and tables as the benchmark report writes them: the report's frame and every
scenario's section format numbers, ``median [min–max]`` ranges and Markdown tables alike."""

from __future__ import annotations

import math


def missing(x) -> bool:
    """No figure: ``None`` or NaN (a JSON report turns NaN into ``null``)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt(x, digits: int = 2) -> str:
    if missing(x):
        return "–"
    if isinstance(x, int):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}f}"


def fmt_range(mr: dict | None, digits: int = 2) -> str:
    """``median [min–max]`` (just the value when there is one run)."""
    if not mr or missing(mr.get("median")):
        return "–"
    if mr.get("n", 1) <= 1 or mr["min"] == mr["max"]:
        return fmt(mr["median"], digits)
    return f"{fmt(mr['median'], digits)} [{fmt(mr['min'], digits)}–{fmt(mr['max'], digits)}]"


def pct(mr: dict | None) -> dict | None:
    """A ``median_range`` of shares as percentages."""
    if not mr:
        return None
    return {k: (v * 100 if k != "n" and not missing(v) else v) for k, v in mr.items()}


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
