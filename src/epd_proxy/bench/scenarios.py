"""The benchmark's scenarios. Each ``run_<name>(args)`` is a coroutine returning a
JSON-able dict; :mod:`epd_proxy.bench.report` renders them and checks the targets.

compare     every workload against direct / epd-proxy / vllm-router / nginx, interleaved, repeated
latency     concurrency 1: TTFT through the proxy minus the stage times measured directly
throughput  fast backends (short token delay, few tokens): what one proxy core sustains
scale       thousands of slow streams: memory and CPU per 1k streams
workers     ``--workers 2`` against one worker, each worker held to a CPU quota
media       big images through the encoder stage: CPU against image size
push        TTFT in NIXL push mode against pull mode
overload    a burst of slow streams past the admission limit, slowloris and normal traffic alongside
soak        a mixed workload for a long time: RSS growth, errors, mismatches
cluster     routing policies on a simulated cluster with caches (bench/cluster.py)
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from dataclasses import replace
from typing import Any

import msgspec

from epd_proxy.bench import targets as T
from epd_proxy.bench.cluster import run_cluster  # noqa: F401  (the cluster scenario: ``run_<name>`` is looked up here)
from epd_proxy.bench.compare import ForeignMeter, Lab, lab_settings, summarize_runs, workload_requests
from epd_proxy.bench.compare import run_compare as _run_compare
from epd_proxy.bench.exchange import send
from epd_proxy.bench.procs import (
    cross_core_rtt,
    nofile_limits,
    pin,
    self_cpu_seconds,
    steal_ticks,
    tree_cpu_seconds,
    tree_pids,
    tree_rss_bytes,
)
from epd_proxy.bench.stats import linear_fit, median_range, summarize
from epd_proxy.bench.workloads import Prepared, chat_body, make_workload, simulator_expected
from epd_proxy.http.client import ConnectionPool, TransportTimeouts, UpstreamError
from epd_proxy.runtime.serve import tune_gc

perf = time.perf_counter


def _tty(args) -> bool:
    """Progress lines that redraw themselves only on a terminal."""
    return bool(args.progress) and sys.stderr.isatty()


# -- url ----------------------------------------------------------------------------------------
class _External:
    """A process we did not start, measured by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid)

    def rss_bytes(self) -> int:
        return tree_rss_bytes(self.pid)


async def run_url(args) -> dict:
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


# -- compare ------------------------------------------------------------------------------------
async def run_compare(args) -> dict:
    return await _run_compare(args, progress=args.progress)


# -- throughput -----------------------------------------------------------------------------------
async def run_throughput(args) -> dict:
    """Fast backends: the proxy core is the cap. Same machinery as compare."""
    a = _copy_args(args, itl_ms=args.throughput_itl_ms, max_tokens=args.throughput_tokens,
                   concurrency=args.throughput_concurrency, workloads=["mm", "stream", "nonstream"],
                   sweep=[], requests=None, repeat=max(1, min(args.repeat, 3)), spill=args.throughput_spill)
    out = await _run_compare(a, progress=args.progress)
    out["note"] = (f"Backends made fast so they are not the cap: {a.itl_ms:g} ms between tokens, "
                   f"{a.max_tokens} tokens per request, concurrency {a.concurrency}."
                   + (" Simulator and load generator may also use the proxy's core, at SCHED_IDLE priority "
                      "(only time the proxy leaves), so the proxy is what saturates; 'direct' then has both "
                      "cores." if a.spill else ""))
    return out


def _copy_args(args, **changes):
    import argparse

    ns = argparse.Namespace(**vars(args))
    for k, v in changes.items():
        setattr(ns, k, v)
    return ns


# -- latency ---------------------------------------------------------------------------------------
async def _stage_calls(pools: dict, prep: Prepared, timeouts: TransportTimeouts) -> dict:
    """The stages the proxy would run, called directly, one after the other: each
    stage's time and decode's TTFT (seconds), or ``error``."""
    from epd_proxy.bench.clients import StageError, run_stages

    try:
        times, o = await run_stages(pools, prep, timeouts)
    except (StageError, UpstreamError, msgspec.DecodeError) as exc:
        return {"error": str(exc)}
    times["error"] = None if o.ok and o.ttft is not None else f"decode: {o.error}"
    return times


class _Seat:
    """Where the load generator sits while it makes the direct stage calls.

    The proxy's own upstream calls start on the proxy's core; on a VM, a wake-up
    across cores costs far more than one on the same core (``cross_core_rtt``), and
    the simulator runs on the load core. Stage times measured from the load core
    would therefore leave out a cost every proxy hop pays, and charge it to the proxy
    as "added" latency. So the stages are called from the proxy's core (at c=1 the
    proxy is idle meanwhile), and from the load core as a second, stricter baseline.
    """

    def __init__(self, proxy_cpus: list[int] | None) -> None:
        self.proxy = set(proxy_cpus) if proxy_cpus else None

    async def stages(self, pools, prep, timeouts, on_proxy_core: bool) -> dict:
        home = os.sched_getaffinity(0)
        proxy = self.proxy
        move = on_proxy_core and proxy is not None and proxy != home
        if move and proxy is not None:
            os.sched_setaffinity(0, proxy)
        try:
            return await _stage_calls(pools, prep, timeouts)
        finally:
            if move:
                os.sched_setaffinity(0, home)


async def _latency_block(args, name, reqs, pools, proxy, timeouts, lab, seat: _Seat) -> dict:
    proxy_ttft, stage_sum, diff, timing = [], [], [], []
    stage_sum_load, diff_load = [], []
    diff_clean = []  # samples during which the hypervisor took no core away (no steal)
    parts: dict = {"encode": [], "prefill": [], "decode_ttft": []}
    errors = 0
    meter = ForeignMeter(lab).start()
    cpu0 = proxy.service.cpu_seconds()
    for i in range(args.latency_samples):
        prep = reqs[i % len(reqs)]
        # Three calls per sample, in a rotating order: stages from the proxy's core,
        # the proxy, stages from the load core.
        order = [("near", "proxy", "far"), ("proxy", "far", "near"), ("far", "near", "proxy")][i % 3]
        got: dict = {}
        steal0 = steal_ticks()
        for what in order:
            if what == "proxy":
                got[what] = await send(pools["proxy"], prep, timeouts)
            else:
                got[what] = await seat.stages(pools, prep, timeouts, on_proxy_core=what == "near")
        stolen = steal_ticks() != steal0
        o, st, far = got["proxy"], got["near"], got["far"]
        if st["error"] or far["error"] or not o.ok or o.ttft is None:
            errors += 1
            continue
        s = st["encode"] + st["prefill"] + st["decode_ttft"]
        s_far = far["encode"] + far["prefill"] + far["decode_ttft"]
        proxy_ttft.append(o.ttft)
        stage_sum.append(s)
        diff.append(o.ttft - s)
        if not stolen:
            diff_clean.append(o.ttft - s)
        stage_sum_load.append(s_far)
        diff_load.append(o.ttft - s_far)
        for k in parts:
            parts[k].append(st[k])
        if o.server_timing:
            timing.append(o.server_timing.decode("latin-1"))
        if _tty(args) and i % 20 == 0:
            print(f"\rlatency {name}: {i}/{args.latency_samples}", end="", file=sys.stderr, flush=True)
    cpu1 = proxy.service.cpu_seconds()
    foreign = meter.stop()
    if _tty(args):
        print(f"\rlatency {name}: {args.latency_samples}/{args.latency_samples}", file=sys.stderr)
    n = len(diff)
    return {
        "ok": n, "errors": errors,
        "proxy_ttft_ms": summarize(proxy_ttft, 1000),
        "stage_sum_ms": summarize(stage_sum, 1000),
        "added_ms": summarize(diff, 1000),
        "added_without_steal_ms": summarize(diff_clean, 1000),
        "samples_with_steal": n - len(diff_clean),
        "added_p50_of_medians_ms": summarize(proxy_ttft, 1000)["p50"] - summarize(stage_sum, 1000)["p50"],
        "stage_sum_from_load_core_ms": summarize(stage_sum_load, 1000),
        "added_vs_load_core_ms": summarize(diff_load, 1000),
        "stages_ms": {k: summarize(v, 1000) for k, v in parts.items()},
        "proxy_cpu_ms_per_req": 1000 * (cpu1 - cpu0) / n if n else math.nan,
        "server_timing_example": timing[-1] if timing else None,
        "foreign_cpu_util": foreign,
    }


async def run_latency(args) -> dict:
    """Concurrency 1: TTFT through the proxy against the sum of the stage times, each
    stage called directly by the load generator (one HTTP round trip each, like the
    proxy's own calls) from the proxy's core, and again from the load core (see
    :class:`_Seat`). The three calls of a sample rotate their order."""
    settings = lab_settings(args)
    out: dict = {"samples": args.latency_samples, "tokens": args.latency_tokens, "workloads": {},
                 "sim": settings.sim}
    with Lab(settings) as lab:
        lab.pin_self()
        seat = _Seat(settings.proxy_cpus)
        if settings.proxy_cpus and settings.load_cpus:
            out["wakeup_rtt"] = cross_core_rtt(settings.proxy_cpus[0], settings.load_cpus[0])
        sim = lab.start_sim()
        proxy = lab.add(T.epd_proxy_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir))
        if not proxy.available:
            raise RuntimeError(f"epd-proxy did not start: {proxy.note}")
        timeouts = TransportTimeouts(connect=10, headers=60, idle=60)
        pools: dict[str, Any] = {"encode": ConnectionPool(sim.encode[0]) if sim.encode else None,
                 "prefill": ConnectionPool(sim.prefill[0]), "decode": ConnectionPool(sim.decode[0]),
                 "proxy": ConnectionPool(proxy.url)}
        try:
            for name in ("stream", "mm"):
                if name == "mm" and not sim.encode:
                    continue
                reqs = workload_requests(args, name, max_tokens=args.latency_tokens)
                tune_gc()  # the load generator's own collector pauses are not the proxy's latency
                # Warm every connection first.
                for prep in reqs[:3]:
                    await seat.stages(pools, prep, timeouts, on_proxy_core=True)
                    await seat.stages(pools, prep, timeouts, on_proxy_core=False)
                    await send(pools["proxy"], prep, timeouts)
                tries = 0
                while True:
                    if lab.s.quiet_wait > 0:
                        await lab.wait_quiet()
                    res = await _latency_block(args, name, reqs, pools, proxy, timeouts, lab, seat)
                    if res["foreign_cpu_util"] <= lab.s.max_foreign or tries >= lab.s.retries:
                        res["retries"] = tries
                        break
                    tries += 1
                    print(f"bench: latency {name}: other processes used {res['foreign_cpu_util']:.2f} cores; "
                          f"measuring again ({tries}/{lab.s.retries})", file=sys.stderr)
                out["workloads"][name] = res
        finally:
            for p in pools.values():
                if p is not None:
                    await p.close()
    return out


# -- media -----------------------------------------------------------------------------------------
async def run_media(args) -> dict:
    """One image of growing size per request (E+P+D, stream, 4 tokens): proxy CPU per
    request against the image size, and a least-squares line through it."""
    settings = lab_settings(args, sim={"itl_ms": 1.0})
    out: dict = {"sizes_mb": list(args.media_mb), "points": []}
    with Lab(settings) as lab:
        lab.pin_self()
        sim = lab.start_sim()
        proxy = lab.add(T.epd_proxy_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir))
        if not proxy.available:
            raise RuntimeError(f"epd-proxy did not start: {proxy.note}")
        for mb in args.media_mb:
            reqs = workload_requests(args, "mm", images=1, image_kb=mb * 1024, max_tokens=4, variants=2)
            res = await lab.phase(proxy, reqs, concurrency=2, warmup=0.5, duration=max(3.0, args.duration),
                                  max_requests=None, verify=args.verify != "off", label=f"media {mb:g} MiB",
                                  progress=args.progress, seed=args.seed)
            res["image_mb"] = mb
            res["body_mb"] = len(reqs[0].body) / 2**20
            out["points"].append(res)
    pts = [p for p in out["points"] if p["requests"] and not math.isnan(p.get("target_cpu_ms_per_req", math.nan))]
    if len(pts) >= 2:
        fit = linear_fit([p["image_mb"] for p in pts], [p["target_cpu_ms_per_req"] for p in pts])
        out["fit"] = fit
        out["ms_per_mb"] = fit["slope"]
        body = linear_fit([p["body_mb"] for p in pts], [p["target_cpu_ms_per_req"] for p in pts])
        out["ms_per_body_mb"] = body["slope"]
    return out


# -- push -----------------------------------------------------------------------------------------
async def run_push(args) -> dict:
    """TTFT at concurrency 1 with prefill time T_p (prefill ``ttft_ms``) and a decode-side
    time T_d (``decode:delay=T_d`` on each request: decode work that does not need
    the KV), in pull (nixl) and push (nixl-push) mode."""
    tp = args.push_tp_ms
    out: dict = {"tp_ms": tp, "td_ms": list(args.push_td_ms), "modes": {}}
    expected = simulator_expected() if args.verify != "off" else None
    for mode in ("nixl", "nixl-push"):
        settings = lab_settings(args, sim={"kv_connector": mode, "itl_ms": 5.0},
                                roles={"prefill": {"ttft_ms": tp, "ttft_per_token_ms": 0.0}},
                                counts={"encode": 0, "prefill": 1, "decode": 1})
        rows = []
        with Lab(settings) as lab:
            lab.pin_self()
            sim = lab.start_sim()
            proxy = lab.add(T.epd_proxy_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir,
                                               kv_connector=mode))
            if not proxy.available:
                raise RuntimeError(f"epd-proxy ({mode}) did not start: {proxy.note}")
            pool = ConnectionPool(proxy.url)
            timeouts = TransportTimeouts(connect=10, headers=60, idle=60)
            try:
                for td in args.push_td_ms:
                    w = make_workload("stream", max_tokens=4, prompt_bytes=args.prompt_bytes, model=args.model)[0]
                    reqs = []
                    for i in range(8):
                        body = chat_body(w, i, args.seed)
                        body["sim_fault"] = f"decode:delay={td / 1000.0:g}"
                        reqs.append(Prepared("stream", "/v1/chat/completions", msgspec.json.encode(body), True,
                                             expected(body) if expected else None, body))
                    for prep in reqs[:2]:
                        await send(pool, prep, timeouts)
                    tries = 0
                    while True:
                        if lab.s.quiet_wait > 0:
                            await lab.wait_quiet()
                        meter = ForeignMeter(lab).start()
                        ttft, errors = [], 0
                        for i in range(args.push_samples):
                            o = await send(pool, reqs[i % len(reqs)], timeouts)
                            if o.ok and o.ttft is not None:
                                ttft.append(o.ttft)
                            else:
                                errors += 1
                        foreign = meter.stop()
                        if foreign <= lab.s.max_foreign or tries >= lab.s.retries:
                            break
                        tries += 1
                    model = max(tp, td) if mode == "nixl-push" else tp + td
                    s = summarize(ttft, 1000)
                    rows.append({"td_ms": td, "model_ms": model, "model": "max(Tp, Td)" if mode == "nixl-push"
                                 else "Tp + Td", "ttft_ms": s, "overhead_p50_ms": s["p50"] - model,
                                 "errors": errors, "foreign_cpu_util": foreign, "retries": tries})
                    if args.progress:
                        print(f"push {mode} Td={td:g}: TTFT p50 {s['p50']:.1f} ms (model {model:g})",
                              file=sys.stderr)
            finally:
                await pool.close()
        out["modes"][mode] = rows
    return out


# -- scale ------------------------------------------------------------------------------------------
async def run_scale(args) -> dict:
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
        sim = lab.start_sim()
        proxy = lab.add(T.epd_proxy_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir,
                                           workers=workers))
        if not proxy.available:
            raise RuntimeError(f"epd-proxy did not start: {proxy.note}")
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
                if _tty(args):
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
        if _tty(args):
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


# -- workers ------------------------------------------------------------------------------------------
class CpuQuota:
    """A CPU cgroup (v1 ``cpu`` controller or v2 ``cpu.max``) holding processes to a quota."""

    def __init__(self, name: str, cores: float, *, shares: int = 8192, period_us: int = 10000) -> None:
        self.name = name
        self.cores = cores
        self.shares = shares
        self.period = period_us
        self.v1 = os.path.isdir("/sys/fs/cgroup/cpu") and os.path.exists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
        self.root = "/sys/fs/cgroup/cpu" if self.v1 else "/sys/fs/cgroup"
        self.path = os.path.join(self.root, name)

    @staticmethod
    def available() -> bool:
        q = CpuQuota("epd-bench-probe", 1.0)
        try:
            q.create()
            q.remove()
            return True
        except OSError:
            return False

    def _write(self, fname: str, value: str) -> None:
        with open(os.path.join(self.path, fname), "w") as f:
            f.write(value)

    def create(self) -> "CpuQuota":
        os.makedirs(self.path, exist_ok=True)
        self.set(self.cores)
        return self

    def set(self, cores: float | None) -> None:
        if self.v1:
            self._write("cpu.cfs_period_us", str(self.period))
            self._write("cpu.cfs_quota_us", "-1" if cores is None else str(int(cores * self.period)))
            self._write("cpu.shares", str(self.shares))
        else:
            self._write("cpu.max", "max" if cores is None else f"{int(cores * self.period)} {self.period}")
            try:
                self._write("cpu.weight", str(max(1, min(10000, self.shares // 10))))
            except OSError:
                pass

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def remove(self) -> None:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                pids = [p.strip() for p in f if p.strip()]
            for p in pids:
                with open(os.path.join(self.root, "cgroup.procs"), "w") as f:
                    f.write(p)
        except OSError:
            pass
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def _worker_pids(svc, want: int, timeout: float = 10.0) -> list[int]:
    """The worker processes of ``epd-proxy serve --workers N`` (the master's children), or
    the process itself for one worker."""
    if want <= 1:
        return [svc.pid]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = [p for p in tree_pids(svc.pid) if p != svc.pid]
        if len(kids) >= want:
            return sorted(kids)
        time.sleep(0.1)
    raise RuntimeError("the proxy's workers did not appear")


async def run_workers(args) -> dict:
    """``--workers 2`` against one worker. On a 2-core machine the load cannot have cores
    of its own, so each proxy worker is held to ``--workers-quota`` of a core by a CPU
    cgroup (high weight, so the load never takes that share) and pinned to its own
    core; the simulator and load generator use the rest. A worker is then a fixed
    slice of CPU, the load is never the cap, and the ratio shows how the proxy scales
    with workers (connection spreading by SO_REUSEPORT, nothing shared)."""
    from epd_proxy.bench.procs import available_cpus

    q = args.workers_quota
    cpus = available_cpus()
    quota_ok = CpuQuota.available()
    a = _copy_args(args, itl_ms=args.throughput_itl_ms, max_tokens=args.throughput_tokens, pin=False,
                   proxy_cpus=None, load_cpus=None)
    settings = lab_settings(a)
    out: dict = {"quota_cores_per_worker": q if quota_ok else None, "cpus": cpus, "cgroup": quota_ok,
                 "concurrency": args.workers_concurrency, "tokens": a.max_tokens, "itl_ms": a.itl_ms,
                 "workload": "stream", "runs": {}}
    groups: list[CpuQuota] = []
    with Lab(settings) as lab:
        lab.pin_self()
        sim = lab.start_sim()
        tgts = {}
        for w in (1, 2):
            t = lab.add(T.epd_proxy_target(sim, cpus=None, log_dir=settings.log_dir, workers=w,
                                           name=f"epd-proxy-{w}w"))
            if not t.available:
                raise RuntimeError(f"{t.name} did not start: {t.note}")
            pids = _worker_pids(t.service, w)
            for i, pid in enumerate(pids):
                pin(pid, [cpus[i % len(cpus)]])
                if quota_ok:
                    g = CpuQuota(f"epd-bench-{w}w-{i}", q).create()
                    g.add(pid)
                    groups.append(g)
            tgts[w] = (t, pids)
        reqs = workload_requests(a, "stream")
        try:
            for rep in range(max(1, args.repeat)):
                for w in ((1, 2) if rep % 2 == 0 else (2, 1)):
                    t, pids = tgts[w]
                    res = await lab.phase(t, reqs, concurrency=args.workers_concurrency, warmup=args.warmup,
                                          duration=max(4.0, args.duration), max_requests=None,
                                          verify=args.verify != "off", label=f"workers={w} #{rep + 1}",
                                          progress=args.progress, seed=args.seed, track_pids=pids)
                    res["worker_cpu_util"] = [res["pid_cpu_util"][str(p)] for p in pids]
                    res["worker_sleeps_per_s"] = [res["pid_sleeps_per_s"][str(p)] for p in pids]
                    out["runs"].setdefault(str(w), []).append(res)
        finally:
            for g in groups:
                g.remove()
    s = summarize_runs(out["runs"])
    out["summary"] = s
    r1 = [r["req_s"] for r in out["runs"]["1"]]
    r2 = [r["req_s"] for r in out["runs"]["2"]]
    out["ratio"] = median_range([b / a_ for a_, b in zip(r1, r2) if a_])
    return out


# -- overload -----------------------------------------------------------------------------------------
def _fd_count(pid: int) -> int:
    """Open descriptors of a process tree (the proxy and its workers)."""
    n = 0
    for p in tree_pids(pid):
        try:
            n += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
    return n


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def _slowloris(url: str, n: int, interval: float, stop: asyncio.Event, state: dict) -> None:
    """``n`` connections that send a request head one byte every ``interval`` seconds."""
    host, port = url.removeprefix("http://").split(":")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-slow: " + b"a" * 4096

    async def one() -> None:
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            state["slowloris_refused"] += 1
            return
        state["slowloris_open"] += 1
        try:
            for b in head:
                if stop.is_set():
                    return
                writer.write(bytes([b]))
                await writer.drain()
                try:  # the proxy may close it (a header read timeout): that is what it should do
                    if await asyncio.wait_for(reader.read(1 << 16), interval) == b"":
                        state["slowloris_closed_by_proxy"] += 1
                        return
                    state["slowloris_answered"] += 1
                    return
                except TimeoutError:
                    pass
        except (ConnectionError, OSError):
            state["slowloris_closed_by_proxy"] += 1
        finally:
            state["slowloris_open"] -= 1
            writer.transport.abort()

    await asyncio.gather(*(one() for _ in range(n)))


async def run_overload(args) -> dict:
    """A burst of slow streams far beyond the proxy's admission limit, with slowloris
    connections and normal traffic alongside: what is shed, what it costs, how fast it recovers."""
    n, tokens = args.overload_streams, args.overload_tokens
    limit, queue, qtimeout = args.overload_max_inflight, args.overload_queue_size, args.overload_queue_timeout
    settings = lab_settings(args, sim={"itl_ms": args.overload_itl_ms, "max_num_seqs": n + 1000},
                            nofile=4 * n + 1024)
    extra = ["--max-inflight", str(limit), "--queue-size", str(queue), "--queue-timeout", str(qtimeout)]
    out: dict = {"streams": n, "tokens_per_stream": tokens, "itl_ms": args.overload_itl_ms, "max_inflight": limit,
                 "queue_size": queue, "queue_timeout_s": qtimeout, "slowloris": args.overload_slowloris}
    with Lab(settings) as lab:
        lab.pin_self()
        sim = lab.start_sim()
        proxy = lab.add(T.epd_proxy_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir, extra=extra))
        if not proxy.available:
            raise RuntimeError(f"epd-proxy did not start: {proxy.note}")
        svc, url = proxy.service, proxy.url
        assert svc is not None  # epd-proxy runs as a process of its own
        slow = workload_requests(args, "stream", max_tokens=tokens)
        normal = workload_requests(args, "nonstream", max_tokens=4)
        burst_pool = ConnectionPool(url, idle_timeout=30.0, max_idle=n + 100)
        normal_pool = ConnectionPool(url, idle_timeout=30.0)
        timeouts = TransportTimeouts(connect=30, headers=120, idle=120)
        loop = asyncio.get_running_loop()
        t_start = perf()
        # Normal traffic alone first: the latency to recover to.
        base: list[float] = []
        while perf() - t_start < args.overload_baseline or len(base) < 5:
            o = await send(normal_pool, normal[len(base) % len(normal)], timeouts)
            if o.ok:
                base.append(o.t_end - o.t_send)
        base_p50 = sorted(base)[len(base) // 2]
        out["normal_baseline_ms"] = summarize(base, 1000)
        out["rss_idle_mb"] = svc.rss_bytes() / 2**20
        out["fds_idle"] = _fd_count(svc.pid)
        stop = asyncio.Event()
        state = {"slowloris_open": 0, "slowloris_refused": 0, "slowloris_closed_by_proxy": 0,
                 "slowloris_answered": 0}
        normal_log: list[tuple[float, float, int | None, bool]] = []  # (t_end, seconds, status, ok)
        peaks = {"rss_mb": 0.0, "fds": 0}
        samples: list[dict] = []

        async def normal_loop(k: int) -> None:
            while not stop.is_set():
                o = await send(normal_pool, normal[k % len(normal)], timeouts)
                normal_log.append((o.t_end, o.t_end - o.t_send, o.status, o.ok))
                k += args.overload_normal_concurrency

        async def sampler() -> None:
            while not stop.is_set():
                s = {"t": perf() - t_start, "rss_mb": svc.rss_bytes() / 2**20, "fds": _fd_count(svc.pid)}
                samples.append(s)
                peaks["rss_mb"] = max(peaks["rss_mb"], s["rss_mb"])
                peaks["fds"] = max(peaks["fds"], s["fds"])
                await asyncio.sleep(args.overload_sample)

        helpers: list[asyncio.Task] = [loop.create_task(sampler()),
                   loop.create_task(_slowloris(url, args.overload_slowloris, args.overload_slowloris_interval,
                                               stop, state))]
        helpers += [loop.create_task(normal_loop(i)) for i in range(args.overload_normal_concurrency)]
        t_burst = perf()
        burst = [loop.create_task(send(burst_pool, slow[i % len(slow)], timeouts)) for i in range(n)]
        done, pending = await asyncio.wait(burst, timeout=tokens * args.overload_itl_ms / 1000.0 + 120)
        t_burst_end = perf()
        for t in pending:
            t.cancel()
        await asyncio.sleep(args.overload_after)
        stop.set()
        await asyncio.wait(helpers, timeout=30)
        for t in helpers:
            t.cancel()
        metrics = ""
        try:
            resp = await normal_pool.request("GET", "/metrics", timeouts=timeouts)
            try:
                metrics = (await resp.read()).decode()
            finally:
                resp.close()
        except UpstreamError:
            pass
        await burst_pool.close()
        await normal_pool.close()
        outcomes = [t.result() for t in done]
        statuses: dict[str, int] = {}
        for o in outcomes:
            key = str(o.status) if o.status is not None else "no-response"
            statuses[key] = statuses.get(key, 0) + 1
        # Recovered: from the end of the burst, every normal request succeeded at most twice as
        # slowly as before it (plus 5 ms).
        good = 2 * base_p50 + 0.005
        bad_after = [t for t, secs, _, ok in normal_log if t >= t_burst_end and (not ok or secs > good)]
        during = [(secs, status, ok) for t, secs, status, ok in normal_log if t_burst <= t < t_burst_end]
        out.update({
            "burst_s": t_burst_end - t_burst,
            "burst_statuses": statuses,
            "burst_ok": sum(1 for o in outcomes if o.ok),
            "burst_shed_429": statuses.get("429", 0),
            "burst_verify_errors": sum(1 for o in outcomes if o.verify_error),
            "burst_unfinished": len(pending),
            "proxy_shed_total": _metric(metrics, "epd_proxy_shed_requests_total"),
            "rss_peak_mb": peaks["rss_mb"],
            "rss_after_mb": svc.rss_bytes() / 2**20,
            "fds_peak": peaks["fds"],
            "fds_after": _fd_count(svc.pid),
            "normal_during_burst": {"requests": len(during), "ok": sum(1 for d in during if d[2]),
                                    "shed_429": sum(1 for d in during if d[1] == 429),
                                    "latency_ms": summarize([d[0] for d in during if d[2]], 1000)},
            "recovery_s": (max(bad_after) - t_burst_end) if bad_after else 0.0,
            "recovered": not bad_after or max(bad_after) < t_burst_end + args.overload_after - 0.5,
            "samples": samples,
            **state,
        })
    return out


# -- soak -----------------------------------------------------------------------------------------------
async def run_soak(args) -> dict:
    """A mixed workload for a long time: memory must stay flat, with no errors or mismatches."""
    dur, conc = args.soak_duration, args.soak_concurrency
    warm = min(30.0, 0.1 * dur)
    settings = lab_settings(args)
    with Lab(settings) as lab:
        lab.pin_self()
        sim = lab.start_sim()
        proxy = lab.add(T.epd_proxy_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir))
        if not proxy.available:
            raise RuntimeError(f"epd-proxy did not start: {proxy.note}")
        svc = proxy.service
        assert svc is not None  # epd-proxy runs as a process of its own
        reqs = workload_requests(args, "mixed")
        from epd_proxy.bench.loadgen import Phase

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
