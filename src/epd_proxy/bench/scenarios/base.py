"""What a scenario is: the one shape every module in :mod:`epd_proxy.bench.scenarios`
fills in, and the few helpers they share.

A scenario brings everything of its own: its flags, the run (a coroutine returning a
JSON-able dict), its section of the Markdown report, its figures and its checks
against the targets. The report only assembles them, so adding a scenario is one
module and its line in ``SCENARIOS``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, NamedTuple

from epd_proxy.bench.markdown import missing


class Limit(NamedTuple):
    """One of the issue's targets: what is measured, the limit, its unit and which side is good."""

    description: str
    limit: float
    unit: str
    op: str  # "<=" or ">="


def target_check(key: str, limit: Limit, measured, source: str, note: str = "") -> dict:
    """A row of the report's targets table: ``measured`` against ``limit`` (met is None
    when nothing was measured)."""
    met = None
    if not missing(measured):
        met = measured <= limit.limit if limit.op == "<=" else measured >= limit.limit
    return {"key": key, "target": limit.description, "limit": f"{limit.op} {limit.limit:g} {limit.unit}".strip(),
            "measured": measured, "unit": limit.unit, "met": met, "source": source, "note": note}


class Figures:
    """Where a scenario draws: ``new`` makes a figure (matplotlib's ``subplots``), ``save``
    finishes its axes the one way every plot of the report does (grid, legend) and writes
    it next to the report, returning the file name."""

    def __init__(self, plt, outdir: str) -> None:
        self.plt = plt
        self.outdir = outdir

    def new(self, *args, **kw):
        return self.plt.subplots(*args, **kw)

    def save(self, fig, axes, filename: str, *, grid_axis: str = "both", legend_size: int = 8) -> str:
        for ax in axes:
            ax.grid(axis=grid_axis, alpha=0.3)
            ax.legend(fontsize=legend_size)
        fig.tight_layout()
        fig.savefig(os.path.join(self.outdir, filename), dpi=110)
        self.plt.close(fig)
        return filename


def _no_arguments(group) -> None:
    pass


def _no_checks(result: dict) -> list[dict]:
    return []


@dataclass(frozen=True)
class Scenario:
    """A scenario of ``epd-proxy bench``.

    ``add_arguments(group)`` adds its flags to the help's "scenarios" group, or to a group
    of its own titled ``group`` when that is set; ``run(args)`` measures; ``section(result,
    plots)`` is its part of the Markdown report (``plots``: every figure's file by key);
    ``plot(result, figures)`` draws its figures and returns ``{key: file name}``;
    ``checks(result)`` judges the targets it measures. ``by_name``: chosen with
    ``--scenario`` (``url`` is chosen by ``--url`` instead)."""

    name: str
    run: Callable[[argparse.Namespace], Coroutine[Any, Any, dict]]
    section: Callable[[dict, dict], list[str]]
    add_arguments: Callable[[Any], None] = _no_arguments
    plot: Callable[[dict, Figures], dict[str, str]] | None = None
    checks: Callable[[dict], list[dict]] = _no_checks
    group: str | None = None
    by_name: bool = True


# Flag values. The parsers' names show in argparse's errors ("invalid _floats value"), so they keep them.
def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _floats(text: str) -> list[float]:
    return [float(p) for p in _csv(text)]


def _ints(text: str) -> list[int]:
    return [int(p) for p in _csv(text)]


csv_list, float_list, int_list = _csv, _floats, _ints


def tty(args) -> bool:
    """Progress lines that redraw themselves only on a terminal."""
    return bool(args.progress) and sys.stderr.isatty()


def copy_args(args, **changes):
    """The command line's arguments with some changed, for a scenario that runs another's machinery."""
    ns = argparse.Namespace(**vars(args))
    for k, v in changes.items():
        setattr(ns, k, v)
    return ns
