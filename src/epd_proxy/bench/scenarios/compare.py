"""compare: every workload against direct / epd-proxy / vllm-router / nginx, side by side.

All targets run for the whole comparison; they are measured one at a time, interleaved
(target order rotates every repeat), so slow drift of the machine hits all of them alike.
The lab they run in (pinning, CPU per request) is :mod:`epd_proxy.bench.lab`."""

from __future__ import annotations

import os

from epd_proxy.bench import targets as T
from epd_proxy.bench.lab import BENCH_SIM_DEFAULTS, Lab, lab_settings, summarize_runs, workload_requests
from epd_proxy.bench.markdown import fmt, fmt_range, missing, pct, table
from epd_proxy.bench.procs import wake_write_cost
from epd_proxy.bench.scenarios.base import Figures, Limit, Scenario, target_check
from epd_proxy.bench.workloads import make_workload


# -- the comparison ------------------------------------------------------------------------------
def make_targets(lab: Lab, names: list[str], others: list[str]) -> list[T.Target]:
    sim = lab.sim
    assert sim is not None, "start_sim first"
    cpus = lab.s.proxy_cpus
    log_dir = lab.s.log_dir
    out = []
    for name in names:
        if name == "direct":
            out.append(lab.add(T.direct_target(sim)))
        elif name == "direct-pd":
            out.append(lab.add(T.direct_pd_target(sim)))
        elif name == "epd-proxy":
            out.append(lab.add(T.epd_proxy_target(sim, cpus=cpus, log_dir=log_dir)))
        elif name == "vllm-router":
            out.append(lab.add(T.vllm_router_target(sim, cpus=cpus, log_dir=log_dir)))
        elif name == "nginx":
            out.append(lab.add(T.nginx_target(sim, cpus=cpus, log_dir=log_dir)))
        else:
            raise ValueError(f"unknown target {name!r}")
    for spec in others:
        out.append(lab.add(T.other_target(spec, sim, cpus=cpus, log_dir=log_dir)))
    return out


async def run_compare(args, progress: bool = True) -> dict:
    """Every workload against every target, ``--repeat`` times, interleaved."""
    settings = lab_settings(args)
    result: dict = {"settings": {"concurrency": args.concurrency, "rate": args.rate, "repeat": args.repeat,
                                 "warmup_s": args.warmup, "duration_s": args.duration,
                                 "start": settings.start,
                                 "requests": args.requests, "workloads": args.workloads,
                                 "sim": {**BENCH_SIM_DEFAULTS, **settings.sim}, "counts": settings.counts,
                                 "proxy_cpus": settings.proxy_cpus, "load_cpus": settings.load_cpus,
                                 "spill": settings.spill},
                    "targets": {}, "workloads": {}, "sweep": None}
    partial = getattr(args, "partial", None)
    if isinstance(partial, dict):
        partial["result"] = result  # what was measured so far, if the run is interrupted
    if settings.proxy_cpus and settings.load_cpus:
        # What a write that wakes a peer costs the writer here: context for CPU per request.
        result["wake_write"] = wake_write_cost(settings.proxy_cpus[0], settings.load_cpus[0])
    with Lab(settings) as lab:
        lab.pin_self()
        lab.start_sim()
        tlist = make_targets(lab, args.targets, args.other)
        for t in tlist:
            result["targets"][t.name] = {"available": t.available, "note": t.note, "url": t.url,
                                         "argv": t.service.argv if t.service is not None else None}
        loads = {name: workload_requests(args, name) for name in args.workloads}
        for name in args.workloads:
            wl = make_workload(name, images=args.images, image_kb=args.image_kb, prompt_bytes=args.prompt_bytes,
                               max_tokens=args.max_tokens)
            result["workloads"][name] = {"description": "; ".join(w.describe() for w in wl), "runs": {}}
        active = [t for t in tlist if t.available]
        for rep in range(args.repeat):
            k = rep % len(active)
            order = active[k:] + active[:k]
            for name in args.workloads:
                kinds = {p.kind for p in loads[name]}
                for t in order:
                    if not all(t.supports(kind) for kind in kinds):
                        continue
                    label = f"{name} {t.name} #{rep + 1}"
                    res = await lab.phase(t, loads[name], concurrency=args.concurrency, rate=args.rate,
                                          warmup=args.warmup, duration=args.duration, max_requests=args.requests,
                                          verify=args.verify != "off", label=label, progress=progress,
                                          seed=args.seed + rep, start_offset=rep * 7)
                    res["repeat"] = rep
                    result["workloads"][name]["runs"].setdefault(t.name, []).append(res)
        for w in result["workloads"].values():
            w["summary"] = summarize_runs(w["runs"])
        if getattr(args, "profile", False):
            result["profiles"] = {}
            for t in active:
                if t.name != "epd-proxy":
                    continue
                for name in args.workloads:
                    if not all(t.supports(p.kind) for p in loads[name]):
                        continue
                    path = os.path.join(args.log_dir, f"py-spy-{t.name}-{name}.txt")
                    res = await lab.phase(t, loads[name], concurrency=args.concurrency, rate=args.rate,
                                          warmup=args.warmup, duration=args.duration, max_requests=None,
                                          verify=args.verify != "off", label=f"profile {name} {t.name}",
                                          progress=progress, seed=args.seed, profile_to=path,
                                          native=getattr(args, "profile_native", False))
                    result["profiles"][f"{t.name}/{name}"] = {
                        "profile": res.get("profile"), "file": path, "error": res.get("profile_error"),
                        "target_cpu_ms_per_req": res.get("target_cpu_ms_per_req"), "req_s": res["req_s"]}
        if args.sweep:
            result["sweep"] = await run_sweep(lab, args, [t for t in active if t.supports("stream")], progress)
    return result


async def run_sweep(lab: Lab, args, tlist: list[T.Target], progress: bool) -> dict:
    """req/s and latency against concurrency, stream workload, one run per point."""
    reqs = workload_requests(args, "stream")
    out: dict = {"concurrency": list(args.sweep), "targets": {}}
    for c in args.sweep:
        for t in tlist:
            res = await lab.phase(t, reqs, concurrency=c, warmup=args.warmup, duration=args.sweep_duration,
                                  max_requests=None, verify=args.verify != "off", label=f"sweep c={c} {t.name}",
                                  progress=progress, seed=args.seed)
            out["targets"].setdefault(t.name, []).append(res)
    return out


async def run(args) -> dict:
    return await run_compare(args, progress=args.progress)


def add_arguments(group) -> None:
    """compare's flags (``--compare``, ``--targets``, ``--other``, ``--repeat``, ``--profile``,
    ``--sweep``) are the command's general ones: other scenarios run its machinery too."""


def section(r: dict, plots: dict, title: str = "Side by side") -> list[str]:
    st = r.get("settings", {})
    out = [f"## {title}", ""]
    sim = st.get("sim", {})
    conc = f"concurrency {st.get('concurrency')}" if not st.get("rate") else f"Poisson {st.get('rate')} req/s"
    if not st.get("rate") and st.get("start"):
        conc += (", first requests spread over the warm-up" if st["start"] == "staggered"
                 else ", all workers started at once")
    bound = f" or {st['requests']} requests" if st.get("requests") else ""
    out.append(f"{conc}; window {st.get('duration_s')} s{bound} after "
               f"{st.get('warmup_s')} s warm-up; {st.get('repeat')} interleaved repeats: median [min–max]. "
               f"Simulator: {sim.get('itl_ms')} ms between tokens, prefill {sim.get('ttft_ms')} ms, "
               f"instances {st.get('counts')}. Proxy on cpus {st.get('proxy_cpus')}, simulator + load generator "
               f"on cpus {st.get('load_cpus')}.")
    ww = r.get("wake_write") or {}
    if ww:
        out.append("")
        out.append(f"On this machine a 200-byte write to a process on the load core costs the writer "
                   f"{fmt(ww['asleep_us'], 1)} µs when that process sleeps (the write wakes it) and "
                   f"{fmt(ww['awake_us'], 1)} µs when it is busy: a proxy's CPU per request depends on how "
                   f"often its peers are asleep when it writes to them.")
    if r.get("note"):
        out.append("")
        out.append(r["note"])
    out.append("")
    tg = r.get("targets", {})
    rows = [[n, "yes" if t["available"] else "no", t["note"]] for n, t in tg.items()]
    out += [table(["target", "ran", "what"], rows), ""]
    for wl, w in r.get("workloads", {}).items():
        s = w.get("summary", {})
        out += [f"### {wl}: {w.get('description', '')}", ""]
        rows = []
        has_pd = any("req_s_vs_direct_pd" in t for t in s.values())
        for name, t in s.items():
            rows.append([name, fmt_range(t["req_s"], 1), fmt_range(t.get("req_s_vs_direct"), 3)]
                        + ([fmt_range(t.get("req_s_vs_direct_pd"), 3)] if has_pd else []) + [
                         fmt_range(t["target_cpu_ms_per_req"], 3),
                         f"{fmt(t['ttft_ms']['p50']['median'])} / {fmt(t['ttft_ms']['p99']['median'])}",
                         f"{fmt(t['itl_ms']['p50']['median'])} / {fmt(t['itl_ms']['p99']['median'])}",
                         f"{fmt(t['e2e_ms']['p50']['median'])} / {fmt(t['e2e_ms']['p99']['median'])}",
                         f"{t['errors']} / {t['verify_errors']}", str(t["requests"])])
        out += [table(["target", "req/s", "vs direct"] + (["vs direct-pd"] if has_pd else []) + [
                        "proxy CPU ms/req", "TTFT p50/p99 ms",
                        "ITL p50/p99 ms", "E2E p50/p99 ms", "errors / mismatches", "requests"], rows), ""]
        rows = [[name, fmt_range(t["sim_cpu_ms_per_req"], 3), fmt_range(t["loadgen_cpu_ms_per_req"], 3),
                 fmt_range(pct(t["load_core_util"]), 0), fmt_range(pct(t["target_cpu_util"]), 0),
                 fmt_range(pct(t.get("foreign_cpu_util")), 0)]
                for name, t in s.items()]
        out += ["Cost of the load itself (to show the proxy, not the load, is what saturates), and CPU used by "
                "anything else on the machine during the windows (% of one core; should be ~0):", "",
                table(["target", "simulator CPU ms/req", "load generator CPU ms/req", "load core busy %",
                        "proxy core busy %", "other processes %"], rows), ""]
        for key in (f"cdf_{wl}",):
            if key in plots:
                out += [f"![latency CDFs, {wl}]({plots[key]})", ""]
    for key, pr in (r.get("profiles") or {}).items():
        prof = pr.get("profile")
        out += [f"### Profile: {key} (py-spy, {prof['samples'] if prof else 0} samples on CPU; "
                f"{fmt(pr.get('target_cpu_ms_per_req'), 3)} ms CPU/req under the profiler)", ""]
        if not prof:
            out += [f"no profile: {pr.get('error')}", ""]
            continue
        rows = []
        for a, b in zip(prof["self"][:15], prof["inclusive"][:15]):
            rows.append([f"`{a['function']}`", fmt(100 * a["share"], 1),
                         f"`{b['function']}`", fmt(100 * b["share"], 1)])
        out += [table(["self", "%", "inclusive", "%"], rows), "", f"raw stacks: `{pr.get('file')}`", ""]
    if "cpu_bars" in plots and title == "Side by side":
        out += [f"![proxy CPU per request]({plots['cpu_bars']})", ""]
    sw = r.get("sweep")
    if sw:
        out += ["### req/s against concurrency (stream)", ""]
        header = ["target"] + [f"c={c}" for c in sw["concurrency"]]
        rows = [[name] + [fmt(x["req_s"], 1) for x in runs] for name, runs in sw["targets"].items()]
        out += [table(header, rows), ""]
        rows = [[name] + [fmt(x.get("target_cpu_ms_per_req"), 3) for x in runs]
                for name, runs in sw["targets"].items()]
        out += ["Proxy CPU ms per request:", "", table(header, rows), ""]
        if "sweep" in plots:
            out += [f"![req/s vs concurrency]({plots['sweep']})", ""]
    return out


LIMITS = {
    "cpu_stream": Limit("Proxy CPU per P/D text stream request", 2.0, "ms", "<="),
    "cpu_mm": Limit("Proxy CPU per E+P+D request (1 x 150 KiB image)", 2.5, "ms", "<="),
    "cpu_nonstream": Limit("Proxy CPU per P/D non-stream request", 0.35, "ms", "<="),
    "reqs_vs_direct": Limit("req/s through the proxy / direct to decode (default comparison)", 0.97, "x", ">="),
}


def plot(r: dict, figures: Figures) -> dict[str, str]:
    """Latency CDFs per workload, CPU per request, and req/s against concurrency."""
    out: dict[str, str] = {}
    if "workloads" not in r:
        return out
    # Latency CDFs: per workload, TTFT and E2E, drawn from the points each run keeps ("ttft_cdf", "e2e_cdf").
    for wl, w in r["workloads"].items():
        runs = w.get("runs", {})
        if not runs:
            continue
        fig, axes = figures.new(1, 2, figsize=(11, 4))
        for name, rs in runs.items():
            for ax, key in zip(axes, ("ttft_cdf", "e2e_cdf")):
                xs, ys = [], []
                for run in rs:
                    c = run.get(key)
                    if c:
                        xs, ys = c
                if xs:
                    ax.plot(xs, ys, label=name)
        for ax, title in zip(axes, ("TTFT", "end-to-end latency")):
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{wl}: {title}")
        out[f"cdf_{wl}"] = figures.save(fig, axes, f"latency_cdf_{wl}.png")
    # CPU per request bars.
    wls = [wl for wl, w in r["workloads"].items() if w.get("summary")]
    names = []
    for wl in wls:
        for n in r["workloads"][wl]["summary"]:
            if n != "direct" and n not in names:
                names.append(n)
    if wls and names:
        fig, ax = figures.new(figsize=(9, 4))
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            xs, ys, lo, hi = [], [], [], []
            for j, wl in enumerate(wls):
                t = r["workloads"][wl]["summary"].get(n)
                if not t or missing(t["target_cpu_ms_per_req"]["median"]):
                    continue
                mr = t["target_cpu_ms_per_req"]
                xs.append(j + i * width)
                ys.append(mr["median"])
                lo.append(mr["median"] - mr["min"])
                hi.append(mr["max"] - mr["median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], label=n, capsize=3)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(wls))])
        ax.set_xticklabels(wls)
        ax.set_ylabel("proxy CPU ms per request")
        ax.set_title("CPU per request (median, min–max)")
        out["cpu_bars"] = figures.save(fig, [ax], "cpu_per_request.png", grid_axis="y")
    sw = r.get("sweep")
    if sw:
        fig, axes = figures.new(1, 2, figsize=(11, 4))
        for name, runs in sw["targets"].items():
            cs = sw["concurrency"][:len(runs)]
            axes[0].plot(cs, [x["req_s"] for x in runs], marker="o", label=name)
            axes[1].plot(cs, [x["e2e_ms"]["p99"] for x in runs], marker="o", label=name)
        axes[0].set_ylabel("req/s")
        axes[1].set_ylabel("E2E p99 ms")
        for ax in axes:
            ax.set_xlabel("concurrency")
            ax.set_xscale("log", base=2)
        axes[0].set_title("throughput against concurrency (stream)")
        axes[1].set_title("tail latency against concurrency")
        out["sweep"] = figures.save(fig, axes, "reqs_vs_concurrency.png")
    return out


def checks(r: dict) -> list[dict]:
    out: list[dict] = []
    if "workloads" not in r:
        return out
    for wl, key in (("stream", "cpu_stream"), ("mm", "cpu_mm"), ("nonstream", "cpu_nonstream")):
        s = r["workloads"].get(wl, {}).get("summary", {})
        ep = s.get("epd-proxy")
        if ep:
            vr = s.get("vllm-router")
            note = ""
            if vr:
                note = f"vllm-router: {fmt(vr['target_cpu_ms_per_req']['median'])} ms"
            out.append(target_check(key, LIMITS[key], ep["target_cpu_ms_per_req"]["median"], f"compare/{wl}", note))
    for wl in ("stream", "nonstream", "mm"):
        s = r["workloads"].get(wl, {}).get("summary", {})
        ep = s.get("epd-proxy")
        if ep and "req_s_vs_direct" in ep:
            note = f"{fmt(ep['req_s']['median'], 1)} vs {fmt(s['direct']['req_s']['median'], 1)} req/s"
            if "req_s_vs_direct_pd" in ep:
                note += (f"; vs the same E/P/D calls made without a proxy (direct-pd): "
                         f"{fmt(ep['req_s_vs_direct_pd']['median'], 3)}")
            c = target_check("reqs_vs_direct", LIMITS["reqs_vs_direct"], ep["req_s_vs_direct"]["median"],
                             f"compare/{wl}", note)
            c["target"] += f" ({wl})"
            out.append(c)
    return out


SCENARIO = Scenario("compare", run=run, section=section, add_arguments=add_arguments, plot=plot, checks=checks)
