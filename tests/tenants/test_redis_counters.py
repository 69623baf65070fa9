"""The counters' contract, in-process and in a real redis-server; then two proxies sharing
one store hold one key to one limit, and a store that fails fails open (or closed)."""

import asyncio

import pytest
from helpers import Client, chat_body

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig
from epd_proxy.tenants.counters import LocalCounters, StoreUnavailable
from epd_proxy.tenants.limits import hits
from epd_proxy.tenants.redis_counters import RedisCounters, redis_client
from epd_proxy.tenants.table import KeyPolicy

SIM = SimConfig(itl_ms=0, ttft_ms=0.5)
POLICY = KeyPolicy("a", {"requests_per_minute": 3, "input_tokens_per_minute": 100, "output_tokens_per_minute": 10})


@pytest.fixture(params=["local", "redis"])
async def counters(request):
    if request.param == "local":
        yield LocalCounters()
        return
    server = request.getfixturevalue("redis_server")
    store = RedisCounters(redis_client(server.url, 1.0), 1.0)
    try:
        yield store
    finally:
        await store.close()


async def test_take_counts_all_or_nothing_and_add_settles(counters):
    now = 1_767_225_600.0
    first = hits(POLICY, "k", 40, now)
    assert await counters.take(first) == (True, [1, 40, 0])
    assert await counters.take(first) == (True, [2, 80, 0])
    assert await counters.take(first) == (False, [2, 80, 0])  # 120 input tokens: no room, nothing counted
    await counters.add([(first[1], -50), (first[2], 10)])  # settled: fewer input tokens, 10 output
    assert await counters.read(first) == [2, 30, 10]
    assert (await counters.take(hits(POLICY, "k", 10, now)))[0] is False  # output at its limit
    assert await counters.take(hits(POLICY, "k", 10, now + 60)) == (True, [1, 10, 0])  # the next minute
    assert (await counters.take(hits(POLICY, "other", 10, now)))[0] is True  # another key's counters


async def test_redis_keys_expire_with_their_window(redis_server):
    store = RedisCounters(redis_client(redis_server.url, 1.0), 1.0)
    try:
        hs = hits(KeyPolicy("a", {"requests_per_second": 5}), "k", 1, 1_767_225_600.0)
        await store.take(hs)
        ttl = await store.client.ttl(hs[0].key)
        assert 0 < ttl <= hs[0].ttl
    finally:
        await store.close()


async def test_an_unreachable_store_raises_store_unavailable():
    from procs import free_port
    store = RedisCounters(redis_client(f"redis://127.0.0.1:{free_port()}/0", 0.2), 0.2)
    with pytest.raises(StoreUnavailable):
        await store.take(hits(POLICY, "k", 1, 0.0))
    await store.close()


def _bearer(secret):
    return [(b"authorization", f"Bearer {secret}".encode())]


async def test_two_proxies_sharing_a_store_hold_a_key_to_one_limit(tmp_path, redis_server):
    keys = tmp_path / "keys"
    keys.write_text("team-a:secret-a\n")
    tenants = {"store": redis_server.url, "keys": [{"name": "team-a", "requests_per_minute": 5}]}
    async with SimCluster(decode=1, config=SIM) as cluster:
        config = config_for_cluster(cluster, ProxyConfig(probe_interval=0, scrape_interval=0, api_key_file=str(keys),
                                                         tenants=tenants))
        async with await start_proxy(config) as one, await start_proxy(config) as two:
            clients = [Client(one.url), Client(two.url)]
            try:
                statuses = []
                for i in range(12):
                    statuses.append((await clients[i % 2].chat(chat_body(), _bearer("secret-a"))).status)
                assert statuses.count(200) == 5 and statuses.count(429) == 7
                status = await one.app.pipeline.tenants.status()
                assert status["store"] == "shared"
                assert status["keys"]["team-a"]["limits"]["requests_per_minute"]["used"] == 5
            finally:
                for c in clients:
                    await c.close()


async def test_a_store_that_fails_fails_open_by_default_and_closed_when_asked(tmp_path, redis_server):
    keys = tmp_path / "keys"
    keys.write_text("team-a:secret-a\n")
    async with SimCluster(decode=1, config=SIM) as cluster:
        for mode, want in (("open", 200), ("closed", 503)):
            tenants = {"store": redis_server.url, "store_failure": mode, "store_timeout": 0.2,
                       "keys": [{"name": "team-a", "requests_per_minute": 100}]}
            config = config_for_cluster(cluster, ProxyConfig(probe_interval=0, scrape_interval=0,
                                                             api_key_file=str(keys), tenants=tenants))
            async with await start_proxy(config) as proxy:
                client = Client(proxy.url)
                try:
                    if mode == "open":
                        assert (await client.chat(chat_body(), _bearer("secret-a"))).status == 200
                        redis_server.stop()  # the store is gone: answers go on (closed: still gone)
                    t0 = asyncio.get_running_loop().time()
                    replies = [await client.chat(chat_body(), _bearer("secret-a")) for _ in range(5)]
                    assert [r.status for r in replies] == [want] * 5
                    assert asyncio.get_running_loop().time() - t0 < 2  # one timeout at most, then skipped
                    if want == 503:
                        assert replies[0].headers[b"retry-after"] == b"1"
                    assert proxy.app.pipeline.tenants.store_failures[mode] == 5
                finally:
                    await client.close()


async def test_the_workers_of_a_serve_process_share_the_store(tmp_path, redis_server):
    from proxy_process import ProxyProcess

    keys = tmp_path / "keys"
    keys.write_text("team-a:secret-a\n")
    async with SimCluster(decode=1, config=SIM) as cluster:
        path = tmp_path / "cluster.toml"
        path.write_text(f'probe_interval = 0\nworkers = 2\napi_key_file = "{keys}"\nadmin_api_key = "adm"\n'
                        f'decode = ["{cluster.instances("decode")[0].url}"]\n'
                        f'[tenants]\nstore = "{redis_server.url}"\n'
                        '[[tenants.keys]]\nname = "team-a"\nrequests_per_minute = 5\n')
        async with ProxyProcess(["--config", str(path)]) as proxy:
            statuses, pids = [], set()
            # A new connection each: the kernel spreads them over the workers. Until both workers
            # have answered (a loaded machine may hand one worker a long run), at least 12.
            while len(statuses) < 12 or (len(pids) < 2 and len(statuses) < 80):
                client = Client(proxy.url)
                try:
                    reply = await client.chat(chat_body(), _bearer("secret-a"))
                    statuses.append(reply.status)
                    pids.add((await client.request("GET", "/status", headers=[(b"x-api-key", b"adm")]))
                             .json()["pid"])
                finally:
                    await client.close()
            limited = len(statuses) - 5
            assert statuses.count(200) == 5 and statuses.count(429) == limited, statuses
            assert len(pids) == 2  # both workers answered, and the five admitted are the key's five in all
            metrics = (await proxy.fresh_get("/metrics", headers=[(b"x-api-key", b"adm")])).body.decode()
            assert 'epd_proxy_tenant_requests_total{key="team-a",result="admitted"} 5.0' in metrics
            assert f'result="limited_requests_per_minute"}} {float(limited)}' in metrics
