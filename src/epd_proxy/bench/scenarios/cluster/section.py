"""The cluster scenario's part of the report: a table per workload, the replicas' comparison,
and TTFT against load."""

from __future__ import annotations

import math

from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.scenarios.base import Figures
from epd_proxy.bench.scenarios.cluster.kv_section import kv_section


def _spread_text(x) -> str:
    if x is None:
        return "–"
    return "∞" if isinstance(x, float) and math.isinf(x) else fmt(x)


def section(r: dict, plots: dict) -> list[str]:
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
        out += [table(["policy", "req/s offered", "req/s (most live conversations)", "TTFT p50 / p99 ms",
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
        out += [table(["", "prefix hit %", "TTFT p50 / p99 ms", "requests (per proxy)", "restart (out of rotation)",
                        "errors"], rows), ""]
    out += kv_section(r)
    if "cluster_ttft" in plots:
        out += [f"![TTFT against load]({plots['cluster_ttft']})", ""]
    return out


def plot(r: dict, figures: Figures) -> dict[str, str]:
    """TTFT against the offered load, one panel per workload with more than one load level."""
    wls = [(n, w) for n, w in (r.get("workloads") or {}).items() if len(w.get("rates", [])) > 1]
    if not wls:
        return {}
    fig, axes = figures.new(1, len(wls), figsize=(6 * len(wls), 4.5), squeeze=False)
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
    return {"cluster_ttft": figures.save(fig, axes[0], "cluster_ttft.png", legend_size=7)}
