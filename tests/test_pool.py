from collections import Counter

import pytest

from epd_proxy.config import InstanceSpec
from epd_proxy.errors import ProxyError
from epd_proxy.pool import InstancePool, LeastLoaded, RoundRobin


def make_pool(n, policy="least-loaded", threshold=3):
    return InstancePool("decode", [InstanceSpec(f"http://127.0.0.1:{9000 + i}", "decode") for i in range(n)],
                        policy=policy, fail_threshold=threshold)


async def test_idle_least_loaded_rotates_evenly():
    pool = make_pool(3)
    hits = Counter(pool.choose().url for _ in range(30))
    assert sorted(hits.values()) == [10, 10, 10]


async def test_least_loaded_prefers_fewest_inflight():
    pool = make_pool(3)
    a, b, c = pool.instances
    a.inflight, b.inflight, c.inflight = 5, 1, 3
    assert {pool.choose() for _ in range(5)} == {b}


async def test_round_robin_order():
    pool = make_pool(3, policy="round-robin")
    assert [pool.choose() for _ in range(6)] == pool.instances * 2


async def test_excluded_instances_are_avoided_while_others_exist():
    pool = make_pool(2)
    a, b = pool.instances
    assert {pool.choose(exclude={a}) for _ in range(4)} == {b}
    # With every instance excluded, a healthy one is still better than nothing.
    assert pool.choose(exclude={a, b}) in (a, b)


async def test_failures_take_an_instance_out_and_one_success_brings_it_back():
    pool = make_pool(2, threshold=2)
    a, b = pool.instances
    pool.record_failure(a, "boom")
    assert a.healthy
    pool.record_failure(a, "boom")
    assert not a.healthy
    assert {pool.choose() for _ in range(4)} == {b}
    pool.record_success(a)
    assert a.healthy and a.failures == 0


async def test_no_healthy_instance_is_503():
    pool = make_pool(1, threshold=1)
    pool.record_failure(pool.instances[0], "down")
    with pytest.raises(ProxyError) as err:
        pool.choose()
    assert err.value.status == 503
    await pool.close()


def test_policies_are_deterministic_units():
    class I:
        def __init__(self, n):
            self.inflight = n
    xs = [I(0), I(0)]
    rr, ll = RoundRobin(), LeastLoaded()
    assert [rr.choose(xs) for _ in range(3)] == [xs[0], xs[1], xs[0]]
    assert [ll.choose(xs) for _ in range(2)] == [xs[0], xs[1]]
