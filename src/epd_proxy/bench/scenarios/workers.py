"""workers: ``--workers 2`` against one worker, each worker held to a CPU quota."""

from __future__ import annotations

import os
import time

from epd_proxy.bench.lab import Lab, lab_settings, summarize_runs, workload_requests
from epd_proxy.bench.markdown import fmt, fmt_range, table
from epd_proxy.bench.procs import pin, tree_pids
from epd_proxy.bench.scenarios.base import Limit, Scenario, copy_args, target_check
from epd_proxy.bench.stats import median_range


def add_arguments(group) -> None:
    group.add_argument("--workers-quota", type=float, default=0.2,
                       help="workers: CPU quota (cores) per proxy worker, so the load has cores of its own (at 0.25 "
                            "two workers outran the load on 2 cores: they slept hundreds of times a second)")
    group.add_argument("--workers-concurrency", type=int, default=256)


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


async def run(args) -> dict:
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
    a = copy_args(args, itl_ms=args.throughput_itl_ms, max_tokens=args.throughput_tokens, pin=False,
                   proxy_cpus=None, load_cpus=None)
    settings = lab_settings(a)
    out: dict = {"quota_cores_per_worker": q if quota_ok else None, "cpus": cpus, "cgroup": quota_ok,
                 "concurrency": args.workers_concurrency, "tokens": a.max_tokens, "itl_ms": a.itl_ms,
                 "workload": "stream", "runs": {}}
    groups: list[CpuQuota] = []
    with Lab(settings) as lab:
        lab.pin_self()
        lab.start_sim()
        tgts = {}
        for w in (1, 2):
            t = lab.start_proxy(what=f"epd-proxy-{w}w", pinned=False, workers=w, name=f"epd-proxy-{w}w")
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


def section(r: dict, plots: dict) -> list[str]:
    out = ["## --workers 2 against one worker", ""]
    if r.get("quota_cores_per_worker"):
        out.append(f"Each proxy worker pinned to its own core and held to {r['quota_cores_per_worker']:g} core by a "
                   "CPU cgroup (CFS quota, high weight); simulator and load generator unpinned, using the rest. "
                   f"Stream workload, {r.get('tokens')} tokens, {r.get('itl_ms')} ms between tokens, concurrency "
                   f"{r.get('concurrency')}.")
    else:
        out.append("No writable CPU cgroup: workers and load share the two cores; the ratio understates scaling.")
    out.append("")
    s = r.get("summary", {})
    rows = []
    for w, t in s.items():
        per = [run.get("worker_cpu_util") for run in r["runs"][w]]
        sleeps = [run.get("worker_sleeps_per_s") for run in r["runs"][w]]
        rows.append([w.replace("epd-proxy-", ""), fmt_range(t["req_s"], 1), fmt_range(t["target_cpu_ms_per_req"], 3),
                     ", ".join("/".join(fmt(100 * x, 0) for x in p) for p in per if p),
                     ", ".join("/".join(fmt(x, 0) for x in p) for p in sleeps if p) or "–", f"{t['errors']}"])
    out += [table(["workers", "req/s", "proxy CPU ms/req", "per-worker core % (each run)",
                    "per-worker sleeps/s (each run)", "errors"], rows), ""]
    out.append(f"Ratio (paired per repeat): **{fmt_range(r.get('ratio'), 2)}**")
    out.append("")
    out.append("A worker that is the bottleneck always has work waiting and almost never sleeps; one that "
               "sleeps hundreds of times a second was waiting for the load, and the ratio then measures the "
               "load as well as the proxy.")
    out.append("")
    return out


LIMITS = {"workers": Limit("--workers 2 req/s / one worker's", 1.7, "x", ">=")}


def checks(r: dict) -> list[dict]:
    if "ratio" not in r:
        return []
    note = (f"each worker held to {r['quota_cores_per_worker']:g} core by a CPU cgroup"
            if r.get("quota_cores_per_worker") else "no CPU cgroup: load shares the cores")
    return [target_check("workers", LIMITS["workers"], r["ratio"]["median"], "workers", note)]


SCENARIO = Scenario("workers", run=run, section=section, add_arguments=add_arguments, checks=checks)
