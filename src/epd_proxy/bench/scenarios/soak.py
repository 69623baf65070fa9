"""soak: a mixed workload for a long time: memory must stay flat, with no errors or mismatches."""

from __future__ import annotations

import asyncio
import math
import time

from epd_proxy.bench.lab import Lab, lab_settings, workload_requests
from epd_proxy.bench.loadgen import Phase
from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.scenarios.base import Limit, Scenario, target_check

perf = time.perf_counter


def add_arguments(group) -> None:
    group.add_argument("--soak-duration", type=float, default=600.0, help="soak: seconds of mixed load (>= 10 min "
                       "for the published figure)")
    group.add_argument("--soak-concurrency", type=int, default=64)


async def run(args) -> dict:
    """A mixed workload for a long time: memory must stay flat, with no errors or mismatches."""
    dur, conc = args.soak_duration, args.soak_concurrency
    warm = min(30.0, 0.1 * dur)
    settings = lab_settings(args)
    with Lab(settings) as lab:
        lab.pin_self()
        lab.start_sim()
        proxy = lab.start_proxy()
        svc = proxy.service
        assert svc is not None  # epd-proxy runs as a process of its own
        reqs = workload_requests(args, "mixed")
        ph = Phase(proxy.url, reqs, concurrency=conc, warmup=warm, duration=dur - warm, max_requests=None,
                   verify=True, label="soak", progress=args.progress, seed=args.seed,
                   client=proxy.make_client(conc))
        interval = max(0.2, min(5.0, dur / 120))
        samples: list[dict] = []
        t0 = perf()
        task = asyncio.get_running_loop().create_task(ph.run())
        while not task.done():
            samples.append({"t": perf() - t0, "rss_mb": svc.rss_bytes() / 2**20, "cpu_s": svc.cpu_seconds()})
            await asyncio.wait((task,), timeout=interval)
        await task
        s = ph.summary()
    window = [x for x in samples if warm <= x["t"] <= dur]
    start = window[0]["rss_mb"] if window else math.nan
    end = window[-1]["rss_mb"] if window else math.nan
    n = s["requests"]
    return {
        "duration_s": dur, "warmup_s": warm, "concurrency": conc,
        "requests": n, "ok": s["ok"], "errors": s["errors"], "error_examples": s["error_examples"],
        "verify_errors": s["verify_errors"], "outside_window": s["outside_window"],
        "req_s": s["req_s"], "e2e_ms": s["e2e_ms"],
        "rss_start_mb": start, "rss_end_mb": end,
        "rss_growth_pct": 100.0 * (end - start) / start if start else math.nan,
        "rss_growth_bytes_per_request": (end - start) * 2**20 / n if n else math.nan,
        "samples": samples,
    }


def section(r: dict, plots: dict) -> list[str]:
    return ["## Soak: mixed load over time", "",
            table(["duration", "concurrency", "requests", "req/s", "errors / mismatches", "RSS start → end MiB",
                    "growth", "bytes per request"],
                   [[f"{fmt(r['duration_s'], 0)} s", str(r["concurrency"]), str(r["requests"]), fmt(r["req_s"], 1),
                     f"{r['errors']} / {r['verify_errors']}", f"{fmt(r['rss_start_mb'], 1)} → "
                     f"{fmt(r['rss_end_mb'], 1)}", f"{fmt(r['rss_growth_pct'], 2)} %",
                     fmt(r["rss_growth_bytes_per_request"], 1)]]), ""]


LIMITS = {"soak_flat": Limit("Memory growth over the soak (mixed load)", 5.0, "%", "<=")}


def checks(r: dict) -> list[dict]:
    if "rss_growth_pct" not in r:
        return []
    c = target_check("soak_flat", LIMITS["soak_flat"], r["rss_growth_pct"], "soak",
                     f"{r['requests']} requests in {fmt(r['duration_s'], 0)} s at concurrency "
                     f"{r['concurrency']}; errors {r['errors']}, mismatches {r['verify_errors']}")
    if r.get("errors"):
        c["met"] = False
    return [c]


SCENARIO = Scenario("soak", run=run, section=section, add_arguments=add_arguments, checks=checks)
