"""Pure: the whole gateway in one console. Each proxy process (a replica, or each of its
``--workers``) publishes a short summary to the shared state store every few seconds
(``gateway.py``); any console reads every summary and shows the replicas side by side and
their sum, a replica whose summary stopped coming marked as such.

A summary is what one process knows of itself: who it is (host, listen address, pid, worker,
version, start), its traffic since its previous summary (rates from its metrics' plain
counters, TTFT and ITL percentiles from its histograms' buckets: nothing on the request path
but what the metrics already count), and each instance's state as its own health view has it.
"""

from __future__ import annotations

STALE_AFTER = 3  # a summary older than this many of its publisher's intervals: the replica stopped publishing
REASON_CHARS = 160  # an instance's reason, as far as a summary carries it


def totals(requests: dict, stream_errors: int, ttft: list[list[int]], itl: list[int], tokens_out: int) -> dict:
    """One process's counters now (from ``ProxyMetrics``): answered requests, errors (a status
    of 400 or more, or a stream that ended in an error event), the TTFT histograms' bucket
    counts summed over endpoints, ITL's, completion tokens."""
    width = max((len(c) for c in ttft), default=0)
    ttft_sum = [sum(c[i] for c in ttft if i < len(c)) for i in range(width)]
    return {"requests": sum(requests.values()),
            "errors": sum(n for (_, status), n in requests.items() if status >= 400) + stream_errors,
            "ttft": ttft_sum, "itl": list(itl), "tokens_out": tokens_out}


def bucket_quantile(bounds: tuple, counts: list[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram's per-bucket counts (upper bounds ``bounds``,
    the last bucket above them all), interpolated within its bucket as Prometheus'
    ``histogram_quantile`` does; None without observations."""
    n = sum(counts)
    if not n:
        return None
    rank = q * n
    seen = 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i >= len(bounds):
                return float(bounds[-1])  # above every bound: the largest bound, as Prometheus says
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (rank - seen) / c
        seen += c
    return float(bounds[-1])


def _delta(now: list[int], before: list[int] | None) -> list[int]:
    if not before or len(before) != len(now):
        return list(now)
    return [max(0, a - b) for a, b in zip(now, before)]


def traffic(now: dict, before: dict | None, seconds: float, inflight: int, bounds: tuple) -> dict:
    """The traffic between two :func:`totals` ``seconds`` apart (``before`` None: since the
    process started, over ``seconds``): rates per second, latency percentiles in ms."""
    span = max(seconds, 1e-3)
    prev = before or {"requests": 0, "errors": 0, "tokens_out": 0, "ttft": None, "itl": None}
    ttft = _delta(now["ttft"], prev["ttft"])
    itl = _delta(now["itl"], prev["itl"])

    def ms(counts: list[int], q: float) -> float | None:
        value = bucket_quantile(bounds, counts, q)
        return None if value is None else round(value * 1000, 2)

    return {"rps": round(max(0, now["requests"] - prev["requests"]) / span, 3),
            "errors_per_s": round(max(0, now["errors"] - prev["errors"]) / span, 3),
            "tokens_out_per_s": round(max(0, now["tokens_out"] - prev["tokens_out"]) / span, 2),
            "inflight": inflight, "requests_total": now["requests"], "errors_total": now["errors"],
            "ttft_p50_ms": ms(ttft, 0.5), "ttft_p99_ms": ms(ttft, 0.99), "itl_p50_ms": ms(itl, 0.5)}


def instance_states(views: list[dict]) -> list[dict]:
    """The instances as one process's health view has them (its console views, ``console_view``),
    cut to what a summary carries."""
    return [{"url": v["url"], "role": v["role"], "state": v["state"], "in_rotation": v["in_rotation"],
             "reason": (v["reason"] or "")[:REASON_CHARS] or None, "inflight": v["inflight"]} for v in views]


def replica_key(identity: dict) -> str:
    """What a replica is: its host, listen address and proxy process (the parent of its workers)."""
    return f"{identity['host']} {identity['listen']} {identity['proxy_pid']}"


def _stale(summary: dict, now: float) -> bool:
    return summary.get("stopping", False) or now - summary["published"] > STALE_AFTER * summary["interval"]


def _sum_traffic(parts: list[dict]) -> dict:
    out: dict = {name: 0 for name in ("rps", "errors_per_s", "tokens_out_per_s", "inflight", "requests_total",
                                      "errors_total")}
    for t in parts:
        for name in out:
            out[name] += t[name]
    for name in ("rps", "errors_per_s", "tokens_out_per_s"):
        out[name] = round(out[name], 3)
    # Percentiles do not add up: the worst part's, marked as such.
    for name in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms"):
        values = [t[name] for t in parts if t[name] is not None]
        out[name] = max(values) if values else None
    return out


def gateway(summaries: list[dict], now: float, me: int, store: dict | None, failures: dict) -> dict:
    """The console's ``gateway`` from every summary read (``me``: this process's id): one row
    per replica (its workers' summaries together), each ``live`` or ``stopped`` (its newest
    summary older than :data:`STALE_AFTER` intervals, or its last one said it was stopping),
    the sum over the live ones, and per instance in how many live replicas it is in rotation.
    ``store``: the store's status (``guard.py``); ``failures``: the board's own (publish, read)."""
    groups: dict[str, list[dict]] = {}
    for s in summaries:
        groups.setdefault(replica_key(s["identity"]), []).append(s)
    replicas = []
    for key, parts in groups.items():
        parts.sort(key=lambda s: s["identity"].get("worker") or 0)
        live = [s for s in parts if not _stale(s, now)]
        newest = max(s["published"] for s in parts)
        ident = parts[0]["identity"]
        if live:
            state, text = "live", "publishing"
        elif any(s.get("stopping") for s in parts):
            state, text = "stopped", "shut down"
        else:
            state, text = "stale", f"no summary for {now - newest:.0f} s: stopped or cut off from the store"
        instances = _replica_instances(live or parts)
        replicas.append({
            "key": key, "host": ident["host"], "listen": ident["listen"], "proxy_pid": ident["proxy_pid"],
            "version": ident["version"], "started": ident["started"], "workers": ident["workers"],
            "workers_publishing": len(live), "state": state, "state_text": text, "published": round(newest, 3),
            "age_s": round(max(0.0, now - newest), 1), "this": any(s["id"] == me for s in parts),
            "traffic": _sum_traffic([s["traffic"] for s in live or parts]),
            "instances_in_rotation": sum(1 for i in instances.values() if i["in_rotation"]),
            "instances": len(instances),
            "out": sorted(({"url": url, "role": i["role"], "state": i["state"], "reason": i["reason"]}
                           for url, i in instances.items() if not i["in_rotation"]), key=lambda i: i["url"])})
    replicas.sort(key=lambda r: (not r["this"], r["host"], r["listen"]))
    live_rows = [r for r in replicas if r["state"] == "live"]
    kind = (store or {}).get("kind")
    scope = "gateway" if kind == "redis" else "proxy"
    text = ("the gateway: every replica publishing to the shared state store" if scope == "gateway" else
            "one proxy: its workers (replicas see each other with --state-store redis://…)")
    return {"shared": True, "scope": scope, "scope_text": text, "store": store, "failures": dict(failures),
            "replicas": replicas, "live": len(live_rows), "stopped": len(replicas) - len(live_rows),
            "sum": _sum_traffic([r["traffic"] for r in live_rows]),
            "disagree": _disagreements(live_rows, groups)}


def _replica_instances(parts: list[dict]) -> dict[str, dict]:
    """One replica's instances over its workers: in rotation only if in every worker."""
    out: dict[str, dict] = {}
    for s in parts:
        for i in s["instances"]:
            have = out.get(i["url"])
            if have is None:
                out[i["url"]] = dict(i)
            elif not i["in_rotation"]:
                have.update(in_rotation=False, state=i["state"], reason=have["reason"] or i["reason"])
    return out


def _disagreements(live: list[dict], groups: dict[str, list[dict]]) -> list[dict]:
    """The instances the live replicas do not see alike (one has it out, another in)."""
    seen: dict[str, dict] = {}
    for r in live:
        for url, i in _replica_instances([s for s in groups[r["key"]]]).items():
            entry = seen.setdefault(url, {"url": url, "role": i["role"], "in_rotation": 0, "replicas": 0})
            entry["replicas"] += 1
            entry["in_rotation"] += 1 if i["in_rotation"] else 0
    return sorted((e for e in seen.values() if 0 < e["in_rotation"] < e["replicas"] or e["replicas"] < len(live)),
                  key=lambda e: e["url"])


def alone(workers: int, kind: str | None) -> dict:
    """Without a store replicas share: what this console covers, said plainly."""
    if kind == "parent":
        text = (f"one proxy: its {workers} workers. Replicas behind a load balancer do not see each other "
                "without --state-store redis://…")
    else:
        text = "one replica: this proxy only. Replicas see each other with --state-store redis://…"
    return {"shared": False, "scope": "proxy" if kind == "parent" else "replica", "scope_text": text}
