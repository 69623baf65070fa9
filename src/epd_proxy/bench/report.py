"""The benchmark report: JSON (everything), Markdown (what a user reads) and PNG plots
(what a user looks at). It assembles what the scenarios bring
(:mod:`epd_proxy.bench.scenarios`): the frame, the targets table with every scenario's
checks and the byte-exact verification over them all, the plot files, the JSON."""

from __future__ import annotations

import json
import math
import os
import sys

from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.scenarios import SCENARIOS, TARGETS_ORDER
from epd_proxy.bench.scenarios.base import Figures


def _in_targets_order(names) -> list[str]:
    names = list(names)
    return ([n for n in TARGETS_ORDER if n in names]
            + [n for n in SCENARIOS if n not in TARGETS_ORDER and n in names])


def checks(result: dict) -> list[dict]:
    """Each target of the issue against what this run measured (only what ran)."""
    out: list[dict] = []
    sc = result.get("scenarios", {})
    for name in _in_targets_order(sc):
        r = sc[name]
        if isinstance(r, dict):
            out.extend(SCENARIOS[name].checks(r))
    verify = 0
    for r in sc.values():
        verify += _count_verify(r)
    out.append({"key": "verify", "target": "Byte-exact verification of every response", "limit": "0 mismatches",
                "measured": verify, "unit": "", "met": verify == 0, "source": "all", "note": "",
                "verify_errors": verify})
    return out


def _count_verify(obj) -> int:
    n = 0
    if isinstance(obj, dict):
        if "verify_errors" in obj and isinstance(obj["verify_errors"], int) and "outside_window" in obj:
            n += obj["verify_errors"] + obj["outside_window"].get("verify_errors", 0)
        elif "verify_errors" in obj and isinstance(obj["verify_errors"], int) and "workers" in obj:
            n += obj["verify_errors"]  # a scale run
        for k, v in obj.items():
            if k in ("summary",):
                continue
            n += _count_verify(v)
    elif isinstance(obj, list):
        for v in obj:
            n += _count_verify(v)
    return n


# -- Markdown -------------------------------------------------------------------------------------
def _met(c: dict) -> str:
    return {True: "met", False: "**missed**", None: "–"}[c["met"]]


def markdown(result: dict, plots: dict[str, str] | None = None) -> str:
    plots = plots or {}
    meta = result.get("meta", {})
    m = meta.get("machine", {})
    out = ["# epd-proxy benchmark report", ""]
    out.append(f"- command: `{meta.get('command', '')}`")
    out.append(f"- when: {meta.get('started', '')} – {meta.get('finished', '')}; git {m.get('git', '?')}")
    out.append(f"- machine: {m.get('cpus')} × {m.get('cpu', '?')}, {m.get('memory', '')}, Linux {m.get('kernel')}, "
               f"Python {m.get('python')}, uvloop {m.get('uvloop')}")
    bg = meta.get("background_cpu_cores")
    if bg is not None:
        out.append(f"- other load on the machine before the run: {fmt(bg)} cores busy")
    out.append("")
    cks = result.get("checks") or []
    if cks:
        out += ["## Targets", ""]
        rows = [[c["target"], c["limit"], fmt(c["measured"]) + (f" {c['unit']}" if c["unit"] else ""), _met(c),
                 c.get("note", "")] for c in cks]
        out += [table(["target", "limit", "measured", "", "notes"], rows), ""]
    sc = result.get("scenarios", {})
    for name, r in sc.items():
        if isinstance(r, dict) and "error" in r and len(r) == 1:
            out += [f"## {name}", "", f"failed: `{r['error']}`", ""]
            continue
        scenario = SCENARIOS.get(name)
        if scenario is not None:
            out += scenario.section(r, plots)
    return "\n".join(out) + "\n"


# -- plots ------------------------------------------------------------------------------------------
def make_plots(result: dict, outdir: str) -> dict[str, str]:
    """PNG files next to the report, each scenario's; returns {name: file name}. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the optional 'bench' extra
        print("bench: no plots: matplotlib is not installed (pip install 'epd-proxy[bench]', or --no-plots)",
              file=sys.stderr)
        return {}
    figures = Figures(plt, outdir)
    out: dict[str, str] = {}
    for name, r in result.get("scenarios", {}).items():
        scenario = SCENARIOS.get(name)
        if scenario is not None and scenario.plot is not None and isinstance(r, dict):
            out.update(scenario.plot(r, figures))
    return out


def _clean(o):
    if isinstance(o, float):
        return None if math.isnan(o) or math.isinf(o) else o
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def write(result: dict, outdir: str, *, plots: bool = True) -> dict:
    os.makedirs(outdir, exist_ok=True)
    pl = make_plots(result, outdir) if plots else {}
    jpath = os.path.join(outdir, "report.json")
    with open(jpath, "w") as f:
        json.dump(_clean(result), f, indent=1, default=str)
    mpath = os.path.join(outdir, "report.md")
    with open(mpath, "w") as f:
        f.write(markdown(result, pl))
    return {"json": jpath, "markdown": mpath, "plots": pl}


def console_summary(result: dict) -> str:
    lines = ["", "== targets =="]
    for c in result.get("checks", []):
        lines.append(f"  [{ {True: 'met', False: 'MISSED', None: ' - '}[c['met']]:6s}] {c['target']}: "
                     f"{fmt(c['measured'])} {c['unit']} (limit {c['limit']}) {c.get('note', '')}")
    return "\n".join(lines)
