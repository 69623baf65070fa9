"""The event plane over real sockets: the simulator's KV events (vLLM's wire format) reach
the proxy's index; a gap is replayed; a restart clears; an eviction removes; an instance
that leaves is dropped."""

from __future__ import annotations

import asyncio

from tests.helpers import Client, wait_for

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.config import InstanceSpec
from epd_proxy.kvcache.feed import EventFeed
from epd_proxy.kvcache.index import BlockIndex
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig


def _prompt(seed: int, n: int = 100) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


async def _complete(url: str, prompt: list[int]) -> None:
    client = Client(url)
    try:
        reply = await client.post("/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 2})
        assert reply.status == 200, reply.body
    finally:
        await client.close()


async def _feed(cluster: SimCluster) -> EventFeed:
    feed = EventFeed(BlockIndex(), heartbeat=0.1, replay_timeout=0.5)
    feed.start(config_for_cluster(cluster).decode)
    await wait_for(lambda: feed.live() == frozenset(cluster.urls("pd")))
    return feed


async def test_events_reach_the_index_per_instance():
    async with SimCluster(pd=2, config=SimConfig(itl_ms=0, ttft_ms=0, kv_events=True)) as cluster:
        feed = await _feed(cluster)
        try:
            a, b = cluster.urls("pd")
            await _complete(a, _prompt(1))
            await _complete(b, _prompt(1)[:40])
            index = feed.index
            await wait_for(lambda: index.longest_prefix(_prompt(1)) == {a: 96, b: 32})
            assert feed.readers[a][0].received >= 1
        finally:
            await feed.close()


async def test_a_gap_is_replayed():
    async with SimCluster(pd=1, config=SimConfig(itl_ms=0, ttft_ms=0, kv_events=True)) as cluster:
        feed = await _feed(cluster)
        try:
            (url,) = cluster.urls("pd")
            inst = cluster.instances("pd")[0]
            await _complete(url, _prompt(1))
            await wait_for(lambda: feed.index.longest_prefix(_prompt(1)) == {url: 96})
            reader = feed.readers[url][0]
            reader.heartbeat = 60.0  # only the gap can bring the lost message back
            await asyncio.sleep(0.2)
            inst.kv_events.paused = True  # published and buffered, never sent live: lost
            await _complete(url, _prompt(2))
            inst.kv_events.paused = False
            await _complete(url, _prompt(3))
            await wait_for(lambda: feed.index.longest_prefix(_prompt(3)) == {url: 96})
            assert feed.index.longest_prefix(_prompt(2)) == {url: 96}
            assert reader.gaps == 1 and reader.lost == 0
        finally:
            await feed.close()


async def test_a_lost_tail_is_fetched_by_the_heartbeat():
    async with SimCluster(pd=1, config=SimConfig(itl_ms=0, ttft_ms=0, kv_events=True)) as cluster:
        feed = await _feed(cluster)
        try:
            (url,) = cluster.urls("pd")
            inst = cluster.instances("pd")[0]
            inst.kv_events.paused = True
            await _complete(url, _prompt(4))
            await wait_for(lambda: feed.index.longest_prefix(_prompt(4)) == {url: 96})
        finally:
            await feed.close()


async def test_a_restart_clears_the_instance():
    async with SimCluster(pd=1, config=SimConfig(itl_ms=0, ttft_ms=0, kv_events=True)) as cluster:
        feed = await _feed(cluster)
        try:
            (url,) = cluster.urls("pd")
            inst = cluster.instances("pd")[0]
            for seed in (1, 2, 3):
                await _complete(url, _prompt(seed))
            await wait_for(lambda: feed.index.longest_prefix(_prompt(3)) == {url: 96})
            await inst.crash()
            await wait_for(lambda: url not in feed.live())  # its replay socket stopped answering
            await inst.restart()
            await _complete(url, _prompt(5))
            await wait_for(lambda: feed.index.longest_prefix(_prompt(5)) == {url: 96})
            assert feed.index.longest_prefix(_prompt(1)) == {}
            assert feed.readers[url][0].restarts == 1
            assert url in feed.live()
        finally:
            await feed.close()


async def test_a_restart_the_live_socket_hides_is_found_before_its_events_are_applied():
    """The new engine's first messages never arrived live (a subscriber reconnecting late) and
    its sequence has passed the old engine's before the heartbeat ran: the stream was found
    down meanwhile, so the first live message waits for the replay socket to say whether it
    is the same engine. Otherwise the old engine's blocks would stay, as if still held."""
    async with SimCluster(pd=1, config=SimConfig(itl_ms=0, ttft_ms=0, kv_events=True)) as cluster:
        feed = await _feed(cluster)
        try:
            (url,) = cluster.urls("pd")
            inst = cluster.instances("pd")[0]
            reader = feed.readers[url][0]
            for seed in (1, 2):
                await _complete(url, _prompt(seed))
            await wait_for(lambda: feed.index.longest_prefix(_prompt(2)) == {url: 96})
            old = reader.tracker.expected
            assert old
            await inst.crash()
            await wait_for(lambda: url not in feed.live())
            reader.heartbeat = 60.0  # no heartbeat comes to the rescue
            await asyncio.sleep(1.0)  # the replay request in flight times out
            inst.kv_events.paused = True
            await inst.restart()
            seed = 10
            while inst.kv_events.published < old:  # the new engine's messages up to the old count, lost live
                await _complete(url, _prompt(seed))
                seed += 1
            await asyncio.sleep(0.5)  # the subscriber reconnected
            inst.kv_events.paused = False
            await _complete(url, _prompt(seed))
            await wait_for(lambda: feed.index.longest_prefix(_prompt(seed)) == {url: 96})
            assert feed.index.longest_prefix(_prompt(1)) == {}
            assert reader.restarts == 1
            assert feed.index.longest_prefix(_prompt(10)) == {url: 96}  # replayed from the new engine
        finally:
            await feed.close()


async def test_evictions_and_leaving():
    config = SimConfig(itl_ms=0, ttft_ms=0, kv_events=True, prefix_cache_blocks=8)
    async with SimCluster(pd=1, config=config) as cluster:
        feed = await _feed(cluster)
        try:
            (url,) = cluster.urls("pd")
            await _complete(url, _prompt(1))
            await wait_for(lambda: feed.index.longest_prefix(_prompt(1)) == {url: 96})
            await _complete(url, _prompt(2))  # 6 new blocks: the first prompt's last 4 evicted
            await wait_for(lambda: feed.index.longest_prefix(_prompt(2)) == {url: 96})
            assert feed.index.longest_prefix(_prompt(1)) == {url: 32}
            assert feed.index.blocks_of(url) == 8
            feed.forget(url)
            assert feed.index.longest_prefix(_prompt(2)) == {} and not feed.readers
        finally:
            await feed.close()


async def test_the_feed_follows_the_roster():
    """An instance registered with its event sockets is subscribed; one that leaves is dropped."""
    config = SimConfig(itl_ms=0, ttft_ms=0, kv_events=True)
    async with SimCluster(prefill=1, decode=1, config=config) as cluster, \
            SimCluster(prefill=1, config=config) as extra:
        base = ProxyConfig(probe_interval=0, scrape_interval=0)
        async with await start_proxy(config_for_cluster(cluster, base)) as proxy:
            feed = proxy.app.kv_events
            await wait_for(lambda: len(feed.live()) == 2)
            ident = extra.prefill_identities()[0]
            spec = InstanceSpec(ident["url"], "prefill", engine_id=ident["engine_id"], kv_host=ident["kv_host"],
                                kv_port=ident["kv_port"], kv_events=ident["kv_events"],
                                kv_events_replay=ident["kv_events_replay"])
            proxy.app.membership.register(spec)
            await wait_for(lambda: spec.url in feed.live())
            proxy.app.membership.unregister(spec.url)
            await wait_for(lambda: spec.url not in feed.readers)
            assert len(feed.live()) == 2
