"""throughput: fast backends (short token delay, few tokens), so what one proxy core sustains
is the cap. The same machinery as ``compare``."""

from __future__ import annotations

import argparse

from epd_proxy.bench.markdown import fmt
from epd_proxy.bench.scenarios.base import Limit, Scenario, copy_args, target_check
from epd_proxy.bench.scenarios.compare import run_compare
from epd_proxy.bench.scenarios.compare import section as compare_section


def add_arguments(group) -> None:
    group.add_argument("--throughput-concurrency", type=int, default=128)
    group.add_argument("--throughput-tokens", type=int, default=16)
    group.add_argument("--throughput-itl-ms", type=float, default=1.0)
    group.add_argument("--throughput-spill", action=argparse.BooleanOptionalAction, default=True,
                       help="throughput: let the load use the proxy's core too, at SCHED_IDLE priority")


async def run(args) -> dict:
    """Fast backends: the proxy core is the cap. Same machinery as compare."""
    a = copy_args(args, itl_ms=args.throughput_itl_ms, max_tokens=args.throughput_tokens,
                   concurrency=args.throughput_concurrency, workloads=["mm", "stream", "nonstream"],
                   sweep=[], requests=None, repeat=max(1, min(args.repeat, 3)), spill=args.throughput_spill)
    out = await run_compare(a, progress=args.progress)
    out["note"] = (f"Backends made fast so they are not the cap: {a.itl_ms:g} ms between tokens, "
                   f"{a.max_tokens} tokens per request, concurrency {a.concurrency}."
                   + (" Simulator and load generator may also use the proxy's core, at SCHED_IDLE priority "
                      "(only time the proxy leaves), so the proxy is what saturates; 'direct' then has both "
                      "cores." if a.spill else ""))
    return out


LIMITS = {"throughput_mm": Limit("E+P+D req/s on one proxy core (fast backends)", 450.0, "req/s", ">=")}


def section(r: dict, plots: dict) -> list[str]:
    return compare_section(r, {}, title="Throughput with fast backends")


def checks(r: dict) -> list[dict]:
    if "workloads" not in r:
        return []
    ep = r["workloads"].get("mm", {}).get("summary", {}).get("epd-proxy")
    if not ep:
        return []
    return [target_check("throughput_mm", LIMITS["throughput_mm"], ep["req_s"]["median"], "throughput/mm",
                         f"proxy core at {fmt(100 * ep['target_cpu_util']['median'], 0)} %, load core at "
                         f"{fmt(100 * ep['load_core_util']['median'], 0)} %")]


SCENARIO = Scenario("throughput", run=run, section=section, add_arguments=add_arguments, checks=checks)
