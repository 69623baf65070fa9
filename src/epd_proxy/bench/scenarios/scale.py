"""scale: thousands of slow streams through one proxy: memory and CPU per 1k streams."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from typing import Any

from epd_proxy.bench.exchange import send
from epd_proxy.bench.lab import ForeignMeter, Lab, lab_settings, workload_requests
from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.procs import nofile_limits, self_cpu_seconds
from epd_proxy.bench.scenarios.base import Figures, Limit, Scenario, target_check, tty
from epd_proxy.bench.stats import summarize
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts

perf = time.perf_counter


def add_arguments(group) -> None:
    group.add_argument("--scale-streams", type=int, default=10000)
    group.add_argument("--scale-ramp", type=float, default=20.0, help="scale: seconds to open all streams")
    group.add_argument("--scale-hold", type=float, default=30.0, help="scale: seconds at full load (measured)")


async def run(args) -> dict:
    """Thousands of concurrent slow streams (one token per second) through one proxy."""
    n = args.scale_streams
    soft, hard = nofile_limits()
    out: dict = {"streams": n, "nofile": [soft, hard], "runs": []}
    need = 2 * n + 256  # client side + decode side per stream, plus pools and files
    plans = []
    if need <= hard:
        plans.append((1, n))
    else:
        n1 = max(500, ((hard - 256) // 2) // 500 * 500)
        plans.append((1, min(n, n1)))
        plans.append((2, n))
        out["note"] = (f"one process can hold at most {hard} descriptors here (ulimit -Hn, not raisable "
                       f"without CAP_SYS_RESOURCE) and a stream needs two (client + decode): one worker is "
                       f"measured at {min(n, n1)} streams, {n} streams with --workers 2")
    for workers, streams in plans:
        out["runs"].append(await _scale_once(args, workers, streams, hard))
    return out


async def _scale_once(args, workers: int, n: int, nofile: int) -> dict:
    ramp, hold, settle = args.scale_ramp, args.scale_hold, 3.0
    tokens = int(math.ceil(ramp + settle + hold + 3))
    settings = lab_settings(args, sim={"itl_ms": 1000.0, "max_num_seqs": n + 1000}, nofile=nofile)
    res: dict = {"workers": workers, "streams": n, "tokens_per_stream": tokens, "ramp_s": ramp, "hold_s": hold}
    with Lab(settings) as lab:
        lab.pin_self()
        lab.start_sim()
        proxy = lab.start_proxy(workers=workers)
        svc = proxy.service
        assert svc is not None  # epd-proxy runs as a process of its own
        await asyncio.sleep(1.0)
        reqs = workload_requests(args, "stream", max_tokens=tokens)
        pool = ConnectionPool(proxy.url, idle_timeout=30.0, max_idle=n + 100)
        timeouts = TransportTimeouts(connect=30, headers=120, idle=120)
        state: dict[str, Any] = {"active": 0, "ok": 0, "errors": 0, "verify_errors": 0, "examples": [], "ttft": [],
                                 "itl": []}
        stop = asyncio.Event()
        rss0 = svc.rss_bytes()
        cpu_idle0 = svc.cpu_seconds()
        samples: list[dict] = []
        t_start = perf()

        async def slot(i: int) -> None:
            k = i
            while not stop.is_set():
                state["active"] += 1
                try:
                    o = await send(pool, reqs[k % len(reqs)], timeouts)
                finally:
                    state["active"] -= 1
                k += n
                if o.ok:
                    state["ok"] += 1
                    if o.ttft is not None:
                        state["ttft"].append(o.ttft)
                    if o.itl:
                        state["itl"].extend(o.itl[:5])
                else:
                    state["errors"] += 1
                    if o.verify_error:
                        state["verify_errors"] += 1
                    if len(state["examples"]) < 5:
                        state["examples"].append(o.error)

        def sample(tag: str = "") -> dict:
            s = {"t": perf() - t_start, "active": state["active"], "rss_mb": svc.rss_bytes() / 2**20,
                 "cpu_s": svc.cpu_seconds(), "tag": tag}
            samples.append(s)
            return s

        async def sampler() -> None:
            while True:
                await asyncio.sleep(1.0)
                s = sample()
                if tty(args):
                    print(f"\rscale w={workers}: {s['active']:6d} streams open, proxy RSS {s['rss_mb']:.0f} MiB, "
                          f"ok {state['ok']} err {state['errors']}   ", end="", file=sys.stderr, flush=True)

        loop = asyncio.get_running_loop()
        sampler_task = loop.create_task(sampler())
        tasks = []
        milestones = []
        t0 = perf()
        for i in range(n):
            tasks.append(loop.create_task(slot(i)))
            if (i + 1) % 1000 == 0 or i + 1 == n:
                await asyncio.sleep(0.3)
                milestones.append({"opened": i + 1, **sample("ramp")})
            delay = t0 + ramp * (i + 1) / n - perf()
            if delay > 0:
                await asyncio.sleep(delay)
        await asyncio.sleep(settle)
        h0 = sample("hold-start")
        meter = ForeignMeter(lab).start()
        lg0 = self_cpu_seconds()
        assert lab.sim_service is not None  # started with the lab
        sim0 = lab.sim_service.cpu_seconds()
        await asyncio.sleep(hold)
        h1 = sample("hold-end")
        foreign = meter.stop()
        lg1 = self_cpu_seconds()
        sim1 = lab.sim_service.cpu_seconds()
        stop.set()
        # Let every stream finish (and be verified).
        done, pending = await asyncio.wait(tasks, timeout=tokens + 60)
        for t in pending:
            t.cancel()
        sampler_task.cancel()
        await pool.close()
        if tty(args):
            print("", file=sys.stderr)
        per_stream = [(m["rss_mb"] - rss0 / 2**20) / m["opened"] * 1000 for m in milestones if m["opened"]]
        full = n / 1000.0
        cpu_hold = h1["cpu_s"] - h0["cpu_s"]
        res.update({
            "rss_idle_mb": rss0 / 2**20,
            "milestones": milestones,
            "samples": samples,
            "rss_full_mb": h0["rss_mb"],
            "rss_per_1k_streams_mb": (h0["rss_mb"] - rss0 / 2**20) / full,
            "rss_per_1k_by_milestone_mb": per_stream,
            "rss_hold_growth_mb": h1["rss_mb"] - h0["rss_mb"],
            "rss_hold_growth_pct": 100.0 * (h1["rss_mb"] - h0["rss_mb"]) / h0["rss_mb"] if h0["rss_mb"] else math.nan,
            "active_during_hold": [h0["active"], h1["active"]],
            "proxy_cpu_util_hold": cpu_hold / hold,
            "cpu_ms_per_s_per_1k_streams": 1000.0 * cpu_hold / hold / full,
            "sim_cpu_util_hold": (sim1 - sim0) / hold,
            "loadgen_cpu_util_hold": (lg1 - lg0) / hold,
            "idle_cpu_s": cpu_idle0,
            "foreign_cpu_util": foreign,
            "ok": state["ok"], "errors": state["errors"], "verify_errors": state["verify_errors"],
            "error_examples": state["examples"],
            "ttft_ms": summarize(state["ttft"], 1000),
            "itl_ms": summarize(state["itl"], 1000),
            "unfinished": len(pending),
        })
    return res


def section(r: dict, plots: dict) -> list[str]:
    out = ["## Scale: slow streams", ""]
    if r.get("note"):
        out += [r["note"], ""]
    rows = []
    for run in r.get("runs", []):
        rows.append([str(run["workers"]), str(run["streams"]), f"{run['tokens_per_stream']} × 1 s",
                     fmt(run["rss_idle_mb"], 1), fmt(run["rss_full_mb"], 1), fmt(run["rss_per_1k_streams_mb"], 2),
                     f"{fmt(run['rss_hold_growth_mb'], 1)} ({fmt(run['rss_hold_growth_pct'], 2)} %)",
                     fmt(run["cpu_ms_per_s_per_1k_streams"], 1), fmt(100 * run["proxy_cpu_util_hold"], 1),
                     fmt(100 * run["sim_cpu_util_hold"], 0) + " / " + fmt(100 * run["loadgen_cpu_util_hold"], 0),
                     f"{run['ok']} / {run['errors']} / {run['verify_errors']}"])
    out += [table(["workers", "streams", "tokens", "RSS idle MiB", "RSS full MiB", "MiB per 1k streams",
                    "RSS growth over hold", "CPU ms/s per 1k streams", "proxy core %", "sim / loadgen core %",
                    "ok / errors / mismatches"], rows), ""]
    if "scale" in plots:
        out += [f"![proxy memory against open streams]({plots['scale']})", ""]
    return out


LIMITS = {"scale_flat": Limit("Memory growth while holding the streams", 5.0, "%", "<=")}


def plot(r: dict, figures: Figures) -> dict[str, str]:
    if not r.get("runs"):
        return {}
    fig, ax = figures.new(figsize=(7, 4))
    for run in r["runs"]:
        s = run.get("samples", [])
        ax.plot([x["active"] for x in s], [x["rss_mb"] for x in s], ".", ms=3,
                label=f"{run['workers']} worker(s), up to {run['streams']}")
    ax.set_xlabel("open streams")
    ax.set_ylabel("proxy RSS (MiB, all processes)")
    ax.set_title("proxy memory against open streams")
    return {"scale": figures.save(fig, [ax], "scale_rss.png")}


def checks(r: dict) -> list[dict]:
    out: list[dict] = []
    for run in r.get("runs") or []:
        c = target_check("scale_flat", LIMITS["scale_flat"], run.get("rss_hold_growth_pct"), f"scale/{run['workers']}w",
                         f"{run['streams']} streams, {fmt(run.get('rss_per_1k_streams_mb'))} MiB and "
                         f"{fmt(run.get('cpu_ms_per_s_per_1k_streams'))} ms CPU/s per 1k streams; "
                         f"errors {run.get('errors')}")
        c["target"] += f" ({run['streams']} streams, {run['workers']} worker{'s' if run['workers'] > 1 else ''})"
        if run.get("errors"):
            c["met"] = False
        out.append(c)
    return out


SCENARIO = Scenario("scale", run=run, section=section, add_arguments=add_arguments, plot=plot, checks=checks)
