"""The cluster scenario: policy specs, the instances' counters, the targets (pure), the
conversation driver against a real simulator, and a tiny real run of the scenario."""

import argparse
import math

import pytest

from epd_proxy.bench import cluster as C
from epd_proxy.bench.conversations import ChatSpec, make_conversations
from epd_proxy.bench.targets import SimInfo
from epd_proxy.sim import SimCluster, SimConfig, expected_text


# -- policies -----------------------------------------------------------------------------------
def test_parse_policies():
    ps = C.parse_policies(["round-robin", "oracle", "prefix", "vllm-router:cache_aware"],
                          ["prefix=--prefill-policy prefix --decode-policy 'p2c'"])
    assert [p.kind for p in ps] == ["proxy", "oracle", "proxy", "vllm-router"]
    assert ps[0].args == ("--routing", "round-robin")
    assert ps[2].args == ("--prefill-policy", "prefix", "--decode-policy", "p2c")
    assert ps[3].args == ("cache_aware",) and ps[3].text_only and not ps[2].text_only
    with pytest.raises(ValueError, match="--policy-def"):
        C.parse_policies(["nope"])
    with pytest.raises(ValueError):
        C.parse_policies(["oracle", "oracle"])
    with pytest.raises(ValueError):
        C.parse_policies(["oracle"], ["no-equals-sign"])


def test_candidate_is_the_last_non_baseline_proxy_policy():
    ps = C.parse_policies(["round-robin", "least-loaded", "a", "oracle", "b"], ["a=--x", "b=--y"])
    assert C.candidate_policy(ps).name == "b"
    assert C.candidate_policy(ps, "a").name == "a"
    assert C.candidate_policy(ps[:2]).name == "least-loaded"
    with pytest.raises(ValueError):
        C.candidate_policy(ps, "oracle")


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
    c = C.cluster_counters(before, after)
    assert c["requests"] == {"encode": [4], "prefill": [6, 3], "decode": [9, 0]}
    assert c["spread"]["prefill"] == 2.0 and math.isinf(c["spread"]["decode"]) and c["spread"]["encode"] == 1.0
    assert c["prefix_queried_tokens"] == 900 and c["prefix_hit_tokens"] == 400
    assert c["prefill_tokens_computed"] == 500 and c["prefix_hit_rate"] == pytest.approx(400 / 900)
    assert c["encoder_queries"] == 4 and c["encoder_hit_rate"] == 0.75
    assert C.cluster_counters({}, {})["spread"]["prefill"] is None


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
    t = {x["key"]: x for x in C.evaluate_targets(r, "cand")}
    assert t["cluster_hit_rate"]["measured"] == pytest.approx(0.92) and t["cluster_hit_rate"]["met"]
    assert t["cluster_ttft"]["measured"] == pytest.approx(0.95) and t["cluster_ttft"]["met"]
    assert t["cluster_spread"]["measured"] == 1.3 and t["cluster_spread"]["met"]
    assert t["cluster_cpu"]["measured"] == pytest.approx(1.04) and t["cluster_cpu"]["met"]


def test_targets_missed_and_unmeasured():
    r = _result(_cell(hit=0.40, p50=9, p99=21, cpu=1.2), _cell(hit=0.5), _cell(p50=10, p99=20), _cell(cpu=1.0),
                _cell(spread=(1.5, 1.0)))
    t = {x["key"]: x for x in C.evaluate_targets(r, "cand")}
    assert not t["cluster_hit_rate"]["met"] and not t["cluster_cpu"]["met"] and not t["cluster_spread"]["met"]
    assert not t["cluster_ttft"]["met"] and "p99" in t["cluster_ttft"]["note"]
    # No vllm-router cell and no oracle: nothing to compare with, neither met nor missed.
    del r["workloads"]["text"]["policies"]["vllm-router:cache_aware"]
    del r["workloads"]["text"]["policies"]["oracle"]
    t = {x["key"]: x for x in C.evaluate_targets(r, "cand")}
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
    m = C.merge_repeats(cells)
    assert m["ttft_ms"]["p50"] == 11 and m["ttft_ms"]["p99"] == 44 and m["ttft_ms"]["count"] == 300
    assert m["e2e_ms"]["p99"] == 88
    assert m["prefix_hit_rate"] == pytest.approx(2100 / 3000) and m["prefill_tokens_computed"] == 300
    assert m["counters"]["spread"]["prefill"] == 1.4 and m["counters"]["requests"]["prefill"] == [1.4, 1]
    assert m["requests"] == 300 and m["proxy_cpu_s"] == pytest.approx(0.6)
    assert m["proxy_cpu_ms_per_req"] == pytest.approx(2.0)
    assert [r["ttft_p99"] for r in m["repeats"]] == [40, 50, 44] and m["failed_repeats"] == 1
    one = _run(10, 40, 800, 1.1, 0.2)
    assert C.merge_repeats([one]) is one


# -- the driver, against a real simulator ------------------------------------------------------------
async def test_each_turn_carries_the_answer_received_and_a_failure_ends_its_conversation():
    spec = ChatSpec(conversations=3, turns=3, system_prompts=1, system_words=20, user_words=5, max_tokens=6,
                    image_share=0.0, think_s=0.0, seed=3)
    convs = make_conversations(spec)
    async with SimCluster(prefill=2, decode=2, config=SimConfig(itl_ms=0.5, record_responses=False)) as cl:
        sim = SimInfo(encode=[], prefill=cl.urls("prefill"), decode=cl.urls("decode"))
        client = C.OracleClient(sim)
        await client.start()
        try:
            before = await C.instance_states(sim)
            # Conversation 1 is pinned to the second prefill: its first turn fails there, and the
            # conversation stops (its next prompt would need that answer).
            cl.instances("prefill")[1].inject("status=503", times=1)
            tally = await C.drive(spec, convs, [], 50.0, client)
            after = await C.instance_states(sim)
        finally:
            await client.close()
        s = tally.summary()
        assert s["requests"] == 7 and s["ok"] == 6 and s["errors"] == 1 and s["unsent_turns"] == 2
        assert s["verify_errors"] == 0 and 1 <= s["max_live_conversations"] <= 3
        # What the decodes received: each later turn holds the earlier answers, as the simulator gave them.
        bodies = [r.json for r in cl.records("decode") if r.path == "/v1/chat/completions"]
        by_conv: dict = {}
        for b in bodies:
            cid = b["messages"][1]["content"].split("/")[0].strip("[")
            by_conv.setdefault(cid, []).append(b)
        full = [v for v in by_conv.values() if len(v) == 3]
        assert len(full) == 2
        for turns in full:
            turns.sort(key=lambda b: len(b["messages"]))
            for t in (1, 2):
                prev = {k: v for k, v in turns[t - 1].items() if k != "kv_transfer_params"}
                assert turns[t]["messages"][2 * t]["content"] == expected_text(prev)
        c = C.cluster_counters(before, after)
        # Pinned: conversations 0 and 2 on prefill 0, conversation 1 on prefill 1.
        assert c["requests"]["prefill"] == [6, 1]
        assert c["prefix_hit_rate"] > 0  # the shared system prompt and each conversation's history


# -- a tiny real run --------------------------------------------------------------------------------
def _args(tmp_path, **over) -> argparse.Namespace:
    from epd_proxy.bench.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--scenario", "cluster", "--no-pin", "--itl-ms", "0.5", "--policies", "least-loaded,oracle",
                      "--cluster-workloads", "text", "--cluster-rates", "40", "--cluster-conversations", "6",
                      "--cluster-turns", "2", "--cluster-think-s", "0", "--cluster-system-words", "40",
                      "--cluster-user-words", "8", "--cluster-max-tokens", "6", "--cluster-encoders", "0",
                      "--cluster-prefills", "2", "--cluster-decoders", "2", "--no-cluster-replicas", "--no-progress",
                      # room for everything: the hits below are then certain, whatever the order of arrivals
                      "--cluster-cache-ratio", "1"])
    a.log_dir = str(tmp_path)
    for k, v in over.items():
        setattr(a, k, v)
    return a


async def test_tiny_cluster_run(tmp_path):
    from epd_proxy.bench import report

    out = await C.run_cluster(_args(tmp_path))
    w = out["workloads"]["text"]
    assert w["working_set"]["requests"] == 12
    assert w["cache_ratio"] == 1 and w["prefix_cache_blocks_per_instance"] == w["working_set"]["blocks"]
    for pol in ("least-loaded", "oracle"):
        cell = w["policies"][pol]["rates"]["40.0"]
        assert "error" not in cell, cell
        assert cell["requests"] == 12 and cell["ok"] == 12 and cell["verify_errors"] == 0, cell["error_examples"]
        assert sum(cell["counters"]["requests"]["prefill"]) == 12
        assert sum(cell["counters"]["requests"]["decode"]) == 12
        assert cell["prefill_tokens_computed"] > 0 and cell["prefix_hit_rate"] > 0
    assert w["policies"]["least-loaded"]["rates"]["40.0"]["proxy_cpu_ms_per_req"] >= 0
    assert w["policies"]["oracle"]["rates"]["40.0"]["proxy_cpu_ms_per_req"] is None
    keys = {t["key"] for t in out["targets"]}
    assert keys == {"cluster_hit_rate", "cluster_ttft", "cluster_spread", "cluster_cpu"}
    res = {"meta": {"command": "test"}, "scenarios": {"cluster": out}}
    res["checks"] = report.checks(res)
    paths = report.write(res, str(tmp_path), plots=False)
    text = open(paths["markdown"]).read()
    assert "## Routing on a simulated cluster" in text and "| oracle | 40.0 |" in text
    assert [c for c in res["checks"] if c["key"] == "verify"][0]["measured"] == 0


async def test_two_replicas_one_restarted(tmp_path):
    """Turns alternate between two proxies; the second is restarted mid-run (taken out of
    rotation first), and no request fails."""
    from epd_proxy.bench.conversations import image_pool, working_set

    args = _args(tmp_path, cluster_conversations=8)
    spec = C.chat_spec(args, "text")
    convs, images = make_conversations(spec), image_pool(spec)
    ws = working_set(spec, convs, images, args.cluster_block_size)
    (pol,) = C.parse_policies(["least-loaded"])
    # At 16 req/s (seed 0) the fifth conversation, which triggers the restart, starts 0.5 s in:
    # time enough for the first ones' second turns to reach the second proxy first.
    cell = await C.run_cell(args, "text", spec, convs, images, ws, pol, 16.0, replicas=2, restart=True)
    assert cell["requests"] == 16 and cell["ok"] == 16 and cell["verify_errors"] == 0, cell["error_examples"]
    assert len(cell["restarts"]) == 1
    assert sum(cell["requests_per_proxy"]) == 16 and min(cell["requests_per_proxy"]) > 0
    assert cell["proxy_cpu_s"] >= 0  # clock ticks of 10 ms: a tiny run may measure none


async def test_a_policy_the_proxy_does_not_know_is_reported_not_available(tmp_path):
    from epd_proxy.bench import report
    from epd_proxy.bench.conversations import image_pool, working_set

    args = _args(tmp_path)
    spec = C.chat_spec(args, "text")
    convs, images = make_conversations(spec), image_pool(spec)
    ws = working_set(spec, convs, images, args.cluster_block_size)
    (pol,) = C.parse_policies(["bogus"], ["bogus=--no-such-flag x"])
    cell = await C.run_cell(args, "text", spec, convs, images, ws, pol, 40.0)
    assert cell["available"] is False and "failed to start" in cell["note"]
    # The report and the targets take it in their stride.
    out = {"candidate": "bogus", "workloads": {"text": {"working_set": ws, "spec": {}, "rates": [40.0],
                                                        "policies": {"bogus": {"rates": {"40.0": cell}}}}}}
    assert all(t["met"] is None for t in C.evaluate_targets(out, "bogus"))
    assert "failed to start" in "\n".join(report._cluster_section(out, {}))
