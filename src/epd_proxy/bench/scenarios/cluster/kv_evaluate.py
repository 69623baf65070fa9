"""What the KV events comparison measured (pure): per case and policy the hit rate against the
oracle's, TTFT p50/p99, prefill tokens computed and proxy CPU per request; and the issue's targets.

``kv`` is the comparison's result: ``{"exact": NAME, "today": NAME, "router": NAME, "cases":
{case: {"case": KvCase fields, "oracle_of": case, "cells": {policy: cell}}}}``, a cell being
:func:`~epd_proxy.bench.scenarios.cluster.cell.run_cell`'s.
"""

from __future__ import annotations

import math

# The targets.
HIT_RATE_VS_ORACLE = 0.98  # with evictions and with three replicas alternating
ROOMY_HIT_RATE = 0.99  # one replica, no evictions: no worse than today (a token's noise allowed)
ROOMY_TTFT = 1.05  # ... and TTFT p50/p99 within 5 % of today's (one run's noise at these sizes)


def _ok(c: dict | None) -> bool:
    return isinstance(c, dict) and bool(c) and bool(c.get("available", True)) and not c.get("error")


def _rate(x) -> float:
    return x if isinstance(x, (int, float)) and not math.isnan(x) else math.nan


def oracle_cell(kv: dict, case: str) -> dict | None:
    entry = kv.get("cases", {}).get(case, {})
    return kv.get("cases", {}).get(entry.get("oracle_of", case), {}).get("cells", {}).get("oracle")


def _proxy_counts(m: dict[str, float]) -> dict:
    """From the proxies' ``/metrics``: prefill picks made on the index, requests served by a
    decode alone because it held the prompt, engine restarts the events showed."""
    if not m:
        return {}
    return {"exact_picks": int(m.get('epd_proxy_routing_exact_total{role="prefill"}', 0)),
            "decode_alone": int(m.get('epd_proxy_not_disaggregated_total{reason="cached"}', 0)),
            "restarts_seen": int(sum(v for k, v in m.items() if k.startswith("epd_proxy_kv_events_restarts_total")))}


def figures(kv: dict) -> list[dict]:
    """A row per case and policy (the oracle's row is its own cell, shared by cases that
    differ only in replicas)."""
    rows = []
    for name, entry in kv.get("cases", {}).items():
        o = oracle_cell(kv, name)
        o_hit = _rate(o.get("prefix_hit_rate")) if _ok(o) and o else math.nan
        for pol, c in entry.get("cells", {}).items():
            if not _ok(c):
                rows.append({"case": name, "policy": pol, "error": c.get("error") or c.get("note", "not available")})
                continue
            hit = _rate(c.get("prefix_hit_rate"))
            rows.append({"case": name, "policy": pol, "hit_rate": hit,
                         "vs_oracle": hit / o_hit if o_hit and not math.isnan(o_hit) else math.nan,
                         "ttft_p50": c["ttft_ms"]["p50"], "ttft_p99": c["ttft_ms"]["p99"],
                         "computed": c.get("prefill_tokens_computed"), "cpu_ms": c.get("proxy_cpu_ms_per_req"),
                         "requests": c.get("requests"), "errors": c.get("errors", 0), "retried": c.get("retried", 0),
                         "verify_errors": c.get("verify_errors", 0), "replicas": c.get("replicas", 1),
                         "direct_requests": (c.get("direct") or {}).get("requests"),
                         **_proxy_counts(c.get("proxy_kv_metrics") or {})})
    return rows


def _target(key: str, text: str, limit: str, measured, met, note: str = "") -> dict:
    return {"key": key, "target": text, "limit": limit, "measured": measured, "unit": "x", "met": met,
            "source": "cluster", "note": note}


def targets(kv: dict) -> list[dict]:
    """With evictions and with three replicas alternating (the plain ``evict`` cases with 1 or 3
    replicas): the exact policy's hit rate >= 0.98 x the oracle's, its TTFT p50 and p99 below
    today's approximate routing's and vllm-router's; one replica without evictions: no worse
    than today; CPU per request against today's, reported. A target with nothing to compare is
    ``met: None``."""
    exact, today, router = kv.get("exact", "exact"), kv.get("today", "cache-aware"), kv.get("router")
    cases = kv.get("cases", {})
    strict = [n for n, e in cases.items() if e["case"]["evictions"] and not e["case"]["direct"]
              and not e["case"]["restart"] and e["case"]["replicas"] in (1, 3)]
    roomy = [n for n, e in cases.items() if not e["case"]["evictions"] and not e["case"]["direct"]
             and not e["case"]["restart"] and e["case"]["replicas"] == 1]
    out = []
    # 1. hit rate against the oracle's
    worst, where = math.inf, ""
    for n in strict:
        c, o = cases[n]["cells"].get(exact), oracle_cell(kv, n)
        if _ok(c) and _ok(o) and c and o and o.get("prefix_hit_rate"):
            r = c["prefix_hit_rate"] / o["prefix_hit_rate"]
            if r < worst:
                worst, where = r, (f"{n}: {100 * c['prefix_hit_rate']:.1f} % vs the oracle's "
                                   f"{100 * o['prefix_hit_rate']:.1f} %")
    found = worst != math.inf
    out.append(_target("kv_hit_rate", f"Hit rate / the oracle's, {exact}, evictions and 3 replicas (worst case)",
                       f">= {HIT_RATE_VS_ORACLE:g}", worst if found else None,
                       worst >= HIT_RATE_VS_ORACLE if found else None, where))
    # 2. TTFT p50 and p99 below today's and vllm-router's
    for other, key in ((today, "kv_ttft_today"), (router, "kv_ttft_router")):
        worst, where, n_cmp = -math.inf, "", 0
        for n in strict:
            c, b = cases[n]["cells"].get(exact), cases[n]["cells"].get(other) if other else None
            if not (_ok(c) and _ok(b)) or c is None or b is None:
                continue
            for q in ("p50", "p99"):
                mine, theirs = c["ttft_ms"][q], b["ttft_ms"][q]
                if math.isnan(mine) or math.isnan(theirs) or theirs <= 0:
                    continue
                n_cmp += 1
                if mine / theirs > worst:
                    worst, where = mine / theirs, f"{n}, {q}: {mine:.1f} ms vs {theirs:.1f} ms"
        out.append(_target(key, f"TTFT p50/p99, {exact} / {other or 'vllm-router'}, evictions and 3 replicas (worst)",
                           "< 1",
                           worst if n_cmp else None, worst < 1.0 if n_cmp else None, where))
    # 3. one replica, no evictions: no worse than today
    hit_w, ttft_w, hit_where, ttft_where = math.inf, -math.inf, "", ""
    for n in roomy:
        c, b = cases[n]["cells"].get(exact), cases[n]["cells"].get(today)
        if not (_ok(c) and _ok(b)) or c is None or b is None:
            continue
        if b.get("prefix_hit_rate"):
            r = c["prefix_hit_rate"] / b["prefix_hit_rate"]
            if r < hit_w:
                hit_w, hit_where = r, f"{n}: {100 * c['prefix_hit_rate']:.1f} % vs {100 * b['prefix_hit_rate']:.1f} %"
        for q in ("p50", "p99"):
            if b["ttft_ms"][q] > 0 and c["ttft_ms"][q] / b["ttft_ms"][q] > ttft_w:
                ttft_w = c["ttft_ms"][q] / b["ttft_ms"][q]
                ttft_where = f"{n}, {q}: {c['ttft_ms'][q]:.1f} ms vs {b['ttft_ms'][q]:.1f} ms"
    out.append(_target("kv_roomy_hit_rate", f"Hit rate, {exact} / {today}, one replica, no evictions",
                       f">= {ROOMY_HIT_RATE:g}", None if hit_w == math.inf else hit_w,
                       None if hit_w == math.inf else hit_w >= ROOMY_HIT_RATE, hit_where))
    out.append(_target("kv_roomy_ttft", f"TTFT p50/p99, {exact} / {today}, one replica, no evictions (worst)",
                       f"<= {ROOMY_TTFT:g}", None if ttft_w == -math.inf else ttft_w,
                       None if ttft_w == -math.inf else ttft_w <= ROOMY_TTFT, ttft_where))
    # 4. CPU per request with events on against today's, over every case both ran: reported
    mine = mine_n = base = base_n = 0.0
    for e in cases.values():
        c, b = e["cells"].get(exact), e["cells"].get(today)
        if _ok(c) and _ok(b) and c and b and c.get("proxy_cpu_s") is not None and b.get("proxy_cpu_s") is not None:
            mine, mine_n = mine + c["proxy_cpu_s"], mine_n + c["requests"]
            base, base_n = base + b["proxy_cpu_s"], base_n + b["requests"]
    ratio = (mine / mine_n) / (base / base_n) if mine_n and base_n and base else None
    out.append(_target("kv_cpu", f"Proxy CPU per request, {exact} / {today} (every case)", "reported", ratio, None,
                       "" if ratio is None else
                       f"{1000 * mine / mine_n:.3f} vs {1000 * base / base_n:.3f} ms per request"))
    return out
