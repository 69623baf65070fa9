"""``--url``: load against one endpoint only (no simulator, no comparison); ``--pid`` also
measures that server's CPU."""

from __future__ import annotations

from dataclasses import replace

from epd_proxy.bench import targets as T
from epd_proxy.bench.lab import Lab, lab_settings, workload_requests
from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.procs import tree_cpu_seconds, tree_rss_bytes
from epd_proxy.bench.scenarios.base import Scenario


class _External:
    """A process we did not start, measured by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid)

    def rss_bytes(self) -> int:
        return tree_rss_bytes(self.pid)


async def run(args) -> dict:
    """Load against ``--url`` only."""
    lab = Lab(lab_settings(args))
    target = T.Target("url", args.url.rstrip("/"), None)
    if args.pid:
        target.service = _External(args.pid)  # type: ignore[assignment]
    out: dict = {"url": args.url, "workloads": {}}
    verify = args.verify == "on"
    for name in args.workloads:
        reqs = workload_requests(args, name)
        if not verify:
            reqs = [replace(r, expected=None) for r in reqs]
        res = await lab.phase(target, reqs, concurrency=args.concurrency, rate=args.rate, warmup=args.warmup,
                              duration=args.duration, max_requests=args.requests, verify=verify,
                              label=f"{name} {args.url}", progress=args.progress, seed=args.seed)
        out["workloads"][name] = res
    return out


def section(r: dict, plots: dict) -> list[str]:
    out = [f"## {r.get('url')}", ""]
    rows = []
    for wl, w in r.get("workloads", {}).items():
        rows.append([wl, fmt(w["req_s"], 1), f"{fmt(w['ttft_ms']['p50'])} / {fmt(w['ttft_ms']['p99'])}",
                     f"{fmt(w['itl_ms']['p50'])} / {fmt(w['itl_ms']['p99'])}",
                     f"{fmt(w['e2e_ms']['p50'])} / {fmt(w['e2e_ms']['p99'])}",
                     fmt(w.get("target_cpu_ms_per_req"), 3), f"{w['errors']} / {w['verify_errors']}",
                     str(w["requests"])])
    out += [table(["workload", "req/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "E2E p50/p99 ms",
                    "server CPU ms/req", "errors / mismatches", "requests"], rows), ""]
    return out


SCENARIO = Scenario("url", run=run, section=section, by_name=False)
