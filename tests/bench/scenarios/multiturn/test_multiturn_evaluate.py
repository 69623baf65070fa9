"""The multiturn scenario's pure parts: counters between snapshots, the targets, the report."""

from epd_proxy.bench.scenarios.multiturn.evaluate import counters, decode_itl, evaluate_targets, mismatches, section


def _state(**stats) -> dict:
    kept = stats.pop("kept", 0)
    return {"stats": stats, "prefix_cache": {"queries": 0, "hits": 0}, "kept_kv_blocks": kept}


def test_counters_sum_roles_between_snapshots():
    before = {"prefill": [_state(local_prompt_tokens=100, requests=2), _state(local_prompt_tokens=50)],
              "decode": [_state(local_prompt_tokens=0, kv_bytes_transferred=10, kept=3)]}
    after = {"prefill": [_state(local_prompt_tokens=400, external_cached_tokens=300, kv_bytes_transferred=64,
                                wrong_answers=1, requests=7),
                         _state(local_prompt_tokens=80)],
             "decode": [_state(local_prompt_tokens=42, kv_bytes_transferred=30, local_prefills=1, kept=9)]}
    c = counters(before, after)
    assert c["computed_prefill"] == 330 and c["computed_decode"] == 42 and c["computed"] == 372
    assert c["read_from_decode"] == 300
    assert c["kv_moved_bytes"] == 64 + 20
    assert c["wrong_kv_reads"] == 1 and c["local_prefills_on_decode"] == 1
    assert c["kept_kv_blocks_end"] == 9 and c["prefill"]["requests"] == 5


def test_decode_itl_from_the_decodes_steps_between_snapshots():
    before = [{"itl_model": [[5.0, 100], [9.0, 2]]}, {"itl_model": []}]
    after = [{"itl_model": [[5.0, 1100], [9.0, 2], [10.5, 8]]}, {"itl_model": [[5.0, 900], [12.0, 2]]}]
    got = decode_itl(before, after)  # 1,900 tokens at 5 ms, 8 at 10.5, 2 at 12
    assert got == {"tokens": 1910, "p50": 5.0, "p99": 5.0, "longer": 10}
    after[1]["itl_model"] = [[5.0, 900], [12.0, 30]]  # 38 of 1,938 after a longer step: past 1 %
    assert decode_itl(before, after)["p99"] == 12.0
    assert decode_itl([], [])["tokens"] == 0


def _cell(computed, p50, p99, itl, verify=0, wrong=0, d_itl=None, **kw):
    d = {"p99": itl if d_itl is None else d_itl, "longer": 0}
    return {"requests": 10, "errors": 0, "verify_errors": verify, "ttft_ms": {"p50": p50, "p99": p99},
            "itl_ms": {"p99": itl}, "held": {"peak_total": 5},
            "counters": {"computed": computed, "computed_prefill": computed, "computed_decode": 0,
                         "read_from_decode": 0, "kv_moved_bytes": 0, "wrong_kv_reads": wrong,
                         "kept_kv_blocks_end": 1, "local_prefills_on_decode": 0, "prefill": {"requests": 10},
                         "decode_itl_ms": d}, **kw}


def _result(cells: dict, short: dict | None = None) -> dict:
    def w(cs):
        return {"spec": {"conversations": 1, "turns": 2, "system_words": 3, "user_words": 4, "max_tokens": 5},
                "prefix_cache_blocks": 7, "cache_ratio": 0.15, "rates": [25.0],
                "targets": {n: {"rates": {"25.0": c}} for n, c in cs.items()}}
    out = {"candidate": "reuse-skip", "counts": {"prefill": 3, "decode": 4}, "workloads": {"long": w(cells)}}
    if short:
        out["workloads"]["short"] = w(short)
    return out


def test_targets_met_and_missed():
    cells = {"cache-aware": _cell(1000, 50, 200, 6.0), "reuse": _cell(700, 45, 150, 6.0),
             "reuse-skip": _cell(500, 40, 120, 6.2), "vllm-multiturn": _cell(600, 60, 300, 9.0),
             "vllm-router:cache_aware": _cell(1200, 35, 400, 6.0),
             "vllm-router:power_of_two": {"available": False, "note": "not installed"}}
    by = {t["key"]: t for t in evaluate_targets(_result(cells, short={"reuse-skip": _cell(9, 1, 1, 1, verify=1)}))}
    assert by["mt_computed"]["measured"] == 0.5 and by["mt_computed"]["met"]
    assert abs(by["mt_itl_p99"]["measured"] - 6.2 / 6.0) < 1e-9 and by["mt_itl_p99"]["met"]
    # p50: the router's 35 ms is the best of the others, 40 is not below it
    assert by["mt_ttft_p50"]["measured"] == 40 / 35 and not by["mt_ttft_p50"]["met"]
    assert "vllm-router:cache_aware" in by["mt_ttft_p50"]["note"]
    assert by["mt_ttft_p99"]["measured"] == 120 / 200 and by["mt_ttft_p99"]["met"]
    assert by["mt_mismatches"]["measured"] == 1 and not by["mt_mismatches"]["met"]
    # decode's own ITL is what the target weighs; the client's is reported beside it
    cells["reuse-skip"] = _cell(500, 40, 120, 6.0, d_itl=7.0)
    by = {t["key"]: t for t in evaluate_targets(_result(cells))}
    assert by["mt_itl_p99"]["measured"] == 7.0 / 6.0 and not by["mt_itl_p99"]["met"]
    assert "client ITL p99 6.00 against 6.00 ms" in by["mt_itl_p99"]["note"]


def test_no_targets_without_the_candidate_or_the_baseline():
    assert evaluate_targets(_result({"cache-aware": _cell(1, 1, 1, 1)})) == []
    out = evaluate_targets(_result({"reuse-skip": _cell(1, 1, 1, 1, wrong=2)}))
    assert [(t["key"], t["measured"]) for t in out] == [("mt_mismatches", 2)]


def test_section_lists_every_target_and_why_one_did_not_run():
    cells = {"cache-aware": _cell(1000, 50, 200, 6.0), "reuse-skip": _cell(500, 40, 120, 6.2, wrong=1),
             "vllm-router:power_of_two": {"available": False, "note": "not installed (pip install vllm-router)"}}
    text = "\n".join(section(_result(cells), {}))
    assert "| cache-aware | 10 | 0 / 0 | 1,000 + 0 = 1,000 |" in text
    assert "| reuse-skip | 10 | 0 / 1 |" in text
    assert "not installed (pip install vllm-router)" in text
    assert mismatches(cells["reuse-skip"]) == 1


def test_a_share_of_conversations_streams_spread_evenly():
    from epd_proxy.bench.scenarios.multiturn.run import RecordingClient

    half = RecordingClient(None, stream_share=0.5)
    assert [half.streams(i) for i in range(6)] == [False, True, False, True, False, True]
    assert all(RecordingClient(None).streams(i) for i in range(5))
    assert not any(RecordingClient(None, stream=False).streams(i) for i in range(5))
    assert sum(RecordingClient(None, stream_share=0.25).streams(i) for i in range(100)) == 25
