"""Outlier detection (instances/outliers.py): what requests and probes say of an instance,
over the pure health machine, and the ejection and re-admission timers."""

from helpers import wait_for

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.health import OutlierSettings
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import HALF_OPEN_SHARE, choose


def make_pool(n, threshold=3, **outlier):
    return InstancePool("decode", [InstanceSpec(f"http://127.0.0.1:{9000 + i}", "decode") for i in range(n)],
                        outlier=OutlierSettings(fail_threshold=threshold, **outlier))


async def test_failures_take_an_instance_out_and_it_comes_back_half_open():
    pool = make_pool(2, threshold=2, ejection_time=0.05)
    a, b = pool.instances
    pool.outliers.record_failure(a, "boom")
    assert a.healthy
    pool.outliers.record_failure(a, "boom")
    assert a.state == "ejected"
    assert {choose(pool) for _ in range(4)} == {b}
    pool.outliers.record_success(a)  # a passive ejection runs its time
    assert a.state == "ejected"
    await wait_for(lambda: a.state == "half-open")  # by itself: no probe, no traffic needed
    picks = [choose(pool) for _ in range(10)]
    assert 1 <= picks.count(a) <= 10 // HALF_OPEN_SHARE  # a limited share of live traffic
    pool.outliers.record_success(a)
    assert a.healthy and a.failures == 0
    await pool.close()


async def test_a_roles_only_instance_is_never_ejected_by_requests():
    pool = make_pool(1, threshold=1)
    for _ in range(5):
        pool.outliers.record_failure(pool.instances[0], "refused")
    assert pool.instances[0].healthy


async def test_blame_counts_once_per_client_request():
    from epd_proxy.request.context import RequestContext
    pool = make_pool(2, threshold=2)
    a = pool.instances[0]
    ctx = RequestContext("r1", "/v1/chat/completions", [])
    for _ in range(3):
        pool.outliers.record_failure(a, "reset", ctx=ctx)
    assert a.failures == 1 and a.healthy and a in ctx.excluded
    assert a.errors == 3 and a.health.errors == {"connection": 3}
    pool.outliers.record_failure(a, "reset", ctx=RequestContext("r2", "/v1/chat/completions", []))
    assert a.state == "ejected"


async def test_an_instance_leaving_the_host_set_takes_its_ejection_timer_with_it():
    pool = make_pool(2, threshold=1, ejection_time=30.0)
    a = pool.instances[0]
    pool.outliers.record_failure(a, "refused", kind="connection")
    assert a.state == "ejected" and a.expiry is not None
    pool.remove(a)
    assert a.expiry is None and a not in pool.instances
    await pool.close()
    await a.connections.close()


async def test_a_drained_instance_is_never_readmitted_by_its_timer():
    pool = make_pool(2, threshold=1, ejection_time=0.01)
    a = pool.instances[0]
    pool.outliers.record_failure(a, "refused")
    assert a.expiry is not None
    pool.outliers.drain(a)
    assert a.state == "draining" and a.expiry is None
    pool.outliers.record_success(a)
    assert a.state == "draining" and a not in pool.every
    await pool.close()


async def test_the_proxys_own_shortage_is_counted_apart_from_every_instance():
    pool = make_pool(1)
    pool.outliers.record_local_error()
    assert pool.outliers.local_errors == 1 and pool.instances[0].errors == 0 and pool.instances[0].healthy
