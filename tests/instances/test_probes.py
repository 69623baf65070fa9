"""Active health checking (probes.py) against real simulated instances: a probe's verdict goes
to the host set, an answered probe reads what the instance serves, probes follow the roster."""

from helpers import probe_round

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.health import OutlierSettings
from epd_proxy.instances.pool import InstancePool
from epd_proxy.sim import SimCluster, SimConfig


async def test_a_failing_probe_ejects_and_an_answered_one_brings_it_back_with_its_models():
    async with SimCluster(prefill=0, decode=1, config=SimConfig(itl_ms=0)) as cluster:
        sim = cluster.all_instances()[0]
        pool = InstancePool("decode", [InstanceSpec(sim.url, "decode")], outlier=OutlierSettings(fail_threshold=1))
        inst = pool.instances[0]
        sim.set_health(False)
        await probe_round(pool, 2.0)
        assert inst.state == "ejected" and "HTTP 503" in inst.health.last_error
        sim.set_health(True)
        await probe_round(pool, 2.0)
        assert inst.healthy and inst.served is not None and inst.served.names  # /v1/models read after
        await pool.close()


async def test_probe_loops_follow_the_roster():
    pool = InstancePool("decode", [InstanceSpec("http://127.0.0.1:9", "decode")])
    pool.checks.start(60.0, 0.1)
    added = pool.add(InstanceSpec("http://127.0.0.1:10", "decode"))
    assert set(pool.checks.tasks) == {pool.instances[0], added}
    pool.remove(added)
    assert set(pool.checks.tasks) == {pool.instances[0]}
    await pool.close()
    assert pool.checks.tasks == {}
    await added.connections.close()
