"""The cluster scenario's counters, repeat merges and targets (pure)."""

import math

import pytest

from epd_proxy.bench.scenarios.cluster.evaluate import cluster_counters, evaluate_targets, merge_repeats


# -- counters -----------------------------------------------------------------------------------
def _state(requests, pc=None, ec=None):
    return {"stats": {"requests": requests}, "prefix_cache": pc, "encoder_cache": ec}


def test_cluster_counters_are_differences_between_snapshots():
    before = {"encode": [_state(1, ec={"queries": 2, "hits": 1})],
              "prefill": [_state(0, {"queries": 10, "hits": 0}), _state(0, {"queries": 0, "hits": 0})],
              "decode": [_state(0), _state(0)]}
    after = {"encode": [_state(5, ec={"queries": 6, "hits": 4})],
             "prefill": [_state(6, {"queries": 610, "hits": 300}), _state(3, {"queries": 300, "hits": 100})],
             "decode": [_state(9), _state(0)]}
    c = cluster_counters(before, after)
    assert c["requests"] == {"encode": [4], "prefill": [6, 3], "decode": [9, 0]}
    assert c["spread"]["prefill"] == 2.0 and math.isinf(c["spread"]["decode"]) and c["spread"]["encode"] == 1.0
    assert c["prefix_queried_tokens"] == 900 and c["prefix_hit_tokens"] == 400
    assert c["prefill_tokens_computed"] == 500 and c["prefix_hit_rate"] == pytest.approx(400 / 900)
    assert c["encoder_queries"] == 4 and c["encoder_hit_rate"] == 0.75
    assert cluster_counters({}, {})["spread"]["prefill"] is None


# -- targets -------------------------------------------------------------------------------------
def _cell(hit=0.5, p50=10.0, p99=20.0, cpu=1.0, n=100, spread=(1.0, 1.0)):
    return {"prefix_hit_rate": hit, "ttft_ms": {"p50": p50, "p99": p99}, "proxy_cpu_s": cpu, "requests": n,
            "counters": {"spread": {"prefill": spread[0], "decode": spread[1]},
                         "requests": {"prefill": [], "decode": []}}}


def _result(cand: dict, oracle: dict, router: dict, ll: dict, unique: dict) -> dict:
    def pols(cells):
        return {"policies": {k: {"rates": {"8": v}} for k, v in cells.items()}}
    return {"workloads": {"text": pols({"cand": cand, "oracle": oracle, "vllm-router:cache_aware": router,
                                        "least-loaded": ll}),
                          "unique": pols({"cand": unique})}}


def test_targets_met():
    r = _result(_cell(hit=0.46, p50=9, p99=19, cpu=1.04), _cell(hit=0.5), _cell(p50=10, p99=20), _cell(cpu=1.0),
                _cell(spread=(1.2, 1.3)))
    t = {x["key"]: x for x in evaluate_targets(r, "cand")}
    assert t["cluster_hit_rate"]["measured"] == pytest.approx(0.92) and t["cluster_hit_rate"]["met"]
    assert t["cluster_ttft"]["measured"] == pytest.approx(0.95) and t["cluster_ttft"]["met"]
    assert t["cluster_spread"]["measured"] == 1.3 and t["cluster_spread"]["met"]
    assert t["cluster_cpu"]["measured"] == pytest.approx(1.04) and t["cluster_cpu"]["met"]


def test_targets_missed_and_unmeasured():
    r = _result(_cell(hit=0.40, p50=9, p99=21, cpu=1.2), _cell(hit=0.5), _cell(p50=10, p99=20), _cell(cpu=1.0),
                _cell(spread=(1.5, 1.0)))
    t = {x["key"]: x for x in evaluate_targets(r, "cand")}
    assert not t["cluster_hit_rate"]["met"] and not t["cluster_cpu"]["met"] and not t["cluster_spread"]["met"]
    assert not t["cluster_ttft"]["met"] and "p99" in t["cluster_ttft"]["note"]
    # No vllm-router cell and no oracle: nothing to compare with, neither met nor missed.
    del r["workloads"]["text"]["policies"]["vllm-router:cache_aware"]
    del r["workloads"]["text"]["policies"]["oracle"]
    t = {x["key"]: x for x in evaluate_targets(r, "cand")}
    assert t["cluster_ttft"]["met"] is None and t["cluster_hit_rate"]["met"] is None


def _run(p50, p99, hit_tokens, spread, cpu, queried=1000, requests=100):
    return {"ttft_ms": {"count": requests, "p50": p50, "p99": p99}, "e2e_ms": {"count": requests, "p50": 2 * p50,
            "p99": 2 * p99}, "requests": requests, "ok": requests, "errors": 0, "verify_errors": 0, "req_s": 10.0,
            "proxy_cpu_s": cpu, "prefix_hit_rate": hit_tokens / queried,
            "counters": {"requests": {"prefill": [spread, 1]}, "spread": {"prefill": float(spread), "decode": 1.0},
                         "prefix_queried_tokens": queried, "prefix_hit_tokens": hit_tokens,
                         "encoder_queries": 0, "encoder_hits": 0}}


def test_repeats_merge_to_medians_pooled_rates_and_the_worst_spread():
    cells = [_run(10, 40, 800, 1.1, 0.2), _run(12, 50, 700, 1.4, 0.3), _run(11, 44, 600, 1.2, 0.1),
             {"policy": "x", "rate": 8, "error": "RuntimeError: boom"}]
    m = merge_repeats(cells)
    assert m["ttft_ms"]["p50"] == 11 and m["ttft_ms"]["p99"] == 44 and m["ttft_ms"]["count"] == 300
    assert m["e2e_ms"]["p99"] == 88
    assert m["prefix_hit_rate"] == pytest.approx(2100 / 3000) and m["prefill_tokens_computed"] == 300
    assert m["counters"]["spread"]["prefill"] == 1.4 and m["counters"]["requests"]["prefill"] == [1.4, 1]
    assert m["requests"] == 300 and m["proxy_cpu_s"] == pytest.approx(0.6)
    assert m["proxy_cpu_ms_per_req"] == pytest.approx(2.0)
    assert [r["ttft_p99"] for r in m["repeats"]] == [40, 50, 44] and m["failed_repeats"] == 1
    one = _run(10, 40, 800, 1.1, 0.2)
    assert merge_repeats([one]) is one
