"""One leg's pick (placement/choose.py) over a role's host set: the policy among the instances in
rotation, the ones that failed the request avoided while others exist, a half-open one taken
when the healthy ones are excluded."""

from collections import Counter

from helpers import wait_for

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.health import OutlierSettings
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import choose


def make_pool(n, policy="least-loaded", threshold=3, **outlier):
    return InstancePool("decode", [InstanceSpec(f"http://127.0.0.1:{9000 + i}", "decode") for i in range(n)],
                        policy=policy, outlier=OutlierSettings(fail_threshold=threshold, **outlier))


async def test_idle_least_loaded_rotates_evenly():
    pool = make_pool(3)
    hits = Counter(choose(pool).url for _ in range(30))
    assert sorted(hits.values()) == [10, 10, 10]


async def test_least_loaded_prefers_fewest_inflight():
    pool = make_pool(3)
    a, b, c = pool.instances
    a.inflight, b.inflight, c.inflight = 5, 1, 3
    assert {choose(pool) for _ in range(5)} == {b}


async def test_round_robin_order():
    pool = make_pool(3, policy="round-robin")
    assert [choose(pool) for _ in range(6)] == pool.instances * 2


async def test_excluded_instances_are_avoided_while_others_exist():
    pool = make_pool(2)
    a, b = pool.instances
    assert {choose(pool, exclude={a}) for _ in range(4)} == {b}
    # With every instance excluded, a healthy one is still better than nothing.
    assert choose(pool, exclude={a, b}) in (a, b)


async def test_excluded_healthy_instances_give_way_to_a_half_open_one():
    pool = make_pool(2, threshold=1, ejection_time=0.01)
    a, b = pool.instances
    pool.outliers.record_failure(a, "reset")
    await wait_for(lambda: a.state == "half-open")
    assert choose(pool, exclude={b}) is a
