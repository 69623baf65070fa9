"""The lab: a simulated cluster in its own process, each target (a proxy) in its own, the
load generator in this one, pinned apart; a phase of load against one target, with CPU
per request from ``/proc``; and the shared-machine guards (other processes' CPU measured,
quiet waits, re-runs).

Layout on a 2-core machine (``--pin``, the default when there are 2+ cores):
the proxy under test on core 0 (``--proxy-cpus``), the simulator and the load
generator on core 1 (``--load-cpus``).
"""

from __future__ import annotations

import json
import math
import os
import select
import sys
import time
from dataclasses import dataclass, field

from epd_proxy.bench import targets as T
from epd_proxy.bench.loadgen import Phase
from epd_proxy.bench.procs import (
    Service,
    available_cpus,
    machine_busy_seconds,
    raise_nofile,
    set_sched_idle,
    set_sched_normal,
    voluntary_switches,
)
from epd_proxy.bench.stats import median_range, ratio
from epd_proxy.bench.workloads import Prepared, make_workload, prepare, simulator_expected

# Simulator settings that make it behave like vLLM for the benchmark: one SSE event
# per token in one write, no request records kept (memory), roomy batches.
BENCH_SIM_DEFAULTS = {"split_utf8": False, "records": False, "max_num_seqs": 1024}


@dataclass
class LabSettings:
    counts: dict = field(default_factory=lambda: {"encode": 1, "prefill": 1, "decode": 1})
    sim: dict = field(default_factory=dict)  # SimConfig fields
    roles: dict = field(default_factory=dict)  # per-role SimConfig overrides
    proxy_cpus: list[int] | None = None
    load_cpus: list[int] | None = None
    log_dir: str = "."
    nofile: int = 0
    # The load may also run on the proxy's cores, at SCHED_IDLE priority: it gets only
    # what the proxy leaves, so when the load is heavier than one core the proxy still
    # saturates first (used by the throughput scenario).
    spill: bool = False
    # Shared machines: before a phase wait up to quiet_wait s for other processes to use
    # less than max_foreign cores, and re-run a phase they disturbed (up to retries times).
    max_foreign: float = 0.15
    quiet_wait: float = 0.0
    retries: int = 0
    # Closed loop: "staggered" spreads the workers' first requests over the warm-up;
    # "together" starts them at once (a deterministic simulator then keeps them in step).
    start: str = "staggered"


def default_pinning(pin: bool, proxy_cpus: str | None, load_cpus: str | None) -> tuple[list | None, list | None]:
    """(proxy cpus, load cpus): explicit lists win; with ``pin`` and 2+ cores, the
    first core for the proxy and the others for the load."""
    def parse(text):
        out: list[int] = []
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
        return out

    cpus = available_cpus()
    p = parse(proxy_cpus) if proxy_cpus else None
    lo = parse(load_cpus) if load_cpus else None
    if not pin:
        return p, lo
    if len(cpus) < 2:
        return p, lo
    if p is None:
        p = [cpus[0]]
    if lo is None:
        lo = [c for c in cpus if c not in p] or cpus[-1:]
    return p, lo


class Lab:
    """A simulated cluster plus the targets in front of it."""

    def __init__(self, settings: LabSettings) -> None:
        self.s = settings
        self.sim_service: Service | None = None
        self.sim: T.SimInfo | None = None
        self.targets: list[T.Target] = []
        self._old_affinity: set[int] | None = None
        self._idle = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start_sim(self, timeout: float = 30.0) -> T.SimInfo:
        spec = {"counts": self.s.counts, "config": {**BENCH_SIM_DEFAULTS, **self.s.sim}, "roles": self.s.roles,
                "nofile": self.s.nofile}
        argv = [sys.executable, "-m", "epd_proxy.bench.simhost", json.dumps(spec)]
        svc = Service("simulator", argv, cpus=None if self.s.spill else self.s.load_cpus,
                      log_path=os.path.join(self.s.log_dir, "sim.log"), sched_idle=self.s.spill)
        svc.start(pipe_stdout=True)
        self.sim_service = svc
        line = _read_line(svc, timeout)
        self.sim = T.SimInfo.from_json(json.loads(line))
        return self.sim

    def pin_self(self) -> None:
        self._old_affinity = os.sched_getaffinity(0)
        if self.s.spill:
            os.sched_setaffinity(0, set(available_cpus()))
            set_sched_idle(0)
            self._idle = True
        elif self.s.load_cpus:
            os.sched_setaffinity(0, set(self.s.load_cpus))
        if self.s.nofile:
            raise_nofile(self.s.nofile)

    def start_proxy(self, *, what: str = "epd-proxy", pinned: bool = True, **kw) -> T.Target:
        """epd-proxy in front of the lab's simulator (``kw``: :func:`~epd_proxy.bench.targets.epd_proxy_target`'s),
        on the proxy's cores unless not ``pinned``, started; raises when it does not start
        (``what`` names it in the error)."""
        assert self.sim is not None, "start_sim first"
        t = self.add(T.epd_proxy_target(self.sim, cpus=self.s.proxy_cpus if pinned else None, log_dir=self.s.log_dir,
                                        **kw))
        if not t.available:
            raise RuntimeError(f"{what} did not start: {t.note}")
        return t

    def add(self, target: T.Target, timeout: float = 60.0) -> T.Target:
        if target.available and target.service is not None:
            try:
                target.service.start()
                target.service.wait_ready(timeout)
                target.service.repin()
            except Exception as exc:
                target.available = False
                target.note = f"failed to start: {exc}"
                target.service.stop()
                print(f"bench: {target.name} could not be started: {exc}", file=sys.stderr)
        self.targets.append(target)
        return target

    def close(self) -> None:
        for t in self.targets:
            if t.service is not None:
                t.service.stop()
        if self.sim_service is not None:
            self.sim_service.stop()
        if self._old_affinity is not None:
            os.sched_setaffinity(0, self._old_affinity)
            self._old_affinity = None
        if self._idle:
            set_sched_normal(0)
            self._idle = False

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- measuring ------------------------------------------------------------------------------
    async def wait_quiet(self) -> float:
        """Wait (up to ``quiet_wait`` s) until other processes use less than ``max_foreign``
        cores; returns the last reading."""
        deadline = time.monotonic() + self.s.quiet_wait
        while True:
            load = await foreign_load(self, 1.0)
            if load <= self.s.max_foreign or time.monotonic() >= deadline:
                return load
            print(f"bench: waiting for a quiet machine ({load:.2f} cores busy with other work)", file=sys.stderr)

    async def phase(self, target: T.Target, requests: list[Prepared], **kw) -> dict:
        """:meth:`measure`, re-run when other processes disturbed the window."""
        tries = 0
        while True:
            if self.s.quiet_wait > 0:
                await self.wait_quiet()
            res = await self.measure(target, requests, **kw)
            f = res.get("foreign_cpu_util", 0.0)
            if math.isnan(f) or f <= self.s.max_foreign or tries >= self.s.retries:
                res["retries"] = tries
                return res
            tries += 1
            print(f"bench: {kw.get('label') or target.name}: other processes used {f:.2f} cores during the window; "
                  f"measuring again ({tries}/{self.s.retries})", file=sys.stderr)

    async def measure(self, target: T.Target, requests: list[Prepared], *, concurrency: int = 1,
                    rate: float | None = None, warmup: float = 1.0, duration: float | None = 5.0,
                    max_requests: int | None = None, verify: bool = True, label: str = "",
                    progress: bool = True, seed: int = 0, start_offset: int = 0,
                    track_pids: list[int] | None = None, profile_to: str | None = None,
                    native: bool = False) -> dict:
        """One measured phase against ``target``, with the CPU of the target, the
        simulator and this process over the measurement window."""
        snaps: dict = {}
        svc = target.service
        sim = self.sim_service

        spy = None
        if profile_to and svc is not None and duration:
            from epd_proxy.bench.profile import PySpy

            spy = PySpy(svc.pid, profile_to, duration, native=native)

        def snap(key):
            if key == 0 and spy is not None:
                spy.start()
            snaps[key] = (svc.cpu_seconds() if svc is not None else math.nan,
                          sim.cpu_seconds() if sim is not None else math.nan,
                          svc.rss_bytes() if svc is not None else 0,
                          machine_busy_seconds(),
                          [_pid_cpu(p) for p in (track_pids or [])],
                          [voluntary_switches(p) for p in (track_pids or [])])

        ph = Phase(target.url, requests, concurrency=concurrency, rate=rate, warmup=warmup, duration=duration,
                   max_requests=max_requests, verify=verify, label=label or target.name, progress=progress,
                   on_window_start=lambda: snap(0), on_window_end=lambda: snap(1), seed=seed,
                   start_offset=start_offset, client=target.make_client(concurrency),
                   ramp=None if self.s.start == "staggered" else 0.0)
        await ph.run()
        out = ph.summary()
        if spy is not None:
            out["profile"] = spy.finish()
            out["profile_file"] = profile_to
            if spy.error:
                out["profile_error"] = spy.error
        out["target"] = target.name
        n = out["requests"]
        w = out["window_s"]
        if 0 in snaps and 1 in snaps:
            tcpu = snaps[1][0] - snaps[0][0]
            scpu = snaps[1][1] - snaps[0][1]
            out["target_cpu_s"] = tcpu
            out["target_cpu_ms_per_req"] = 1000.0 * tcpu / n if n else math.nan
            out["target_cpu_util"] = tcpu / w if w > 0 else math.nan
            out["target_rss_mb"] = snaps[1][2] / 2**20 if svc is not None else math.nan
            out["sim_cpu_s"] = scpu
            out["sim_cpu_ms_per_req"] = 1000.0 * scpu / n if n else math.nan
            out["sim_cpu_util"] = scpu / w if w > 0 else math.nan
            ncores = len(self.s.load_cpus) if self.s.load_cpus else 1
            out["loadgen_cpu_util"] = out["loadgen_cpu_s"] / w if w > 0 else math.nan
            out["load_core_util"] = (scpu + out["loadgen_cpu_s"]) / w / ncores if w > 0 else math.nan
            # Everything else the machine did meanwhile (other users' processes): a run with
            # much of it is not a clean measurement.
            ours = (tcpu if not math.isnan(tcpu) else 0.0) + (scpu if not math.isnan(scpu) else 0.0) \
                + out["loadgen_cpu_s"]
            if track_pids:
                out["pid_cpu_util"] = {str(p): (b - a) / w for p, a, b in zip(track_pids, snaps[0][4], snaps[1][4])}
                # How often each went to sleep for want of work: ~0 when it is the bottleneck.
                out["pid_sleeps_per_s"] = {str(p): (b - a) / w for p, a, b in zip(track_pids, snaps[0][5], snaps[1][5])}
            out["foreign_cpu_util"] = max(0.0, (snaps[1][3] - snaps[0][3] - ours) / w) if w > 0 else math.nan
        return out


class ForeignMeter:
    """CPU (in cores) used by processes other than the lab's (simulator, targets, this one)
    between :meth:`start` and :meth:`stop`."""

    def __init__(self, lab: "Lab") -> None:
        self.lab = lab
        self._t0 = self._b0 = self._o0 = 0.0

    def _ours(self) -> float:
        from epd_proxy.bench.procs import self_cpu_seconds

        total = self_cpu_seconds()
        for svc in [self.lab.sim_service] + [t.service for t in self.lab.targets]:
            if svc is not None and hasattr(svc, "alive") and svc.alive():
                total += svc.cpu_seconds()
        return total

    def start(self) -> "ForeignMeter":
        self._b0, self._o0, self._t0 = machine_busy_seconds(), self._ours(), time.monotonic()
        return self

    def stop(self) -> float:
        b1, o1, t1 = machine_busy_seconds(), self._ours(), time.monotonic()
        if t1 <= self._t0:
            return 0.0
        return max(0.0, ((b1 - self._b0) - (o1 - self._o0)) / (t1 - self._t0))


async def foreign_load(lab: "Lab", seconds: float) -> float:
    import asyncio

    m = ForeignMeter(lab).start()
    await asyncio.sleep(seconds)
    return m.stop()


def _pid_cpu(pid: int) -> float:
    from epd_proxy.bench.procs import CLK_TCK, read_stat

    st = read_stat(pid)
    return st.cpu_ticks / CLK_TCK if st else math.nan


def _read_line(svc: Service, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert svc.proc is not None and svc.proc.stdout is not None  # started with pipe_stdout
    out = svc.proc.stdout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not svc.alive():
            svc.stop()
            raise RuntimeError(f"the simulator did not start: {svc.tail_log()}")
        r, _, _ = select.select([out], [], [], min(left, 0.5))
        if r:
            chunk = os.read(out.fileno(), 65536)
            if not chunk:
                continue
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()


def lab_settings(args, **over) -> LabSettings:
    proxy_cpus, load_cpus = default_pinning(args.pin, args.proxy_cpus, args.load_cpus)
    sim = {"itl_ms": args.itl_ms, "ttft_ms": args.ttft_ms, "encode_ms_per_item": args.encode_ms}
    sim.update(over.pop("sim", {}))
    counts = over.pop("counts", None) or {"encode": args.encoders, "prefill": args.prefills, "decode": args.decoders}
    return LabSettings(counts=counts, sim=sim, roles=over.pop("roles", {}), proxy_cpus=proxy_cpus,
                       load_cpus=load_cpus, log_dir=args.log_dir, nofile=over.pop("nofile", 0),
                       spill=bool(getattr(args, "spill", False)) and bool(proxy_cpus),
                       max_foreign=getattr(args, "max_foreign", 0.15), quiet_wait=getattr(args, "quiet_wait", 0.0),
                       retries=getattr(args, "retries", 0), start=getattr(args, "start", "staggered"))


def workload_requests(args, name: str, **over) -> list[Prepared]:
    wl = make_workload(name, images=over.get("images", args.images), image_kb=over.get("image_kb", args.image_kb),
                       prompt_bytes=over.get("prompt_bytes", args.prompt_bytes),
                       max_tokens=over.get("max_tokens", args.max_tokens),
                       variants=over.get("variants", args.variants), model=args.model)
    return prepare(wl, seed=args.seed, expected=simulator_expected() if args.verify != "off" else None)


SUMMARY_KEYS = ("req_s", "target_cpu_ms_per_req", "target_cpu_util", "sim_cpu_ms_per_req", "loadgen_cpu_ms_per_req",
                "load_core_util", "tokens_s", "foreign_cpu_util")


def summarize_runs(runs: dict[str, list[dict]]) -> dict:
    """Per target: median [min, max] over repeats of the headline numbers, and the
    ratio of req/s to the direct target's."""
    out: dict = {}
    for name, rs in runs.items():
        s: dict = {k: median_range(r.get(k, math.nan) for r in rs) for k in SUMMARY_KEYS}
        for lat in ("ttft_ms", "itl_ms", "e2e_ms"):
            s[lat] = {q: median_range(r[lat][q] for r in rs) for q in ("p50", "p90", "p99")}
        s["requests"] = sum(r["requests"] for r in rs)
        s["errors"] = sum(r["errors"] for r in rs)
        s["verify_errors"] = sum(r["verify_errors"] + r["outside_window"]["verify_errors"] for r in rs)
        s["repeats"] = len(rs)
        out[name] = s
    direct = out.get("direct")
    for name, s in out.items():
        if direct is not None:
            # Ratios per repeat (paired), then median: robust to drift between repeats.
            pairs = [ratio(a["req_s"], b["req_s"]) for a, b in zip(runs[name], runs["direct"])]
            s["req_s_vs_direct"] = median_range(pairs)
        if "direct-pd" in out:
            pairs = [ratio(a["req_s"], b["req_s"]) for a, b in zip(runs[name], runs["direct-pd"])]
            s["req_s_vs_direct_pd"] = median_range(pairs)
    return out
