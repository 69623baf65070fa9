"""The cluster scenario's policies under test (pure)."""

import pytest

from epd_proxy.bench.scenarios.cluster.policies import candidate_policy, parse_policies


# -- policies -----------------------------------------------------------------------------------
def test_parse_policies():
    ps = parse_policies(["round-robin", "oracle", "prefix", "vllm-router:cache_aware"],
                          ["prefix=--prefill-policy prefix --decode-policy 'p2c'"])
    assert [p.kind for p in ps] == ["proxy", "oracle", "proxy", "vllm-router"]
    assert ps[0].args == ("--routing", "round-robin")
    assert ps[2].args == ("--prefill-policy", "prefix", "--decode-policy", "p2c")
    assert ps[3].args == ("cache_aware",) and ps[3].text_only and not ps[2].text_only
    with pytest.raises(ValueError, match="--policy-def"):
        parse_policies(["nope"])
    with pytest.raises(ValueError):
        parse_policies(["oracle", "oracle"])
    with pytest.raises(ValueError):
        parse_policies(["oracle"], ["no-equals-sign"])


def test_candidate_is_the_last_non_baseline_proxy_policy():
    ps = parse_policies(["round-robin", "least-loaded", "a", "oracle", "b"], ["a=--x", "b=--y"])
    assert candidate_policy(ps).name == "b"
    assert candidate_policy(ps, "a").name == "a"
    assert candidate_policy(ps[:2]).name == "least-loaded"
    with pytest.raises(ValueError):
        candidate_policy(ps, "oracle")


def test_exact_is_cache_aware_subscribed_to_the_kv_events():
    ca, ex = parse_policies(["cache-aware", "exact"])
    assert ex.kind == "proxy" and ex.kv_events and not ca.kv_events and ex.args == ca.args
