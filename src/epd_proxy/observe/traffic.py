"""Pure: the console's numbers from recent request summaries (``recent.py``).

Three steps, so that ``--workers`` can answer for the whole proxy: each worker turns its own
ring into a :func:`partial` (rates per second over what its ring covers, and bounded samples
of the latencies), the worker a console asked :func:`merge`\\ s every worker's partials (rates
add up, samples join), and :func:`finish` turns the result into percentiles and ratios.
:func:`waterfall` lays one request's stage times out on a time line.
"""

from __future__ import annotations

ALL = "*"  # the row of every model together
SAMPLES = 1000  # latency samples kept per model and measure in a partial (the newest)
_LATENCIES = ("ttft", "itl", "total")
_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "items", "kv_transfers", "retried",
           "streams", "turns", "reused_turns")
_TALLIES = ("turns", "reused_turns")  # also kept as counts over the window, not only as rates
# Multi-turn KV reuse outcomes (request/turns/outcomes.py) in which the turn used decode's KV.
REUSED_OUTCOMES = ("reused", "local_prefill")
# Each outcome in words, for the waterfall (the labels are request/turns/outcomes.py's).
KV_OUTCOME_TEXT = {
    "reused": "reused: the prefill read the previous turn's KV from the decode holding it",
    "local_prefill": "reused: the decode holding the previous turn computed the new part alone (no prefill)",
    "opening": "opening turn: nothing to reuse",
    "unmatched": "nothing to reuse: the prompt extends no turn held here",
    "not_keyed": "not reusable: the earlier answer holds what decode never held",
    "not_held": "not reused: nothing held here for the earlier answer",
    "stream_no_params": "not reused: the earlier answer was a stream without KV parameters (vLLM 0.32)",
    "older_turn": "not reused: only an older turn of the conversation is held here",
    "edited": "not reused: the history differs from the turn held",
    "already_used": "not reused: already given to a prefill (a retry or a second request)",
    "expired": "not reused: the held KV expired",
    "evicted": "not reused: the held KV was let go (capacity)",
    "superseded": "not reused: a newer turn replaced it",
    "decode_gone": "not reused: the decode holding it left, is draining or failed",
    "decode_dropped": "not reused: the decode's KV events say it no longer holds it (evicted, restarted)",
    "invalid": "not reused: the kept turn read back from the shared store failed its checks",
    "tokens": "not reused: too few tokens shared with what decode holds",
    "tokenize_failed": "not reused: no instance tokenized the prompt",
    "prefill_failed": "not reused: the prefill failed reading it and ran again without",
    "no_pull_prefill": "not reused: no prefill instance to read it",
    "media": "not looked up: the request has media",
    "retried": "not reused: the attempt that had it failed; the retry computed the history",
    "request_failed": "not reused: the request ended before its prefill ran",
}


def error_kind(s: dict) -> str | None:
    """What went wrong with a request, as the console counts it (None: it did not fail):
    ``in_band`` (a committed stream ended with an error event), ``client_gone`` (499),
    ``http_<status>`` otherwise (429: shed; 503: no instance, shutting down; 504: a timeout)."""
    if s["outcome"] == "in_band_error":
        return "in_band"
    status = s["status"]
    if status == 499:
        return "client_gone"
    if status >= 400:
        return f"http_{status}"
    return None


def _new_row() -> dict:
    row: dict = {name: 0 for name in _COUNTS}
    row["errors"] = {}
    for name in _LATENCIES:
        row[name] = []
    return row


def _count(row: dict, s: dict) -> None:
    row["requests"] += 1
    kind = error_kind(s)
    if kind is not None:
        row["errors"][kind] = row["errors"].get(kind, 0) + 1
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        if s[name]:
            row[name] += s[name]
    row["items"] += s["items"]
    roles = [leg[0] for leg in s["legs"]]
    if "prefill" in roles and "decode" in roles:
        row["kv_transfers"] += 1  # a prefill's KV handed to a decode (P/D)
    if kind is None and any(leg[2] for leg in s["legs"]):
        row["retried"] += 1  # answered after an instance failed it
    kv = s["kv_outcome"]
    if kv is not None:
        row["turns"] += 1  # looked up for multi-turn KV reuse
        if kv in REUSED_OUTCOMES:
            row["reused_turns"] += 1
    if s["stream"] and kind is None:
        row["streams"] += 1
        if s["first_byte_ms"] is not None:
            row["ttft"].append(s["first_byte_ms"])
        if s["itl_ms"] is not None:
            row["itl"].append(s["itl_ms"])
    if kind is None and s["total_ms"] is not None:
        row["total"].append(s["total_ms"])


def _add(into: dict, row: dict) -> None:
    for name in _COUNTS:
        into[name] += row[name]
    for kind, n in row["errors"].items():
        into["errors"][kind] = into["errors"].get(kind, 0) + n
    for name in _LATENCIES:
        into[name] += row[name]


def partial(summaries: list[dict], now: float, window: float, since: float = 0.0,
            oldest: float | None = None) -> dict:
    """One worker's numbers over the last ``window`` seconds before ``now`` (wall time):
    per model (and :data:`ALL`), counts as rates per second over the seconds its ring covers,
    and the newest :data:`SAMPLES` latencies (ms). ``since``: when its ring started recording;
    ``oldest``: when a full ring's oldest request ended (it covers no further back)."""
    start = max(now - window, since)
    if oldest is not None:
        start = max(start, oldest)
    covered = max(now - start, 1.0)  # a rate over less than a second says little
    rows: dict[str, dict] = {}
    for s in summaries:
        if s["end"] < start:
            continue
        model = s["model"] or "-"
        row = rows.get(model)
        if row is None:
            row = rows[model] = _new_row()
        _count(row, s)
    every = rows[ALL] = _new_row()
    for model, row in list(rows.items()):
        if model != ALL:
            _add(every, row)
    out = {}
    for model, row in rows.items():
        rated = {name: row[name] / covered for name in _COUNTS}
        rated["errors"] = {kind: n / covered for kind, n in row["errors"].items()}
        for name in _LATENCIES:
            rated[name] = row[name][-SAMPLES:]
        rated["count"] = row["requests"]
        for name in _TALLIES:
            rated[name + "_count"] = row[name]
        out[model] = rated
    return {"covered_s": round(covered, 3), "models": out}


def merge(partials: list[dict]) -> dict:
    """Every worker's partial as one: rates add up, samples join, errors add up by kind."""
    models: dict[str, dict] = {}
    for p in partials:
        for model, row in p["models"].items():
            have = models.get(model)
            if have is None:
                have = models[model] = _new_row()
                have["count"] = 0
                for name in _TALLIES:
                    have[name + "_count"] = 0
            for name in _COUNTS:
                have[name] += row[name]
            have["count"] += row["count"]
            for name in _TALLIES:
                have[name + "_count"] += row[name + "_count"]
            for kind, rate in row["errors"].items():
                have["errors"][kind] = have["errors"].get(kind, 0.0) + rate
            for name in _LATENCIES:
                have[name] = have[name] + row[name]
    covered = min((p["covered_s"] for p in partials), default=0.0)
    return {"covered_s": covered, "models": models}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by the nearest rank; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 1))  # ceil(n * q), at least 1
    return ordered[int(min(rank, len(ordered))) - 1]


def _quantiles(values: list[float]) -> dict:
    return {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9), "p99": percentile(values, 0.99),
            "n": len(values)}


def finish(merged: dict) -> dict:
    """Per model: requests and errors per second, the error share, TTFT / ITL / duration
    percentiles (ms), tokens per second, the share of prompt tokens served from a cache,
    encoder items, P/D KV hand-offs and retried requests per second; the turns looked up
    for multi-turn KV reuse and those that reused decode's KV, counted over the window."""
    out = {}
    for model, row in merged["models"].items():
        rps = row["requests"]
        errors = sum(row["errors"].values())
        prompt = row["prompt_tokens"]
        out[model] = {
            "requests": row["count"],
            "rps": round(rps, 3),
            "errors_per_s": {kind: round(rate, 3) for kind, rate in sorted(row["errors"].items())},
            "error_ratio": round(errors / rps, 4) if rps else 0.0,
            "ttft_ms": _quantiles(row["ttft"]),
            "itl_ms": _quantiles(row["itl"]),
            "duration_ms": _quantiles(row["total"]),
            "prompt_tokens_per_s": round(prompt, 2),
            "completion_tokens_per_s": round(row["completion_tokens"], 2),
            "cached_tokens_per_s": round(row["cached_tokens"], 2),
            "cached_ratio": round(row["cached_tokens"] / prompt, 4) if prompt else None,
            "encoder_items_per_s": round(row["items"], 3),
            "kv_transfers_per_s": round(row["kv_transfers"], 3),
            "retried_per_s": round(row["retried"], 3),
            "kv_turns": row["turns_count"],
            "reused_turns": row["reused_turns_count"],
            "reused_turns_per_s": round(row["reused_turns"], 3),
        }
    return {"covered_s": merged["covered_s"], "models": out}


def waterfall(s: dict) -> list[dict]:
    """One request's stages on a time line from its arrival (ms), each with the instances
    that served it and those that failed it. The stage times are the request's
    ``Server-Timing`` (durations summed over attempts), laid out in the order the legs run:
    encode, then prefill; decode's wait for its first event after the prefill (pull
    connectors: the KV is read then) or beside it (push connectors: ``kv_handoff`` is
    decode's wait once the prefill answered); then the first byte to the client and, for a
    stream, the relay until the last byte. A turn looked up for multi-turn KV reuse starts
    with its outcome (``kv_reuse``, a mark at 0, with the decode it was held on when reused);
    the prefill's and the decode's stage say why the last attempt placed them there (``why``); a
    stream moved to another decode after the commit adds a ``move`` per move, from when its
    decode broke off until the continuation answered, with the decode it left (``failed``) and
    the one it went to."""
    stages = s["stages_ms"]
    legs = s["legs"]
    total = s["total_ms"] or 0.0

    def on(role: str) -> tuple[list[str], list[str]]:
        served = [leg[1] for leg in legs if leg[0] == role and not leg[2]]
        failed = [leg[1] for leg in legs if leg[0] == role and leg[2]]
        return served, failed

    out: list[dict] = []

    def add(name: str, label: str, start: float, length: float, role: str | None) -> float:
        end = min(start + length, total) if total else start + length
        served, failed = on(role) if role else ([], [])
        out.append({"stage": name, "label": label, "start_ms": round(start, 3), "end_ms": round(max(end, start), 3),
                    "instances": served, "failed": failed})
        return start + length

    kv = s["kv_outcome"]
    if kv is not None:
        held = on("decode")[0] if kv in REUSED_OUTCOMES else []
        out.append({"stage": "kv_reuse", "label": "multi-turn KV " + KV_OUTCOME_TEXT.get(kv, kv), "start_ms": 0.0,
                    "end_ms": 0.0, "instances": held, "failed": [], "outcome": kv})
    t = 0.0
    if "encode" in stages:
        t = add("encode", f"encode ({s['items']} item{'s' if s['items'] != 1 else ''})", 0.0, stages["encode"],
                "encode")
    prefill = stages.get("prefill")
    handoff = stages.get("kv_handoff")
    first = stages.get("decode_first")
    whole = stages.get("decode")
    decode = first if first is not None else whole
    label = "decode to its first event" if first is not None else "decode (whole answer)"
    if prefill is not None and handoff is not None:  # push: prefill and decode run side by side
        add("prefill", "prefill (KV pushed to decode)", t, prefill, "prefill")
        add("kv_handoff", "decode waits for the KV", t + prefill, handoff, None)
        if decode is not None:
            add("decode", label, t, decode, "decode")
    else:
        if prefill is not None:
            t = add("prefill", "prefill, the previous turn's KV read from decode" if kv == "reused" else "prefill",
                    t, prefill, "prefill")
            label += ", KV read from the prefill" if first is not None or whole is not None else ""
        if decode is not None:
            add("decode", label, t, decode, "decode")
        elif not stages and legs:  # failed before any stage finished: where it went
            add("decode", "no stage finished", 0.0, total, legs[-1][0])
    placed = s.get("placement")
    if placed is not None:  # the placed legs' stages say why they went where they did
        for entry in out:
            leg = placed.get(entry["stage"])
            if isinstance(leg, dict) and leg["instance"]:
                entry["why"] = leg["why"]
                if not entry["instances"]:  # another role's instance in the leg
                    entry["instances"] = [leg["instance"]]  # (a prefill answering alone: decision.py)
    if s["first_byte_ms"] is not None:
        fb = s["first_byte_ms"]
        out.append({"stage": "first_byte", "label": "first byte to the client", "start_ms": round(fb, 3),
                    "end_ms": round(fb, 3), "instances": [], "failed": []})
        if s["stream"] and total > fb:
            out.append({"stage": "stream", "label": "stream relayed until the last byte", "start_ms": round(fb, 3),
                        "end_ms": round(total, 3), "instances": [], "failed": []})
    for move in s.get("moves") or ():  # a stream continued on another decode (request/migration.py)
        to = move["to"]
        out.append({"stage": "move", "start_ms": move["at_ms"], "end_ms": round(move["at_ms"] + move["ms"], 3),
                    "label": f"decode broke off ({move['reason']}): "
                             + ("stream continued on another decode" if to else f"not continued ({move['result']})"),
                    "instances": [to] if to else [], "failed": [move["from"]], "result": move["result"]})
    return out
