"""What the cluster scenario measured, as plain data (pure): counters from the instances'
``/sim/state``, the merge of repeated cells, and the targets."""

from __future__ import annotations

import math
from typing import TypeGuard

from epd_proxy.bench.stats import percentile

# The targets for this scenario.
HIT_RATE_VS_ORACLE = 0.90
SPREAD_LIMIT = 1.3
CPU_VS_LEAST_LOADED = 1.05
REPLICAS_HIT_RATE = 0.95


def _spread(counts: list[int]) -> float | None:
    """max / min of requests per instance (inf when one got none while another got some)."""
    if not counts or max(counts) == 0:
        return None
    lo = min(counts)
    return math.inf if lo == 0 else max(counts) / lo


def cluster_counters(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> dict:
    """What the instances did between two ``/sim/state`` snapshots (per role, in instance
    order): requests per instance and their spread, prompt tokens looked up / found in the
    prefix caches / computed, and encoder-cache lookups and hits."""
    out: dict = {"requests": {}, "spread": {}}
    pq = ph = eq = eh = 0
    for role in ("encode", "prefill", "decode"):
        a_list, b_list = before.get(role, []), after.get(role, [])
        reqs = []
        for a, b in zip(a_list, b_list):
            reqs.append(b["stats"]["requests"] - a["stats"]["requests"])
            pa, pb = a.get("prefix_cache"), b.get("prefix_cache")
            if pa is not None and pb is not None:
                pq += pb["queries"] - pa["queries"]
                ph += pb["hits"] - pa["hits"]
            ea, eb = a.get("encoder_cache"), b.get("encoder_cache")
            if ea is not None and eb is not None:
                eq += eb["queries"] - ea["queries"]
                eh += eb["hits"] - ea["hits"]
        out["requests"][role] = reqs
        out["spread"][role] = _spread(reqs)
    out.update({"prefix_queried_tokens": pq, "prefix_hit_tokens": ph, "prefill_tokens_computed": pq - ph,
                "prefix_hit_rate": ph / pq if pq else math.nan,
                "encoder_queries": eq, "encoder_hits": eh, "encoder_hit_rate": eh / eq if eq else math.nan})
    return out


def merge_repeats(cells: list[dict]) -> dict:
    """One cell from ``--cluster-repeat`` runs of it, each on a fresh cluster (whose ports, so
    whose rendezvous draw, differ): latency quantiles are the median over the repeats, hit
    rates pooled over their tokens, the spread the worst repeat's, CPU summed over all
    requests. A p99 over one cell's 480 requests is its fifth-worst and moves by several ms
    between identical runs; the median of repeats is what policies are compared on."""
    ok = [c for c in cells if not c.get("error") and c.get("available", True)]
    if len(cells) == 1 or not ok:
        return cells[0]
    out = dict(ok[0])
    for key in ("ttft_ms", "e2e_ms"):
        qs = {}
        for q in ok[0][key]:
            vals = sorted(c[key][q] for c in ok)
            qs[q] = sum(vals) if q == "count" else percentile(vals, 50)
        out[key] = qs
    for key in ("requests", "ok", "errors", "verify_errors", "unsent_turns", "retries", "wall_s"):
        if all(isinstance(c.get(key), (int, float)) for c in ok):
            out[key] = sum(c[key] for c in ok)
    for key in ("sim_cpu_util", "loadgen_cpu_util"):
        out[key] = sum(c.get(key, math.nan) for c in ok) / len(ok)
    out["foreign_cpu_util"] = max(c.get("foreign_cpu_util", 0.0) for c in ok)
    out["req_s"] = sum(c["req_s"] for c in ok) / len(ok)
    worst = max(ok, key=lambda c: max((x for x in c["counters"]["spread"].values() if x is not None), default=0.0))
    counters = dict(worst["counters"])
    pooled = {k: sum(c["counters"][k] for c in ok) for k in
              ("prefix_queried_tokens", "prefix_hit_tokens", "encoder_queries", "encoder_hits")}
    counters.update(pooled)
    counters["prefill_tokens_computed"] = round(
        (pooled["prefix_queried_tokens"] - pooled["prefix_hit_tokens"]) / len(ok))  # per repeat
    counters["prefix_hit_rate"] = (pooled["prefix_hit_tokens"] / pooled["prefix_queried_tokens"]
                                   if pooled["prefix_queried_tokens"] else math.nan)
    counters["encoder_hit_rate"] = (pooled["encoder_hits"] / pooled["encoder_queries"]
                                    if pooled["encoder_queries"] else math.nan)
    counters["spread"] = {role: max((c["counters"]["spread"].get(role) for c in ok
                                     if c["counters"]["spread"].get(role) is not None), default=None)
                          for role in worst["counters"]["spread"]}
    out["counters"] = counters
    for key in ("prefix_hit_rate", "encoder_hit_rate", "prefill_tokens_computed"):
        out[key] = counters[key]
    if all(c.get("proxy_cpu_s") is not None for c in ok):
        out["proxy_cpu_s"] = sum(c["proxy_cpu_s"] for c in ok)
        out["proxy_cpu_ms_per_req"] = 1000.0 * out["proxy_cpu_s"] / out["requests"] if out["requests"] else math.nan
    out["repeats"] = [{"ttft_p50": c["ttft_ms"]["p50"], "ttft_p99": c["ttft_ms"]["p99"],
                       "prefix_hit_rate": c["prefix_hit_rate"], "spread": c["counters"]["spread"],
                       "proxy_cpu_ms_per_req": c.get("proxy_cpu_ms_per_req"), "errors": c["errors"]} for c in ok]
    out["failed_repeats"] = len(cells) - len(ok)
    return out


def _target(key: str, text: str, limit: str, measured, met, source: str, note: str = "", unit: str = "") -> dict:
    return {"key": key, "target": text, "limit": limit, "measured": measured, "unit": unit, "met": met,
            "source": source, "note": note}


def policy_cells(result: dict, workload: str, policy: str) -> dict:
    """The cells of one policy in one workload of a cluster result, by load level."""
    return result.get("workloads", {}).get(workload, {}).get("policies", {}).get(policy, {}).get("rates", {})


def evaluate_targets(result: dict, candidate: str | None) -> list[dict]:
    """The issue's four targets (and the replicas one) for ``candidate``, from one run's cells.
    A target with nothing to compare against is reported with ``met: None``."""
    out: list[dict] = []
    if not candidate:
        return out
    def ok(c: dict | None) -> TypeGuard[dict]:
        return c is not None and bool(c) and bool(c.get("available", True)) and not c.get("error")
    # 1. prefix-cache hit rate >= 90 % of the oracle's, every workload and load level with both.
    worst, where = math.inf, ""
    for wl in ("chat", "text"):
        for rate, c in policy_cells(result, wl, candidate).items():
            o = policy_cells(result, wl, "oracle").get(rate)
            if ok(c) and ok(o) and o["prefix_hit_rate"] and not math.isnan(o["prefix_hit_rate"]):
                r = c["prefix_hit_rate"] / o["prefix_hit_rate"]
                if r < worst:
                    worst, where = r, (f"{wl} at {rate} req/s: {100 * c['prefix_hit_rate']:.1f} % vs the oracle's "
                                       f"{100 * o['prefix_hit_rate']:.1f} %")
    out.append(_target("cluster_hit_rate", f"Prefix-cache hit rate / the oracle's ({candidate}, worst cell)",
                       f">= {HIT_RATE_VS_ORACLE:g}", None if worst == math.inf else worst,
                       None if worst == math.inf else worst >= HIT_RATE_VS_ORACLE, "cluster", where, "x"))
    # 2. TTFT p50 and p99 on the text workload below every vllm-router policy's, at every load level.
    routers = [p for p in result.get("workloads", {}).get("text", {}).get("policies", {})
               if p.startswith("vllm-router:")]
    worst, where, compared = -math.inf, "", 0
    for rate, c in policy_cells(result, "text", candidate).items():
        for rp in routers:
            r = policy_cells(result, "text", rp).get(rate)
            if not (ok(c) and ok(r)):
                continue
            for q in ("p50", "p99"):
                mine, theirs = c["ttft_ms"][q], r["ttft_ms"][q]
                if math.isnan(mine) or math.isnan(theirs) or theirs <= 0:
                    continue
                compared += 1
                x = mine / theirs
                if x > worst:
                    worst, where = x, f"{q} at {rate} req/s: {mine:.1f} ms vs {rp} {theirs:.1f} ms"
    out.append(_target("cluster_ttft", f"TTFT p50/p99 on the text workload / vllm-router's ({candidate}, worst)",
                       "< 1", None if not compared else worst, None if not compared else worst < 1.0, "cluster",
                       where, "x"))
    # 3. spread max/min <= 1.3 on the workload without shared prefixes (prefill and decode).
    worst, where = -math.inf, ""
    for rate, c in policy_cells(result, "unique", candidate).items():
        if not ok(c):
            continue
        for role in ("prefill", "decode"):
            s = c["counters"]["spread"].get(role)
            if s is not None and s > worst:
                worst, where = s, f"{role} at {rate} req/s: {c['counters']['requests'][role]}"
    out.append(_target("cluster_spread", f"Requests per instance max/min, no shared prefixes ({candidate})",
                       f"<= {SPREAD_LIMIT:g}", None if worst == -math.inf else worst,
                       None if worst == -math.inf else worst <= SPREAD_LIMIT, "cluster", where, "x"))
    # 4. proxy CPU per request within 5 % of least-loaded's (over the same cells).
    mine_cpu = mine_n = base_cpu = base_n = 0.0
    for wl in ("chat", "text"):
        for rate, c in policy_cells(result, wl, candidate).items():
            b = policy_cells(result, wl, "least-loaded").get(rate)
            if ok(c) and ok(b) and c.get("proxy_cpu_s") is not None and b.get("proxy_cpu_s") is not None:
                mine_cpu += c["proxy_cpu_s"]
                mine_n += c["requests"]
                base_cpu += b["proxy_cpu_s"]
                base_n += b["requests"]
    ratio = (mine_cpu / mine_n) / (base_cpu / base_n) if mine_n and base_n and base_cpu else None
    out.append(_target("cluster_cpu", f"Proxy CPU per request / least-loaded's ({candidate})",
                       f"<= {CPU_VS_LEAST_LOADED:g}", ratio, None if ratio is None else ratio <= CPU_VS_LEAST_LOADED,
                       "cluster", "" if ratio is None else
                       f"{1000 * mine_cpu / mine_n:.3f} vs {1000 * base_cpu / base_n:.3f} ms per request", "x"))
    rep = result.get("replicas")
    if isinstance(rep, dict) and rep.get("single") and rep.get("replicas"):
        s, r = rep["single"], rep["replicas"]
        if ok(s) and ok(r) and s["prefix_hit_rate"]:
            x = r["prefix_hit_rate"] / s["prefix_hit_rate"]
            out.append(_target("cluster_replicas", f"Hit rate, 2 replicas (one restarted) / one proxy "
                               f"({rep['policy']})", f">= {REPLICAS_HIT_RATE:g}", x, x >= REPLICAS_HIT_RATE,
                               "cluster", f"{100 * r['prefix_hit_rate']:.1f} % vs {100 * s['prefix_hit_rate']:.1f} %",
                               "x"))
    return out


def checks(result: dict) -> list[dict]:
    """The targets :func:`evaluate_targets` judged when the scenario ran."""
    return [c for c in result.get("targets") or [] if isinstance(c, dict)]
