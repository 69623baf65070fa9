"""The host set (instances/pool.py): the lists a pick reads, panic routing, membership, /status."""

import pytest

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.health import OutlierSettings
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import choose
from epd_proxy.routing.policies import LeastLoaded, RoundRobin
from epd_proxy.wire.errors import ProxyError


def make_pool(n, policy="least-loaded", threshold=3, **outlier):
    return InstancePool("decode", [InstanceSpec(f"http://127.0.0.1:{9000 + i}", "decode") for i in range(n)],
                        policy=policy, outlier=OutlierSettings(fail_threshold=threshold, **outlier))


async def test_with_every_instance_out_requests_route_over_all_of_them():
    pool = make_pool(2, threshold=1)
    a, b = pool.instances
    pool.outliers.probe_failed(a, "timeout", "probe")
    pool.outliers.probe_failed(b, "timeout", "probe")
    assert a.state == b.state == "ejected"
    assert {choose(pool) for _ in range(4)} == {a, b}  # panic routing, never nothing
    assert choose(pool, exclude={a}) is b
    assert pool.panics == 5
    assert not pool.reachable()
    pool.outliers.record_success(a)  # a probe ejection ends with any answer
    assert choose(pool) is a and pool.reachable() and not pool.reachable({a})
    await pool.close()


async def test_snapshot_shows_state_and_errors_by_kind():
    pool = make_pool(2, threshold=1)
    a = pool.instances[0]
    pool.outliers.record_failure(a, "no headers", kind="timeout")
    pool.outliers.record_request_failure(a, "HTTP 500")
    snap = pool.snapshot()[0]
    assert snap["state"] == "ejected" and snap["ejections"] == 1 and snap["consecutive_failures"] == 1
    assert snap["errors"] == {"timeout": 1, "http_500": 1}
    assert snap["ejected_until"] is not None
    assert {"inflight", "requests", "url", "last_error"} <= set(snap)
    assert pool.snapshot()[1]["ejected_until"] is None
    await pool.close()


def test_policies_are_deterministic_units():
    class Inst:
        def __init__(self, n):
            self.inflight = n
            self.requests = 0
    xs = [Inst(0), Inst(0)]
    rr, ll = RoundRobin(), LeastLoaded()
    assert [rr.choose(xs) for _ in range(3)] == [xs[0], xs[1], xs[0]]
    assert [ll.choose(xs) for _ in range(2)] == [xs[0], xs[1]]


async def test_a_draining_instance_gets_no_new_requests():
    pool = make_pool(2)
    a, b = pool.instances
    pool.outliers.drain(a)
    assert a.state == "draining" and not a.healthy
    assert {choose(pool) for _ in range(4)} == {b}
    pool.outliers.probe_failed(b, "timeout", "probe")
    pool.outliers.probe_failed(b, "timeout", "probe")
    pool.outliers.probe_failed(b, "timeout", "probe")
    assert b.state == "ejected"
    assert {choose(pool) for _ in range(4)} == {b}  # panic routing leaves draining ones out
    await pool.close()


async def test_added_instances_get_the_same_connection_cap_and_probes():
    from epd_proxy.config import InstanceSpec

    pool = InstancePool("decode", [InstanceSpec("http://127.0.0.1:9", "decode")], max_connections=7)
    pool.checks.start(60.0, 0.1)
    added = pool.add(InstanceSpec("http://127.0.0.1:10", "decode"))
    assert added.connections.max_connections == pool.instances[0].connections.max_connections == 7
    assert set(pool.checks.tasks) == set(pool.instances)
    pool.remove(added)
    assert added not in pool.instances and set(pool.checks.tasks) == set(pool.instances)
    await pool.close()
    await added.connections.close()


async def test_the_last_instance_draining_is_not_routed_to_in_panic():
    pool = make_pool(1)
    pool.outliers.drain(pool.instances[0])
    with pytest.raises(ProxyError) as exc:
        choose(pool)
    assert exc.value.status == 503
    await pool.close()
