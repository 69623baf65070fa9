"""The benchmark report: JSON (everything), Markdown (what a user reads) and PNG plots
(what a user looks at). Also the checks of the measured figures against the targets."""

from __future__ import annotations

import json
import math
import os
import sys

# The targets: (key, description, limit, unit, direction).
LIMITS = {
    "cpu_stream": ("Proxy CPU per P/D text stream request", 2.0, "ms", "<="),
    "cpu_mm": ("Proxy CPU per E+P+D request (1 x 150 KiB image)", 2.5, "ms", "<="),
    "cpu_nonstream": ("Proxy CPU per P/D non-stream request", 0.35, "ms", "<="),
    "throughput_mm": ("E+P+D req/s on one proxy core (fast backends)", 450.0, "req/s", ">="),
    "reqs_vs_direct": ("req/s through the proxy / direct to decode (default comparison)", 0.97, "x", ">="),
    "added_p50": ("Added TTFT at concurrency 1, p50", 1.0, "ms", "<="),
    "added_p99": ("Added TTFT at concurrency 1, p99", 3.0, "ms", "<="),
    "workers": ("--workers 2 req/s / one worker's", 1.7, "x", ">="),
    "scale_flat": ("Memory growth while holding the streams", 5.0, "%", "<="),
    "media_linear": ("Encoder-stage CPU linear in image size (R^2)", 0.98, "", ">="),
    "soak_flat": ("Memory growth over the soak (mixed load)", 5.0, "%", "<="),
}


def _nan(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt(x, digits: int = 2) -> str:
    if _nan(x):
        return "–"
    if isinstance(x, int):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}f}"


def fmt_range(mr: dict | None, digits: int = 2) -> str:
    """``median [min–max]`` (just the value when there is one run)."""
    if not mr or _nan(mr.get("median")):
        return "–"
    if mr.get("n", 1) <= 1 or mr["min"] == mr["max"]:
        return fmt(mr["median"], digits)
    return f"{fmt(mr['median'], digits)} [{fmt(mr['min'], digits)}–{fmt(mr['max'], digits)}]"


def _pct(mr: dict | None) -> dict | None:
    if not mr:
        return None
    return {k: (v * 100 if k != "n" and not _nan(v) else v) for k, v in mr.items()}


def _check(key: str, measured, source: str, extra: str = "") -> dict:
    desc, limit, unit, op = LIMITS[key]
    met = None
    if not _nan(measured):
        met = measured <= limit if op == "<=" else measured >= limit
    return {"key": key, "target": desc, "limit": f"{op} {limit:g} {unit}".strip(), "measured": measured,
            "unit": unit, "met": met, "source": source, "note": extra}


def latency_basis(w: dict) -> tuple[str, str]:
    """Which added-latency figures a target is judged on, and a note saying so.

    Samples during which the hypervisor took a core away (``/proc/stat`` steal)
    measure the host, not the proxy: they are left out when they are few (at most
    10 %), and the figure over every sample is given beside it. When they are many,
    every sample counts."""
    clean = w.get("added_without_steal_ms")
    n, stolen = w.get("ok", 0), w.get("samples_with_steal", 0)
    if not clean or not stolen:
        return "added_ms", ""
    every = (f"all {n} samples: p50 {fmt(w['added_ms']['p50'], 2)}, "
             f"p99 {fmt(w['added_ms']['p99'], 2)} ms")
    if stolen <= 0.1 * n and clean["count"] >= 100:
        return "added_without_steal_ms", f"{stolen} of {n} samples had hypervisor steal and are left out ({every})"
    return "added_ms", f"{stolen} of {n} samples had hypervisor steal: too many to leave out"


def checks(result: dict) -> list[dict]:
    """Each target of the issue against what this run measured (only what ran)."""
    out: list[dict] = []
    sc = result.get("scenarios", {})
    comp = sc.get("compare")
    if isinstance(comp, dict) and "workloads" in comp:
        for wl, key in (("stream", "cpu_stream"), ("mm", "cpu_mm"), ("nonstream", "cpu_nonstream")):
            s = comp["workloads"].get(wl, {}).get("summary", {})
            ep = s.get("epd-proxy")
            if ep:
                vr = s.get("vllm-router")
                note = ""
                if vr:
                    note = f"vllm-router: {fmt(vr['target_cpu_ms_per_req']['median'])} ms"
                out.append(_check(key, ep["target_cpu_ms_per_req"]["median"], f"compare/{wl}", note))
        for wl in ("stream", "nonstream", "mm"):
            s = comp["workloads"].get(wl, {}).get("summary", {})
            ep = s.get("epd-proxy")
            if ep and "req_s_vs_direct" in ep:
                note = f"{fmt(ep['req_s']['median'], 1)} vs {fmt(s['direct']['req_s']['median'], 1)} req/s"
                if "req_s_vs_direct_pd" in ep:
                    note += (f"; vs the same E/P/D calls made without a proxy (direct-pd): "
                             f"{fmt(ep['req_s_vs_direct_pd']['median'], 3)}")
                c = _check("reqs_vs_direct", ep["req_s_vs_direct"]["median"], f"compare/{wl}", note)
                c["target"] += f" ({wl})"
                out.append(c)
    thr = sc.get("throughput")
    if isinstance(thr, dict) and "workloads" in thr:
        ep = thr["workloads"].get("mm", {}).get("summary", {}).get("epd-proxy")
        if ep:
            out.append(_check("throughput_mm", ep["req_s"]["median"], "throughput/mm",
                              f"proxy core at {fmt(100 * ep['target_cpu_util']['median'], 0)} %, load core at "
                              f"{fmt(100 * ep['load_core_util']['median'], 0)} %"))
    lat = sc.get("latency")
    if isinstance(lat, dict) and "workloads" in lat:
        for wl, w in lat["workloads"].items():
            use, note = latency_basis(w)
            for q, key in (("p50", "added_p50"), ("p99", "added_p99")):
                c = _check(key, w[use][q], f"latency/{wl}", note)
                c["target"] += f" ({'P/D' if wl == 'stream' else 'E+P+D'})"
                out.append(c)
    wk = sc.get("workers")
    if isinstance(wk, dict) and "ratio" in wk:
        note = (f"each worker held to {wk['quota_cores_per_worker']:g} core by a CPU cgroup"
                if wk.get("quota_cores_per_worker") else "no CPU cgroup: load shares the cores")
        out.append(_check("workers", wk["ratio"]["median"], "workers", note))
    scale = sc.get("scale")
    if isinstance(scale, dict) and "runs" in scale:
        for run in scale["runs"]:
            c = _check("scale_flat", run.get("rss_hold_growth_pct"), f"scale/{run['workers']}w",
                       f"{run['streams']} streams, {fmt(run.get('rss_per_1k_streams_mb'))} MiB and "
                       f"{fmt(run.get('cpu_ms_per_s_per_1k_streams'))} ms CPU/s per 1k streams; "
                       f"errors {run.get('errors')}")
            c["target"] += f" ({run['streams']} streams, {run['workers']} worker{'s' if run['workers'] > 1 else ''})"
            if run.get("errors"):
                c["met"] = False
            out.append(c)
    soak = sc.get("soak")
    if isinstance(soak, dict) and "rss_growth_pct" in soak:
        c = _check("soak_flat", soak["rss_growth_pct"], "soak",
                   f"{soak['requests']} requests in {fmt(soak['duration_s'], 0)} s at concurrency "
                   f"{soak['concurrency']}; errors {soak['errors']}, mismatches {soak['verify_errors']}")
        if soak.get("errors"):
            c["met"] = False
        out.append(c)
    media = sc.get("media")
    if isinstance(media, dict) and "fit" in media:
        out.append(_check("media_linear", media["fit"]["r2"], "media",
                          f"{fmt(media['ms_per_mb'])} ms per MiB of image "
                          f"(+{fmt(media['fit']['intercept'])} ms fixed)"))
    cl = sc.get("cluster")
    if isinstance(cl, dict):
        out.extend(c for c in cl.get("targets") or [] if isinstance(c, dict))
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
def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


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
        out += [_table(["target", "limit", "measured", "", "notes"], rows), ""]
    sc = result.get("scenarios", {})
    for name, r in sc.items():
        if isinstance(r, dict) and "error" in r and len(r) == 1:
            out += [f"## {name}", "", f"failed: `{r['error']}`", ""]
            continue
        fn = _SECTIONS.get(name)
        if fn is not None:
            out += fn(r, plots)
    return "\n".join(out) + "\n"


def _compare_section(r: dict, plots: dict, title: str = "Side by side") -> list[str]:
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
    out += [_table(["target", "ran", "what"], rows), ""]
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
        out += [_table(["target", "req/s", "vs direct"] + (["vs direct-pd"] if has_pd else []) + [
                        "proxy CPU ms/req", "TTFT p50/p99 ms",
                        "ITL p50/p99 ms", "E2E p50/p99 ms", "errors / mismatches", "requests"], rows), ""]
        rows = [[name, fmt_range(t["sim_cpu_ms_per_req"], 3), fmt_range(t["loadgen_cpu_ms_per_req"], 3),
                 fmt_range(_pct(t["load_core_util"]), 0), fmt_range(_pct(t["target_cpu_util"]), 0),
                 fmt_range(_pct(t.get("foreign_cpu_util")), 0)]
                for name, t in s.items()]
        out += ["Cost of the load itself (to show the proxy, not the load, is what saturates), and CPU used by "
                "anything else on the machine during the windows (% of one core; should be ~0):", "",
                _table(["target", "simulator CPU ms/req", "load generator CPU ms/req", "load core busy %",
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
        out += [_table(["self", "%", "inclusive", "%"], rows), "", f"raw stacks: `{pr.get('file')}`", ""]
    if "cpu_bars" in plots and title == "Side by side":
        out += [f"![proxy CPU per request]({plots['cpu_bars']})", ""]
    sw = r.get("sweep")
    if sw:
        out += ["### req/s against concurrency (stream)", ""]
        header = ["target"] + [f"c={c}" for c in sw["concurrency"]]
        rows = [[name] + [fmt(x["req_s"], 1) for x in runs] for name, runs in sw["targets"].items()]
        out += [_table(header, rows), ""]
        rows = [[name] + [fmt(x.get("target_cpu_ms_per_req"), 3) for x in runs]
                for name, runs in sw["targets"].items()]
        out += ["Proxy CPU ms per request:", "", _table(header, rows), ""]
        if "sweep" in plots:
            out += [f"![req/s vs concurrency]({plots['sweep']})", ""]
    return out


def _throughput_section(r: dict, plots: dict) -> list[str]:
    return _compare_section(r, {}, title="Throughput with fast backends")


def _latency_section(r: dict, plots: dict) -> list[str]:
    out = ["## Added latency at concurrency 1", ""]
    out.append(f"{r.get('samples')} samples per workload, {r.get('tokens')} output tokens. Stage sum = "
               "encoder call + prefill call + decode TTFT, each made directly by the load generator with the "
               "bodies the proxy would send (one HTTP round trip each, like the proxy's own), from the proxy's "
               "core (where the proxy's own calls start) and, as a stricter baseline, from the load core (the "
               "simulator's: no wake-up across cores). Added = proxy TTFT − stage sum, per sample. A sample during "
               "which the hypervisor ran something else on this machine's cores (steal time in /proc/stat) "
               "measures the host; the targets leave such samples out when they are at most 10 %.")
    rtt = r.get("wakeup_rtt") or {}
    if rtt:
        out.append("")
        out.append(f"A wake-up round trip between two processes on this machine: {fmt(rtt['same_core_us'], 1)} µs "
                   f"on one core, {fmt(rtt['cross_core_us'], 1)} µs across the proxy's and the load's cores.")
    out.append("")
    rows = []
    for wl, w in r.get("workloads", {}).items():
        far = w.get("added_vs_load_core_ms")
        clean = w.get("added_without_steal_ms")
        rows.append([("P/D text" if wl == "stream" else "E+P+D image"),
                     f"{fmt(w['proxy_ttft_ms']['p50'])} / {fmt(w['proxy_ttft_ms']['p99'])}",
                     f"{fmt(w['stage_sum_ms']['p50'])} / {fmt(w['stage_sum_ms']['p99'])}",
                     f"{fmt(w['added_ms']['p50'], 3)} / {fmt(w['added_ms']['p90'], 3)} / "
                     f"{fmt(w['added_ms']['p99'], 3)}",
                     (f"{fmt(clean['p50'], 3)} / {fmt(clean['p90'], 3)} / {fmt(clean['p99'], 3)} "
                      f"({w.get('samples_with_steal', 0)} left out)" if clean else "–"),
                     (f"{fmt(far['p50'], 3)} / {fmt(far['p90'], 3)} / {fmt(far['p99'], 3)}" if far else "–"),
                     fmt(w.get("proxy_cpu_ms_per_req"), 3), f"{w['ok']} / {w['errors']}",
                     f"`{w.get('server_timing_example') or ''}`"])
    out += [_table(["workload", "proxy TTFT p50/p99 ms", "stage sum p50/p99 ms", "added p50/p90/p99 ms",
                    "added, samples without steal", "added vs stages from the load core p50/p90/p99 ms",
                    "proxy CPU ms/req", "ok / errors",
                    "Server-Timing (last)"], rows), ""]
    return out


def _scale_section(r: dict, plots: dict) -> list[str]:
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
    out += [_table(["workers", "streams", "tokens", "RSS idle MiB", "RSS full MiB", "MiB per 1k streams",
                    "RSS growth over hold", "CPU ms/s per 1k streams", "proxy core %", "sim / loadgen core %",
                    "ok / errors / mismatches"], rows), ""]
    if "scale" in plots:
        out += [f"![proxy memory against open streams]({plots['scale']})", ""]
    return out


def _overload_section(r: dict, plots: dict) -> list[str]:
    out = ["## Overload: a burst past the admission limit", "",
           f"{r['streams']} slow streams opened at once ({r['tokens_per_stream']} tokens, {fmt(r['itl_ms'], 0)} ms "
           f"apart) against `--max-inflight {r['max_inflight']} --queue-size {r['queue_size']} --queue-timeout "
           f"{r['queue_timeout_s']:g}`, with {r['slowloris']} slowloris connections and closed-loop non-stream "
           "requests alongside.", ""]
    nd = r.get("normal_during_burst", {})
    rows = [["burst", f"{r['burst_ok']} ok, {r['burst_shed_429']} shed (429), statuses {r['burst_statuses']}, "
                      f"{r['burst_verify_errors']} mismatches, {r['burst_unfinished']} unfinished"],
            ["shed (proxy's counter)", fmt(r.get("proxy_shed_total"), 0)],
            ["RSS idle / peak / after, MiB", f"{fmt(r['rss_idle_mb'], 1)} / {fmt(r['rss_peak_mb'], 1)} / "
                                             f"{fmt(r['rss_after_mb'], 1)}"],
            ["descriptors idle / peak / after", f"{r['fds_idle']} / {r['fds_peak']} / {r['fds_after']}"],
            ["normal requests during the burst", f"{nd.get('ok')} ok of {nd.get('requests')}, "
                                                 f"{nd.get('shed_429')} shed; p50/p99 "
                                                 f"{fmt(nd.get('latency_ms', {}).get('p50'))} / "
                                                 f"{fmt(nd.get('latency_ms', {}).get('p99'))} ms (before: p50 "
                                                 f"{fmt(r['normal_baseline_ms'].get('p50'))} ms)"],
            ["slowloris", f"{r['slowloris_closed_by_proxy']} closed by the proxy, {r['slowloris_answered']} "
                          f"answered, {r['slowloris_refused']} refused"],
            ["time to recover after the burst", f"{fmt(r['recovery_s'], 2)} s"
                                                + ("" if r.get("recovered") else " (not recovered)")]]
    return out + [_table(["", ""], rows), ""]


def _soak_section(r: dict, plots: dict) -> list[str]:
    return ["## Soak: mixed load over time", "",
            _table(["duration", "concurrency", "requests", "req/s", "errors / mismatches", "RSS start → end MiB",
                    "growth", "bytes per request"],
                   [[f"{fmt(r['duration_s'], 0)} s", str(r["concurrency"]), str(r["requests"]), fmt(r["req_s"], 1),
                     f"{r['errors']} / {r['verify_errors']}", f"{fmt(r['rss_start_mb'], 1)} → "
                     f"{fmt(r['rss_end_mb'], 1)}", f"{fmt(r['rss_growth_pct'], 2)} %",
                     fmt(r["rss_growth_bytes_per_request"], 1)]]), ""]


def _workers_section(r: dict, plots: dict) -> list[str]:
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
    out += [_table(["workers", "req/s", "proxy CPU ms/req", "per-worker core % (each run)",
                    "per-worker sleeps/s (each run)", "errors"], rows), ""]
    out.append(f"Ratio (paired per repeat): **{fmt_range(r.get('ratio'), 2)}**")
    out.append("")
    out.append("A worker that is the bottleneck always has work waiting and almost never sleeps; one that "
               "sleeps hundreds of times a second was waiting for the load, and the ratio then measures the "
               "load as well as the proxy.")
    out.append("")
    return out


def _media_section(r: dict, plots: dict) -> list[str]:
    out = ["## Big media through the encoder stage", ""]
    rows = [[fmt(p["image_mb"]), fmt(p["body_mb"]), fmt(p.get("target_cpu_ms_per_req"), 3), fmt(p["req_s"], 1),
             f"{p['errors']} / {p['verify_errors']}", str(p["requests"])] for p in r.get("points", [])]
    out += [_table(["image MiB", "request body MiB", "proxy CPU ms/req", "req/s", "errors / mismatches",
                    "requests"], rows), ""]
    if "fit" in r:
        f = r["fit"]
        out.append(f"Least squares: **{fmt(f['slope'], 3)} ms per MiB of image** ({fmt(r.get('ms_per_body_mb'), 3)} "
                   f"ms per MiB of request body) + {fmt(f['intercept'], 3)} ms; R² = {f['r2']:.4f}.")
        out.append("")
    if "media" in plots:
        out += [f"![CPU against image size]({plots['media']})", ""]
    return out


def _push_section(r: dict, plots: dict) -> list[str]:
    out = ["## Push (nixl-push) against pull (nixl): TTFT", ""]
    out.append(f"Prefill time T_p = {fmt(r.get('tp_ms'), 0)} ms; decode-side time T_d set per request "
               "(`sim_fault: decode:delay=T_d`, work on decode that does not need the KV); concurrency 1.")
    out.append("")
    rows = []
    for mode, rs in r.get("modes", {}).items():
        for row in rs:
            rows.append([mode, fmt(row["td_ms"], 0), f"{row['model']} = {fmt(row['model_ms'], 0)}",
                         fmt(row["ttft_ms"]["p50"], 2), fmt(row["ttft_ms"]["p90"], 2),
                         fmt(row["overhead_p50_ms"], 2), str(row["errors"])])
    out += [_table(["mode", "T_d ms", "model ms", "TTFT p50 ms", "TTFT p90 ms", "p50 − model ms", "errors"], rows), ""]
    return out


def _url_section(r: dict, plots: dict) -> list[str]:
    out = [f"## {r.get('url')}", ""]
    rows = []
    for wl, w in r.get("workloads", {}).items():
        rows.append([wl, fmt(w["req_s"], 1), f"{fmt(w['ttft_ms']['p50'])} / {fmt(w['ttft_ms']['p99'])}",
                     f"{fmt(w['itl_ms']['p50'])} / {fmt(w['itl_ms']['p99'])}",
                     f"{fmt(w['e2e_ms']['p50'])} / {fmt(w['e2e_ms']['p99'])}",
                     fmt(w.get("target_cpu_ms_per_req"), 3), f"{w['errors']} / {w['verify_errors']}",
                     str(w["requests"])])
    out += [_table(["workload", "req/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "E2E p50/p99 ms",
                    "server CPU ms/req", "errors / mismatches", "requests"], rows), ""]
    return out


def _spread_text(x) -> str:
    if x is None:
        return "–"
    return "∞" if isinstance(x, float) and math.isinf(x) else fmt(x)


def _cluster_section(r: dict, plots: dict) -> list[str]:
    """One table per workload: a row per policy and load level."""
    cnt = r.get("counts", {})
    out = ["## Routing on a simulated cluster", ""]
    out.append(f"{cnt.get('encode')} encoders, {cnt.get('prefill')} prefills, {cnt.get('decode')} decodes; a fresh "
               "cluster and proxy for every policy and load level (no policy inherits warm caches). "
               f"Targets checked for **{r.get('candidate')}**.")
    out.append("")
    for wl, w in r.get("workloads", {}).items():
        ws, sp = w.get("working_set", {}), w.get("spec", {})
        out.append(f"### {wl}")
        out.append("")
        line = (f"{sp.get('conversations')} conversations × {sp.get('turns')} turns, {sp.get('system_prompts')} "
                f"shared system prompts, {ws.get('requests')} requests, {ws.get('prompt_tokens')} prompt tokens; "
                f"working set **{ws.get('blocks')} blocks** of {ws.get('block_size')} tokens, prefix cache "
                f"**{w.get('prefix_cache_blocks_per_instance')} blocks per prefill instance** (ratio "
                f"{fmt(w.get('cache_ratio'), 3)})")
        if ws.get("distinct_images"):
            line += (f"; {ws['distinct_images']} distinct images ({ws['image_tokens']} encoder tokens), encoder cache "
                     f"{w.get('encoder_cache_tokens_per_instance')} tokens per encoder")
        out += [line + ".", ""]
        rows = []
        for pol, pd in w.get("policies", {}).items():
            for rate, c in pd.get("rates", {}).items():
                if c.get("error") or c.get("available") is False:
                    rows.append([pol, rate, c.get("error") or c.get("note", "not available")] + [""] * 12)
                    continue
                k = c["counters"]
                sp_ = k["spread"]
                reps = c.get("repeats") or []
                p99s = sorted(x["ttft_p99"] for x in reps)
                rows.append([pol, rate, f"{fmt(c['req_s'], 1)} ({c.get('max_live_conversations', '–')})",
                             f"{fmt(c['ttft_ms']['p50'], 1)} / {fmt(c['ttft_ms']['p99'], 1)}"
                             + (f" (p99 {fmt(p99s[0], 1)}–{fmt(p99s[-1], 1)} over {len(p99s)})" if p99s else ""),
                             f"{fmt(c['e2e_ms']['p50'], 0)} / {fmt(c['e2e_ms']['p99'], 0)}",
                             f"{k['prefill_tokens_computed']:,}", fmt(100 * k["prefix_hit_rate"], 1),
                             fmt(100 * k["encoder_hit_rate"], 1),
                             f"{_spread_text(sp_.get('prefill'))} {k['requests'].get('prefill')}",
                             f"{_spread_text(sp_.get('decode'))} {k['requests'].get('decode')}",
                             _spread_text(sp_.get("encode")),
                             fmt(c.get("proxy_cpu_ms_per_req"), 3),
                             f"{fmt(c.get('sim_cpu_util', math.nan))} + {fmt(c.get('loadgen_cpu_util', math.nan))}"
                             f" / {fmt(c.get('foreign_cpu_util', math.nan))}",
                             str(c["errors"]) + (f" (+{c['unsent_turns']} unsent)" if c.get("unsent_turns") else ""),
                             str(c["verify_errors"])])
        out += [_table(["policy", "req/s offered", "req/s (most live conversations)", "TTFT p50 / p99 ms",
                        "E2E p50 / p99 ms",
                        "prefill tokens computed", "prefix hit %", "encoder hit %", "prefill spread (requests)",
                        "decode spread (requests)", "encoder spread", "proxy CPU ms/req",
                        "cores: sim + loadgen / others", "errors", "mismatches"],
                       rows), ""]
    rep = r.get("replicas")
    if isinstance(rep, dict):
        out += [f"### Two replicas ({rep.get('policy')} at {rep.get('rate')} req/s, chat workload)", ""]
        rows = []
        for label, c in (("one proxy", rep.get("single")), ("two proxies, turns alternating, one restarted",
                                                          rep.get("replicas"))):
            if not isinstance(c, dict) or c.get("error"):
                rows.append([label, (c or {}).get("error", "–"), "", "", "", ""])
                continue
            down = ", ".join(f"{x['down_s']:.2f} s" for x in c.get("restarts", [])) or "–"
            per = "/".join(str(x) for x in c.get("requests_per_proxy", [])) or str(c.get("requests", "–"))
            rows.append([label, fmt(100 * c["prefix_hit_rate"], 1),
                         f"{fmt(c['ttft_ms']['p50'], 1)} / {fmt(c['ttft_ms']['p99'], 1)}", per, down,
                         str(c["errors"])])
        out += [_table(["", "prefix hit %", "TTFT p50 / p99 ms", "requests (per proxy)", "restart (out of rotation)",
                        "errors"], rows), ""]
    if "cluster_ttft" in plots:
        out += [f"![TTFT against load]({plots['cluster_ttft']})", ""]
    return out


_SECTIONS = {"compare": _compare_section, "throughput": _throughput_section, "latency": _latency_section,
             "scale": _scale_section, "workers": _workers_section, "media": _media_section, "push": _push_section,
             "overload": _overload_section, "soak": _soak_section, "url": _url_section,
             "cluster": _cluster_section}


# -- plots ------------------------------------------------------------------------------------------
def make_plots(result: dict, outdir: str) -> dict[str, str]:
    """PNG files next to the report; returns {name: file name}. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the optional 'bench' extra
        print("bench: no plots: matplotlib is not installed (pip install 'epd-proxy[bench]', or --no-plots)",
              file=sys.stderr)
        return {}
    out: dict[str, str] = {}
    sc = result.get("scenarios", {})
    comp = sc.get("compare")
    if isinstance(comp, dict) and "workloads" in comp:
        # Latency CDFs: per workload, TTFT and E2E, last repeat's raw samples are not kept,
        # so the CDF is drawn from each run's percentiles... use the samples kept in "cdf".
        for wl, w in comp["workloads"].items():
            runs = w.get("runs", {})
            if not runs:
                continue
            fig, axes = plt.subplots(1, 2, figsize=(11, 4))
            for name, rs in runs.items():
                for ax, key in zip(axes, ("ttft_cdf", "e2e_cdf")):
                    xs, ys = [], []
                    for r in rs:
                        c = r.get(key)
                        if c:
                            xs, ys = c
                    if xs:
                        ax.plot(xs, ys, label=name)
            for ax, title in zip(axes, ("TTFT", "end-to-end latency")):
                ax.set_xlabel("ms")
                ax.set_ylabel("fraction of requests")
                ax.set_title(f"{wl}: {title}")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
            fig.tight_layout()
            fn = f"latency_cdf_{wl}.png"
            fig.savefig(os.path.join(outdir, fn), dpi=110)
            plt.close(fig)
            out[f"cdf_{wl}"] = fn
        # CPU per request bars.
        wls = [wl for wl, w in comp["workloads"].items() if w.get("summary")]
        names = []
        for wl in wls:
            for n in comp["workloads"][wl]["summary"]:
                if n != "direct" and n not in names:
                    names.append(n)
        if wls and names:
            fig, ax = plt.subplots(figsize=(9, 4))
            width = 0.8 / len(names)
            for i, n in enumerate(names):
                xs, ys, lo, hi = [], [], [], []
                for j, wl in enumerate(wls):
                    t = comp["workloads"][wl]["summary"].get(n)
                    if not t or _nan(t["target_cpu_ms_per_req"]["median"]):
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
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(os.path.join(outdir, "cpu_per_request.png"), dpi=110)
            plt.close(fig)
            out["cpu_bars"] = "cpu_per_request.png"
        sw = comp.get("sweep")
        if sw:
            fig, axes = plt.subplots(1, 2, figsize=(11, 4))
            for name, runs in sw["targets"].items():
                cs = sw["concurrency"][:len(runs)]
                axes[0].plot(cs, [r["req_s"] for r in runs], marker="o", label=name)
                axes[1].plot(cs, [r["e2e_ms"]["p99"] for r in runs], marker="o", label=name)
            axes[0].set_ylabel("req/s")
            axes[1].set_ylabel("E2E p99 ms")
            for ax in axes:
                ax.set_xlabel("concurrency")
                ax.set_xscale("log", base=2)
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
            axes[0].set_title("throughput against concurrency (stream)")
            axes[1].set_title("tail latency against concurrency")
            fig.tight_layout()
            fig.savefig(os.path.join(outdir, "reqs_vs_concurrency.png"), dpi=110)
            plt.close(fig)
            out["sweep"] = "reqs_vs_concurrency.png"
    scale = sc.get("scale")
    if isinstance(scale, dict) and scale.get("runs"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for run in scale["runs"]:
            s = run.get("samples", [])
            ax.plot([x["active"] for x in s], [x["rss_mb"] for x in s], ".", ms=3,
                    label=f"{run['workers']} worker(s), up to {run['streams']}")
        ax.set_xlabel("open streams")
        ax.set_ylabel("proxy RSS (MiB, all processes)")
        ax.set_title("proxy memory against open streams")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, "scale_rss.png"), dpi=110)
        plt.close(fig)
        out["scale"] = "scale_rss.png"
    cl = sc.get("cluster")
    if isinstance(cl, dict) and cl.get("workloads"):
        wls = [(n, w) for n, w in cl["workloads"].items() if len(w.get("rates", [])) > 1]
        if wls:
            fig, axes = plt.subplots(1, len(wls), figsize=(6 * len(wls), 4.5), squeeze=False)
            for ax, (name, w) in zip(axes[0], wls):
                for pol, pd in w.get("policies", {}).items():
                    pts = sorted((float(rate), c["ttft_ms"]["p50"], c["ttft_ms"]["p99"])
                                 for rate, c in pd.get("rates", {}).items() if "ttft_ms" in c)
                    if not pts:
                        continue
                    line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{pol} p50")
                    ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=line.get_color(), alpha=0.6,
                            label=f"{pol} p99")
                ax.set_xlabel("offered load, requests/s")
                ax.set_ylabel("TTFT ms")
                ax.set_yscale("log")
                ax.set_title(f"cluster, {name} workload: TTFT against load")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(os.path.join(outdir, "cluster_ttft.png"), dpi=110)
            plt.close(fig)
            out["cluster_ttft"] = "cluster_ttft.png"
    media = sc.get("media")
    if isinstance(media, dict) and media.get("points"):
        pts = media["points"]
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [p["image_mb"] for p in pts]
        ax.plot(xs, [p.get("target_cpu_ms_per_req") for p in pts], "o", label="measured")
        if "fit" in media:
            f = media["fit"]
            ax.plot([0, max(xs)], [f["intercept"], f["intercept"] + f["slope"] * max(xs)], "-",
                    label=f"{f['slope']:.2f} ms/MiB + {f['intercept']:.2f} ms")
        ax.set_xlabel("image MiB (before base64)")
        ax.set_ylabel("proxy CPU ms per request")
        ax.set_title("encoder stage: CPU against image size")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(outdir, "media_cpu.png"), dpi=110)
        plt.close(fig)
        out["media"] = "media_cpu.png"
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
