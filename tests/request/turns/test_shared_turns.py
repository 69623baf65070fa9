"""Multi-turn KV reuse across proxy replicas sharing one state store (a real redis-server):
turns alternate between two proxies over one simulated cluster with bidirectional transfer,
and every later turn reads the previous answer from decode; the store killed and restarted
mid-conversation costs reuse, never an answer, and reuse comes back by itself."""

from __future__ import annotations

import asyncio
import contextlib
import time

from helpers import Client
from redis_server import redis_server  # noqa: F401  (the fixture)
from test_multiturn import _next, _reads, _sim, _t1, _wrong

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig, expected_text

RESPONSES = "/v1/responses"


@contextlib.asynccontextmanager
async def _replicas(url: str, n: int = 2, decode: int = 1, sim=None):
    """``n`` proxies over one cluster, sharing the store at ``url``; yields (cluster, proxies, clients)."""
    async with SimCluster(prefill=1, decode=decode, config=sim or _sim()) as cluster:
        base = ProxyConfig(probe_interval=0, scrape_interval=0, local_prefill_max_tokens=0, state_store=url,
                           state_store_prefix="t:")
        proxies = [await start_proxy(config_for_cluster(cluster, base)) for _ in range(n)]
        clients = [Client(p.url) for p in proxies]
        try:
            yield cluster, proxies, clients
        finally:
            for c in clients:
                await c.close()
            for p in proxies:
                await p.close()


async def _chat(client: Client, body: dict) -> None:
    r = await client.chat(body)
    assert r.status == 200, r.body
    doc = r.json()
    assert doc["kv_transfer_params"] is None and doc["choices"][0].get("token_ids") is None
    assert r.text() == expected_text(body)


def _turns(proxy):
    return proxy.app.pipeline.turns


def _outcomes(*proxies) -> dict[str, int]:
    """Each turn's outcome, summed over the replicas (turns/outcomes.py)."""
    out: dict[str, int] = {}
    for proxy in proxies:
        for outcome, n in proxy.app.pipeline.reuse.counts.turns.items():
            out[outcome] = out.get(outcome, 0) + n
    return out


async def _until(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_turns_alternating_between_replicas_read_every_previous_answer(redis_server):  # noqa: F811
    async with _replicas(redis_server.url) as (cluster, (a, b), (ca, cb)):
        await _chat(ca, _t1("warm up"))  # A learns that decode keeps blocks ...
        await _until(lambda: _turns(b).active)  # ... and B learns it from the store
        convs = [_t1(f"conversation {i} opens") for i in range(3)]
        for turn in range(4):
            for i, body in enumerate(convs):
                await _chat((ca, cb)[(turn + i) % 2], body)
            convs = [_next(body) for body in convs]
        assert len(_reads(cluster)) == 3 * 3 and _wrong(cluster) == 0
        outcomes = _outcomes(a, b)
        assert outcomes == {"opening": 3, "reused": 9}, outcomes  # the warm-up came before reuse was on
        # An opening turn (a stream: nothing kept from it either) makes no call to the store.
        calls = a.app.state.calls
        opening = dict(_t1("a new conversation"), stream=True)
        r = await ca.chat(opening)
        assert r.status == 200 and r.text() == expected_text(opening)
        assert a.app.state.calls == calls
        status = (await ca.request("GET", "/status")).json()
        assert status["state_store"]["kind"] == "redis" and status["state_store"]["up"] is True
        # Two requests of one turn at once, one on each replica: one reads.
        b1 = _t1("raced")
        await _chat(ca, b1)
        reads = len(_reads(cluster))
        b2 = _next(b1)
        await asyncio.gather(_chat(ca, b2), _chat(cb, b2))
        assert len(_reads(cluster)) == reads + 1
        assert _outcomes(a, b).get("already_used", 0) == 1


async def test_the_store_lost_and_back_costs_reuse_never_an_answer(redis_server):  # noqa: F811
    async with _replicas(redis_server.url) as (cluster, (a, b), (ca, cb)):
        await _chat(ca, _t1("warm up"))
        await _until(lambda: _turns(b).active)
        # B serves the decode once: it knows the decode's address to check A's kept turns against.
        await _chat(cb, _t1("warm up on b"))
        b1 = _t1("before the loss")
        await _chat(ca, b1)
        b2 = _next(b1)
        await _chat(cb, b2)
        assert len(_reads(cluster)) == 1
        redis_server.stop()
        b3 = _next(b2)
        await _chat(ca, b3)  # kept by B in the store that is gone: the plain path, the same answer
        b4 = _next(b3)
        await _chat(cb, b4)
        assert len(_reads(cluster)) == 1
        metrics = (await ca.request("GET", "/metrics")).body
        assert b"epd_proxy_state_store_errors_total{op=" in metrics
        assert b'epd_proxy_state_store_up{store="redis"} 0' in metrics
        redis_server.start()  # back, empty
        await _until(lambda: a.app.state.up and b.app.state.up)
        c1 = _t1("after the return")
        await _chat(cb, c1)
        c2 = _next(c1)
        await _chat(ca, c2)
        c3 = _next(c2)
        await _chat(cb, c3)
        assert len(_reads(cluster)) == 3 and _wrong(cluster) == 0


async def test_a_responses_follow_up_on_another_replica_goes_to_the_owner(redis_server):  # noqa: F811
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, record_responses=True)
    async with _replicas(redis_server.url, decode=3, sim=sim) as (cluster, (a, b), (ca, cb)):
        first = await ca.post(RESPONSES, {"model": "sim-model", "input": "kept somewhere", "max_output_tokens": 7})
        assert first.status == 200, first.body
        rid = first.json()["id"]
        await a.app.pipeline.stored.owners.written()
        owner = next(i for i in cluster.instances("decode") if i.records and i.records[-1].path == RESPONSES)
        asked = {i.url: len(i.records) for i in cluster.instances("decode")}
        follow = await cb.post(RESPONSES, {"model": "sim-model", "input": "more", "max_output_tokens": 7,
                                           "previous_response_id": rid})
        assert follow.status == 200, follow.body
        assert owner.records[-1].json["previous_response_id"] == rid
        # B asked no other decode for the id: the store named the owner.
        assert all(len(i.records) == asked[i.url] for i in cluster.instances("decode") if i is not owner)


async def test_three_replicas_asking_for_an_unloaded_adapter_load_it_once_per_instance(redis_server):  # noqa: F811
    from helpers import chat_body
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, ttft_per_token_ms=0, allow_runtime_lora=True, lora_swap_ms=20.0)
    async with SimCluster(prefill=1, decode=1, config=sim) as cluster:
        base = ProxyConfig(probe_interval=0.1, scrape_interval=0, state_store=redis_server.url,
                           state_store_prefix="l:", lora_sources={"ondemand": "/ad/ondemand"})
        proxies = [await start_proxy(config_for_cluster(cluster, base)) for _ in range(3)]
        clients = [Client(p.url) for p in proxies]
        try:
            await _until(lambda: all(i.served is not None for p in proxies for pool in p.app.pools.values()
                                     for i in pool.instances))
            bodies = [chat_body(f"burst {i}", model="ondemand", max_tokens=4) for i in range(6)]
            replies = await asyncio.gather(*(clients[i % 3].chat(b) for i, b in enumerate(bodies)))
            for body, r in zip(bodies, replies):
                assert r.status == 200, r.body
                assert r.text() == expected_text(body, lora_path="/ad/ondemand")
            loads = [r for r in cluster.records() if r.path == "/v1/load_lora_adapter"]
            assert len(loads) == 2, [r.instance for r in loads]  # one per instance (prefill, decode), not six
        finally:
            for c in clients:
                await c.close()
            for p in proxies:
                await p.close()


async def test_held_tokens_are_counted_across_replicas_and_the_bound_lets_the_putters_oldest_go():
    from epd_proxy.request.turns.multiturn import Entry, TurnStore
    from epd_proxy.request.turns.shared_turns import SharedTurns
    from epd_proxy.state.guard import GuardedStore
    from epd_proxy.state.memory import MemoryStore
    store = GuardedStore(MemoryStore(), "h:", 1.0)
    a = SharedTurns(store, TurnStore(480, 15, 300))
    b = SharedTurns(store, TurnStore(480, 15, 300))
    released: list[Entry] = []
    now = time.monotonic()

    def entry(conv: bytes, tokens: int, decode: str = "http://d1") -> Entry:
        return Entry({"do_remote_decode": True, "remote_num_tokens": tokens}, decode, tokens, 10, now + 100, conv)

    assert await a.put(b"k1", entry(b"c1", 100), now, released.append)
    assert await b.put(b"k2", entry(b"c2", 100), now, released.append)
    assert await a.put(b"k3", entry(b"c3", 50, "http://d2"), now, released.append)
    await asyncio.sleep(0.05)  # the counters are written in the background
    assert await a.held("http://d1") == 200 and await b.held("http://d2") == 50
    # b takes a's turn: the count goes down wherever it was kept
    got, reason, _ = await b.take(b"k1", b"c1", now)
    assert got is not None and got.tokens == 100 and reason == ""
    await asyncio.sleep(0.05)
    assert await a.held("http://d1") == 100
    # a second take of it: used
    assert (await a.take(b"k1", b"c1", now))[1] == "used"
    # past the bound (300) on d1: the replica that crossed it lets its own oldest go
    assert await a.put(b"k4", entry(b"c4", 150), now, released.append)
    assert await a.put(b"k5", entry(b"c5", 150), now, released.append)
    await asyncio.sleep(0.05)
    assert [e.conversation for e in released] == [b"c4"] and a.turns.released == {"bound": 1}
    assert await a.held("http://d1") == 250  # b's 100 and a's newest 150
    # a conversation's next turn supersedes its previous one
    assert await b.put(b"k6", entry(b"c2", 20), now, released.append)
    await asyncio.sleep(0.05)
    assert released[-1].conversation == b"c2" and released[-1].tokens == 100
    await store.close()
