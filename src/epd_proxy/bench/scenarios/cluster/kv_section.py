"""The KV events comparison's part of the cluster scenario's report: a table per case, a row per
policy (its targets are in the report's targets table with the others)."""

from __future__ import annotations

from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.scenarios.cluster import kv_evaluate


def _case_text(entry: dict) -> str:
    c = entry["case"]
    parts = [f"caches {fmt(entry.get('cache_ratio'), 3)} × the working set "
             f"({entry.get('prefix_cache_blocks_per_instance')} blocks per prefill)"
             + (": evictions" if c["evictions"] else ": no evictions")]
    if c["replicas"] > 1:
        parts.append(f"{c['replicas']} proxy replicas (vllm-router: {c['replicas']} processes), turn t to replica "
                     f"t mod {c['replicas']}")
    if c["direct"]:
        parts.append(f"a second population straight to the instances ({fmt(c['direct'], 2)} × the conversations "
                     "and rate; its tokens are in the hit rates)")
    if c["restart"]:
        parts.append("prefill 0 restarted when half the conversations had started (caches emptied, events' "
                     "sequence from 0); clients retry a failed turn")
    return "; ".join(parts)


def kv_section(r: dict) -> list[str]:
    kv = r.get("kv")
    if not isinstance(kv, dict):
        return []
    ws = kv.get("working_set", {})
    out = ["### KV events: exact routing against approximate, vllm-router and the oracle", "",
           f"The {kv.get('workload')} workload at {kv.get('rate')} req/s: {ws.get('requests')} requests, working set "
           f"{ws.get('blocks')} blocks. Every cell on a fresh cluster whose instances publish KV events; "
           f"**{kv.get('exact')}** subscribes, **{kv.get('today')}** routes as before (approximate). Hit rate "
           "and prefill tokens computed are the instances' counters (a decode's local prefill included); "
           "the oracle's row is that of the first case with the same caches, population and restart (it has "
           "no replicas). From the proxies' `/metrics`: prefill picks made on the block index, requests a "
           "decode served alone because it held the prompt "
           "(`epd_proxy_not_disaggregated_total{reason=\"cached\"}`), engine restarts the events showed.", ""]
    rows_by_case: dict[str, list] = {}
    for f in kv_evaluate.figures(kv):
        if "error" in f:
            rows_by_case.setdefault(f["case"], []).append([f["policy"], f["error"]] + [""] * 8)
            continue
        errs = str(f["errors"]) + (f" ({f['retried']} retried)" if f["retried"] else "")
        rows_by_case.setdefault(f["case"], []).append([
            f["policy"], fmt(100 * f["hit_rate"], 1), fmt(f["vs_oracle"], 3),
            f"{fmt(f['ttft_p50'], 1)} / {fmt(f['ttft_p99'], 1)}",
            f"{f['computed']:,}" if isinstance(f["computed"], int) else "–", fmt(f["cpu_ms"], 3),
            str(f["requests"]) + (f" + {f['direct_requests']} direct" if f.get("direct_requests") else ""),
            (f"{f['exact_picks']} / {f['decode_alone']} / {f['restarts_seen']}" if "exact_picks" in f else "–"),
            errs, str(f["verify_errors"])])
    for name, entry in kv.get("cases", {}).items():
        out += [f"#### {name}", "", _case_text(entry) + ".", ""]
        rows = rows_by_case.get(name, [])
        if entry.get("oracle_of") != name:
            rows.append([f"oracle: see {entry['oracle_of']}"] + [""] * 9)
        out += [table(["policy", "prefix hit %", "hit rate / oracle's", "TTFT p50 / p99 ms", "prefill tokens computed",
                       "proxy CPU ms/req", "requests",
                       "index picks / decode alone / restarts seen", "errors", "mismatches"], rows), ""]
    return out
