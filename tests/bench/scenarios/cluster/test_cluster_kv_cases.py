"""The KV events comparison's workloads (pure)."""

import pytest

from epd_proxy.bench.scenarios.cluster.kv_cases import DEFAULT_KV_CASES, KvCase, oracle_cases, parse_case, parse_cases


def test_a_case_is_its_words():
    assert parse_case("evict") == KvCase("evict")
    assert parse_case("roomy+r3") == KvCase("roomy+r3", evictions=False, replicas=3)
    assert parse_case("evict+direct", 0.25) == KvCase("evict+direct", direct=0.25)
    assert parse_case("evict+direct0.5+restart+r2") == KvCase("evict+direct0.5+restart+r2", direct=0.5,
                                                              restart=True, replicas=2)
    assert parse_case("roomy").plain and not parse_case("roomy+restart").plain and not parse_case("evict+direct").plain


@pytest.mark.parametrize("bad", ["", "evict+r0", "evict+rx", "evict+fast", "direct0", "direct9"])
def test_unknown_words_are_refused(bad):
    with pytest.raises(ValueError):
        parse_case(bad)


def test_the_oracle_runs_once_per_caches_population_and_restart():
    cases = parse_cases(list(DEFAULT_KV_CASES))
    of = oracle_cases(cases)
    assert of == {"evict": "evict", "evict+r2": "evict", "evict+r3": "evict", "roomy": "roomy",
                  "evict+direct": "evict+direct", "roomy+restart": "roomy+restart"}
    assert oracle_cases(parse_cases(["evict+r3", "evict"]))["evict"] == "evict+r3"
    with pytest.raises(ValueError):
        parse_cases(["evict", "evict"])
