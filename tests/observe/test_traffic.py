"""The console's numbers (traffic.py): rates over what a ring covers, errors by kind,
percentiles, merged over workers; one request's waterfall."""

from epd_proxy.observe.traffic import ALL, error_kind, finish, merge, partial, percentile, waterfall


def _s(end: float, *, model="m", status=200, outcome="ok", stream=True, ttft=10.0, itl=1.0, total=50.0,
       legs=(("prefill", "http://p", False), ("decode", "http://d", False)), stages=None, items=0,
       tokens=(100, 20, 40), kv=None) -> dict:
    return {"id": f"r{end}", "method": "POST", "path": "/v1/chat/completions", "model": model, "status": status,
            "outcome": outcome, "stream": stream, "end": end, "total_ms": total, "first_byte_ms": ttft,
            "itl_ms": itl if stream else None, "prompt_tokens": tokens[0], "completion_tokens": tokens[1],
            "cached_tokens": tokens[2], "items": items, "legs": [list(leg) for leg in legs],
            "stages_ms": stages if stages is not None else {"prefill": 4.0, "decode_first": 5.0}, "bytes": 10,
            "kv_outcome": kv}


def test_error_kinds():
    assert error_kind(_s(1)) is None
    assert error_kind(_s(1, outcome="in_band_error")) == "in_band"
    assert error_kind(_s(1, status=499, outcome="client_gone")) == "client_gone"
    assert error_kind(_s(1, status=503, outcome="error")) == "http_503"
    assert error_kind(_s(1, status=429, outcome="error")) == "http_429"


def test_percentile_by_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.9), percentile(values, 0.99)) == (50.0, 90.0, 99.0)
    assert percentile([], 0.5) is None
    assert percentile([7.0], 0.99) == 7.0


def test_rates_over_the_window_per_model_and_for_all():
    now = 1000.0
    summaries = [_s(985.0)]  # before the 10 s window: not counted
    summaries += [_s(now - 9 + i, ttft=float(i)) for i in range(8)]
    summaries += [_s(now - 1, model="other", status=503, outcome="error", stream=False, legs=(), stages={},
                     tokens=(None, None, None))]
    summaries += [_s(now - 0.5, outcome="in_band_error", legs=(("prefill", "http://p", False),
                                                                ("decode", "http://d", True),
                                                                ("decode", "http://d2", False)))]
    t = finish(merge([partial(summaries, now, 10.0)]))
    every, m, other = t["models"][ALL], t["models"]["m"], t["models"]["other"]
    assert every["requests"] == 10 and every["rps"] == 1.0
    assert m["requests"] == 9 and other["requests"] == 1
    assert every["errors_per_s"] == {"http_503": 0.1, "in_band": 0.1}
    assert every["error_ratio"] == 0.2
    assert m["ttft_ms"]["n"] == 8 and m["ttft_ms"]["p50"] == 3.0 and m["ttft_ms"]["p99"] == 7.0
    assert m["prompt_tokens_per_s"] == 90.0 and m["cached_ratio"] == 0.4
    assert m["kv_transfers_per_s"] == 0.9
    assert m["retried_per_s"] == 0.0  # the request a decode failed ended in error: not "retried"


def test_a_ring_that_started_recording_lately_rates_over_what_it_saw():
    t = finish(merge([partial([_s(99.0), _s(99.5)], 100.0, 10.0, since=98.0)]))
    assert t["covered_s"] == 2.0 and t["models"][ALL]["rps"] == 1.0


def test_a_full_ring_covers_back_to_its_oldest_summary():
    ring = [_s(96.0 + i * 0.5) for i in range(8)]  # 4 s of a busy worker
    t = finish(merge([partial(ring, 100.0, 10.0, oldest=ring[0]["end"])]))
    assert t["covered_s"] == 4.0 and t["models"][ALL]["rps"] == 2.0


def test_workers_rates_add_up_and_samples_join():
    a = partial([_s(99.0, ttft=1.0), _s(99.5, ttft=2.0)], 100.0, 10.0)
    b = partial([_s(99.2, ttft=30.0, model="n")], 100.0, 10.0)
    t = finish(merge([a, b]))
    assert t["models"][ALL]["rps"] == 0.3 and t["models"][ALL]["requests"] == 3
    assert t["models"][ALL]["ttft_ms"]["n"] == 3 and t["models"][ALL]["ttft_ms"]["p99"] == 30.0
    assert set(t["models"]) == {ALL, "m", "n"}


def test_waterfall_of_a_pull_request_with_a_retry():
    s = _s(1.0, ttft=20.0, total=40.0, items=2,
           stages={"encode": 3.0, "prefill": 6.0, "decode_first": 9.0},
           legs=(("encode", "http://e", False), ("prefill", "http://p", False), ("decode", "http://d1", True),
                 ("decode", "http://d2", False)))
    w = {seg["stage"]: seg for seg in waterfall(s)}
    assert list(w) == ["encode", "prefill", "decode", "first_byte", "stream"]
    assert (w["encode"]["start_ms"], w["encode"]["end_ms"], w["encode"]["label"]) == (0.0, 3.0, "encode (2 items)")
    assert (w["prefill"]["start_ms"], w["prefill"]["end_ms"]) == (3.0, 9.0)
    assert (w["decode"]["start_ms"], w["decode"]["end_ms"]) == (9.0, 18.0)
    assert w["decode"]["instances"] == ["http://d2"] and w["decode"]["failed"] == ["http://d1"]
    assert (w["first_byte"]["start_ms"], w["stream"]["end_ms"]) == (20.0, 40.0)


def test_waterfall_of_a_push_request_runs_prefill_beside_decode():
    s = _s(1.0, ttft=12.0, total=30.0, stages={"prefill": 6.0, "kv_handoff": 4.0, "decode_first": 10.0})
    w = {seg["stage"]: seg for seg in waterfall(s)}
    assert (w["prefill"]["start_ms"], w["decode"]["start_ms"]) == (0.0, 0.0)
    assert (w["kv_handoff"]["start_ms"], w["kv_handoff"]["end_ms"]) == (6.0, 10.0)


def test_waterfall_of_a_request_that_failed_before_any_stage():
    s = _s(1.0, status=503, outcome="error", stream=False, ttft=None, total=5.0, stages={},
           legs=(("decode", "http://d", True),))
    w = waterfall(s)
    assert [seg["stage"] for seg in w] == ["decode"] and w[0]["failed"] == ["http://d"]


def test_reused_turns_are_counted_per_model_over_the_window_and_across_workers():
    a = partial([_s(99.0, kv="opening"), _s(99.2, kv="reused"), _s(99.4, kv="local_prefill"), _s(99.6)],
                100.0, 10.0)
    b = partial([_s(99.1, kv="reused", model="n"), _s(99.3, kv="edited", model="n"), _s(80.0, kv="reused")],
                100.0, 10.0)  # the last ended before the window
    t = finish(merge([a, b]))
    m, n, every = t["models"]["m"], t["models"]["n"], t["models"][ALL]
    assert (m["kv_turns"], m["reused_turns"]) == (3, 2)  # the request without an outcome was not looked up
    assert (n["kv_turns"], n["reused_turns"]) == (2, 1)
    assert (every["kv_turns"], every["reused_turns"], every["reused_turns_per_s"]) == (5, 3, 0.3)


def test_waterfall_starts_with_the_turn_s_reuse_outcome():
    s = _s(1.0, kv="reused", stages={"prefill": 6.0, "decode_first": 9.0})
    w = waterfall(s)
    assert w[0]["stage"] == "kv_reuse" and w[0]["outcome"] == "reused" and w[0]["instances"] == ["http://d"]
    assert w[0]["label"].startswith("multi-turn KV reused") and "read the previous turn" in w[0]["label"]
    assert "previous turn's KV" in w[1]["label"]
    w = waterfall(_s(1.0, kv="edited"))
    assert w[0]["outcome"] == "edited" and "not reused" in w[0]["label"] and w[0]["instances"] == []
    assert [seg["stage"] for seg in waterfall(_s(1.0))][0] == "prefill"  # not looked up: no mark


def test_the_placed_legs_stages_say_why_they_went_there():
    s = _s(1, legs=(("decode", "http://d", False),), stages={"decode_first": 5.0})
    why = "holds the prompt (KV events): computes the rest alone"
    s["placement"] = {"decode": {"instance": "http://d", "why": why},
                      "prefill": {"instance": None, "why": "none: the decode computes the prompt"},
                      "kv_from": None, "connector": "none", "rank": None}
    decode = [w for w in waterfall(s) if w["stage"] == "decode"]
    assert decode[0]["why"] == why
    s = _s(1)
    s["placement"] = {"decode": {"instance": "http://d", "why": "least-loaded"},
                      "prefill": {"instance": "http://p", "why": "round-robin"}, "kv_from": None,
                      "connector": "nixl", "rank": None}
    assert {w["stage"]: w.get("why") for w in waterfall(s) if w["stage"] in ("prefill", "decode")} == {
        "prefill": "round-robin", "decode": "least-loaded"}
    assert all("why" not in w for w in waterfall(_s(1)))
