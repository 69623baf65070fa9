"""Replicas agreeing on where a conversation's prefix lives, through the shared state store:
a turn placed off the rendezvous order is written, and the replica that routes the next turn
reads it back; measured over real sockets with two proxies taking turns, with a redis-server
and without."""

import asyncio

import pytest
from helpers import Client
from redis_server import SERVER, RedisServer

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.instances.load_signals import LoadSignals
from epd_proxy.placement.shared_homes import SharedHomes
from epd_proxy.routing.cache_aware import CacheAware
from epd_proxy.routing.view import RequestView, mix64
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig
from epd_proxy.state.guard import GuardedStore
from epd_proxy.state.memory import MemoryStore


class Inst:
    def __init__(self, url):
        self.url = url
        self.inflight = 0
        self.signals = LoadSignals()


class Pool:
    def __init__(self, policy, n=3):
        self.policy = policy
        self.instances = [Inst(f"http://10.0.0.{i}:8000") for i in range(n)]


def chat(conv: int, turns: int) -> dict:
    messages = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"conversation {conv}, question {t}: " + "why " * 30})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {t} to {conv}"})
    return {"model": "m", "messages": messages}


async def test_a_turn_placed_off_the_rendezvous_order_is_found_by_the_next_replica():
    store = GuardedStore(MemoryStore(), "t:", 1.0)
    a, b = Pool(CacheAware()), Pool(CacheAware())
    homes_a, homes_b = SharedHomes(store, {"prefill": a}), SharedHomes(store, {"prefill": b})
    moved = 0
    for conv in range(40):
        # Replica A opens the conversation while one instance is busy with A's own requests:
        # the opening goes to the least loaded, often off the rendezvous order's first.
        opening = RequestView(chat(conv, 1))
        busy = a.instances[conv % 3]
        busy.inflight = 5
        await homes_a.recall(opening)
        placed = a.policy.choose(a.instances, opening)
        busy.inflight = 0
        await asyncio.sleep(0.01)  # the write, in the background
        nxt = RequestView(chat(conv, 2))
        await homes_b.recall(nxt)
        assert b.policy.choose(b.instances, nxt).url == placed.url, conv
        top = max(a.instances, key=lambda c: mix64(opening.anchor ^ a.policy.seed(c.url)))
        moved += placed is not top
    assert moved > 0
    assert homes_a.published >= moved and homes_b.found >= moved
    assert homes_a.recalls == 0  # an opening never reads the store


async def test_a_conversation_on_one_replica_never_reads_the_store():
    store = GuardedStore(MemoryStore(), "t:", 1.0)
    pool = Pool(CacheAware())
    homes = SharedHomes(store, {"decode": pool})
    for conv in range(10):
        for turns in (1, 2, 3):
            view = RequestView(chat(conv, turns))
            await homes.recall(view)
            pool.policy.choose(pool.instances, view)
    assert homes.recalls == 0


async def _agreement(state_store: str | None) -> float:
    """Two proxies, twelve conversations of four turns at once, turn t of conversation c to
    proxy (c + t) mod 2: the share of later turns whose prefill is the previous turn's."""
    sim = SimConfig(itl_ms=2, ttft_ms=20)
    async with SimCluster(prefill=3, decode=1, config=sim) as cluster:
        config = config_for_cluster(cluster, ProxyConfig(probe_interval=0, scrape_interval=0,
                                                         state_store=state_store))
        async with await start_proxy(config) as one, await start_proxy(config) as two:
            clients = [Client(one.url), Client(two.url)]
            placed: dict[tuple[int, int], str] = {}
            prefills = cluster.instances("prefill")

            async def conversation(conv: int) -> None:
                messages: list[dict] = []
                for turn in range(4):
                    text = f"Conversation {conv} turn {turn}: " + " ".join(f"w{conv}x{turn}x{k}" for k in range(40))
                    messages = messages + [{"role": "user", "content": text}]
                    reply = await clients[(conv + turn) % 2].chat({"model": "sim-model", "messages": messages,
                                                                  "max_tokens": 8})
                    assert reply.status == 200, reply.body
                    placed[conv, turn] = next(p.url for p in prefills for r in p.generation_records()
                                              if r.json.get("messages") == messages)
                    messages = messages + [{"role": "assistant", "content": reply.text()}]
            try:
                await asyncio.gather(*(conversation(c) for c in range(12)))
                if state_store:  # what each proxy shared and found, on /metrics
                    for c in clients:
                        metrics = (await c.request("GET", "/metrics")).body
                        assert b'epd_proxy_shared_homes_total{event="published"}' in metrics
                    found = [p.app.pipeline.homes.found for p in (one, two)]
                    assert sum(found) > 0, found
                else:
                    assert one.app.pipeline.homes is None
            finally:
                for c in clients:
                    await c.close()
    later = [(c, t) for (c, t) in placed if t > 0]
    return sum(placed[c, t] == placed[c, t - 1] for c, t in later) / len(later)


@pytest.mark.skipif(SERVER is None, reason="no redis-server or valkey-server")
async def test_two_replicas_sharing_a_store_agree_on_where_the_prefix_lives():
    server = RedisServer()
    try:
        shared = await _agreement(server.url)
    finally:
        server.stop()
    alone = await _agreement(None)
    print(f"agreement: {shared:.3f} with the store, {alone:.3f} without")
    assert shared >= 0.95, (shared, alone)
