"""The cluster scenario, end to end at a tiny size."""

import argparse

from epd_proxy.bench.conversations import make_conversations
from epd_proxy.bench.scenarios.cluster.evaluate import evaluate_targets
from epd_proxy.bench.scenarios.cluster.policies import parse_policies
from epd_proxy.bench.scenarios.cluster.run import chat_spec, run_cell
from epd_proxy.bench.scenarios.cluster.run import run as run_cluster
from epd_proxy.bench.scenarios.cluster.section import section


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

    out = await run_cluster(_args(tmp_path))
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
    spec = chat_spec(args, "text")
    convs, images = make_conversations(spec), image_pool(spec)
    ws = working_set(spec, convs, images, args.cluster_block_size)
    (pol,) = parse_policies(["least-loaded"])
    # At 16 req/s (seed 0) the fifth conversation, which triggers the restart, starts 0.5 s in:
    # time enough for the first ones' second turns to reach the second proxy first.
    cell = await run_cell(args, "text", spec, convs, images, ws, pol, 16.0, replicas=2, restart=True)
    assert cell["requests"] == 16 and cell["ok"] == 16 and cell["verify_errors"] == 0, cell["error_examples"]
    assert len(cell["restarts"]) == 1
    assert sum(cell["requests_per_proxy"]) == 16 and min(cell["requests_per_proxy"]) > 0
    assert cell["proxy_cpu_s"] >= 0  # clock ticks of 10 ms: a tiny run may measure none


async def test_a_policy_the_proxy_does_not_know_is_reported_not_available(tmp_path):
    from epd_proxy.bench.conversations import image_pool, working_set

    args = _args(tmp_path)
    spec = chat_spec(args, "text")
    convs, images = make_conversations(spec), image_pool(spec)
    ws = working_set(spec, convs, images, args.cluster_block_size)
    (pol,) = parse_policies(["bogus"], ["bogus=--no-such-flag x"])
    cell = await run_cell(args, "text", spec, convs, images, ws, pol, 40.0)
    assert cell["available"] is False and "failed to start" in cell["note"]
    # The report and the targets take it in their stride.
    out = {"candidate": "bogus", "workloads": {"text": {"working_set": ws, "spec": {}, "rates": [40.0],
                                                        "policies": {"bogus": {"rates": {"40.0": cell}}}}}}
    assert all(t["met"] is None for t in evaluate_targets(out, "bogus"))
    assert "failed to start" in "\n".join(section(out, {}))


async def test_tiny_kv_comparison(tmp_path):
    """The KV events comparison at a tiny size: the exact policy's proxies (two, turns alternating)
    route on the index; a direct population and a prefill's restart run beside the proxy's turns;
    the oracle runs once per population and restart, whatever the replicas."""
    from epd_proxy.bench import report

    args = _args(tmp_path, cluster_kv_cases=["evict", "evict+r2", "roomy+direct0.5+restart"],
                 cluster_kv_policies=["exact", "oracle"], cluster_workloads=[], cluster_restart_down_s=0.2,
                 cluster_system_words=80)  # prompts past --local-prefill-max-tokens: they go through a prefill
    out = await run_cluster(args)
    assert out["targets"] == out["kv"]["targets"]  # no matrix ran, only the comparison
    cases = out["kv"]["cases"]
    assert set(cases["evict"]["cells"]) == {"exact", "oracle"} and set(cases["evict+r2"]["cells"]) == {"exact"}
    assert cases["evict+r2"]["oracle_of"] == "evict"
    for name, entry in cases.items():
        for pol, cell in entry["cells"].items():
            assert "error" not in cell, (name, pol, cell)
            assert cell["ok"] == 12 and cell["unsent_turns"] == 0 and cell["verify_errors"] == 0, (name, pol, cell)
    ex = cases["evict+r2"]["cells"]["exact"]
    assert ex["replicas"] == 2 and sum(ex["requests_per_proxy"]) == 12 and min(ex["requests_per_proxy"]) > 0
    assert ex["proxy_kv_metrics"]['epd_proxy_routing_exact_total{role="prefill"}'] > 0  # routed on the index
    mixed = cases["roomy+direct0.5+restart"]["cells"]
    for cell in mixed.values():
        assert cell["direct"]["requests"] >= 6 and cell["direct"]["unsent_turns"] == 0
        assert len(cell["restarts"]) == 1
    keys = {t["key"] for t in out["targets"]}
    assert keys == {"kv_hit_rate", "kv_ttft_today", "kv_ttft_router", "kv_roomy_hit_rate", "kv_roomy_ttft", "kv_cpu"}
    res = {"meta": {"command": "test"}, "scenarios": {"cluster": out}}
    res["checks"] = report.checks(res)
    text = open(report.write(res, str(tmp_path), plots=False)["markdown"]).read()
    assert "#### roomy+direct0.5+restart" in text and "oracle: see evict" in text
