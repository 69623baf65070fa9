"""Multi-turn KV reuse is scoped to the client key (turn keys and conversation ids keyed with
the key's scope, tenants/key_scope.py): key B replaying key A's history neither takes A's kept
parameters nor evicts A's entry, and ``Server-Timing`` tells B nothing of A's conversations.
A simulated cluster with bidirectional transfer; locally and over a real redis-server."""

from __future__ import annotations

from helpers import stack
from redis_server import redis_server  # noqa: F401  (the fixture)
from test_multiturn import _next, _reads, _sim, _t1, _wrong
from test_shared_turns import _replicas, _turns, _until

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, expected_text

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
A = [(b"authorization", f"Bearer {KEY_A}".encode())]
B = [(b"authorization", f"Bearer {KEY_B}".encode())]


async def _turn(client, body: dict, key) -> str:
    """The turn answered (as the simulator's decode would alone), and its ``kv;desc``."""
    r = await client.chat(body, key)
    assert r.status == 200, r.body
    assert r.json()["kv_transfer_params"] is None and r.text() == expected_text(body)
    timing = r.headers[b"server-timing"].decode()
    return timing.split('kv;desc="')[1].split('"')[0] if 'kv;desc="' in timing else "-"


async def test_another_key_replaying_a_history_neither_takes_nor_evicts_it_and_learns_nothing():
    async with stack(sim=_sim(), local_prefill_max_tokens=0, api_keys=(KEY_A, KEY_B)) as (cluster, proxy, client):
        await _turn(client, _t1("warm up"), A)
        t1 = _t1("a's conversation")
        await _turn(client, t1, A)
        # B replays A's exact history: what B is told is what any unknown history is told.
        assert await _turn(client, _next(t1), B) == "not_held"
        assert await _turn(client, _next(_t1("nobody's conversation")), B) == "not_held"
        # A's next turn still reads its previous answer (B took nothing).
        assert await _turn(client, _next(t1), A) == "reused"
        assert len(_reads(cluster)) == 1 and _wrong(cluster) == 0
        # B opening with A's system prompt, first message and conversation_id supersedes nothing of A's.
        c1 = dict(_t1("a second conversation"), conversation_id="shared-id")
        await _turn(client, c1, A)
        await _turn(client, dict(c1), B)
        await _turn(client, dict(_t1("b's other"), conversation_id="shared-id"), B)
        assert await _turn(client, _next(c1, conversation_id="shared-id"), A) == "reused"
        assert len(_reads(cluster)) == 2 and _wrong(cluster) == 0
        assert proxy.app.pipeline.turns.released.get("superseded", 0) == 1  # B's own, by B's second


async def test_across_replicas_the_shared_store_keeps_each_keys_turns_apart(redis_server):  # noqa: F811
    async with SimCluster(prefill=1, decode=1, config=_sim()) as cluster:
        base = ProxyConfig(probe_interval=0, scrape_interval=0, local_prefill_max_tokens=0,
                           state_store=redis_server.url, state_store_prefix="k:", state_store_timeout=1.0,
                           api_keys=(KEY_A, KEY_B))
        async with await start_proxy(config_for_cluster(cluster, base)) as p1, \
                await start_proxy(config_for_cluster(cluster, base)) as p2:
            from helpers import Client
            c1, c2 = Client(p1.url), Client(p2.url)
            try:
                await _turn(c1, _t1("warm up"), A)
                await _until(lambda: _turns(p2).active)
                await _turn(c2, _t1("p2 serves the decode once"), B)
                t1 = _t1("a's conversation")
                await _turn(c1, t1, A)
                assert await _turn(c2, _next(t1), B) == "not_held"
                assert await _turn(c2, _next(t1), A) == "reused"
                assert len(_reads(cluster)) == 1 and _wrong(cluster) == 0
            finally:
                await c1.close()
                await c2.close()


async def test_without_keys_turn_keys_are_what_they_were():
    from epd_proxy.request.turns.multiturn import keep_key, lookup_key
    body = _next(_t1("any"))
    assert lookup_key(body) == lookup_key(body, None, b"")
    assert lookup_key(body, None, b"\x01" * 16)[:2] != lookup_key(body)[:2]
    assert keep_key(body, b"x", "conv")[1] != keep_key(body, b"x", "conv", b"\x01" * 16)[1]


__all__ = ["_replicas"]
