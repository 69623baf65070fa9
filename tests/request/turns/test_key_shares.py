"""Per-key share of the held-tokens bound (``--kv-reuse-max-held-tokens``): past it, the turns
let go are the oldest of the client key holding the most on that decode, so one key keeping
turn after turn cannot push out every other key's. In one process (TurnStore) and across
replicas over a real redis-server (SharedTurns: each replica lets its own go, by the same rule)."""

from __future__ import annotations

import asyncio
import time

from redis_server import redis_server  # noqa: F401  (the fixture)

from epd_proxy.request.turns.multiturn import Entry, TurnStore
from epd_proxy.request.turns.shared_turns import SharedTurns
from epd_proxy.state.guard import GuardedStore
from epd_proxy.state.redis_store import RedisStore

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def _entry(owner: bytes | None, conv: bytes, tokens: int, now: float, decode: str = "http://d1") -> Entry:
    return Entry({"do_remote_decode": True, "remote_num_tokens": tokens}, decode, tokens, 10, now + 100,
                 conv.ljust(16, b"."), owner=owner)


def test_a_flooding_key_lets_its_own_turns_go_not_the_others():
    store = TurnStore(480, 15, max_held=1000)
    now = time.monotonic()
    store.put(b"a1", _entry(A, b"a1", 200, now), now)
    store.put(b"c1", _entry(C, b"c1", 200, now), now)
    released = []
    for i in range(20):  # B keeps turn after turn on the same decode
        released += store.put(b"b%d" % i, _entry(B, b"b%d" % i, 150, now), now)
    assert all(e.owner == B for e in released) and len(released) >= 15
    assert store.take(b"a1", None, now)[0] is not None and store.take(b"c1", None, now)[0] is not None
    assert store.held["http://d1"] <= 1000


def test_a_key_over_its_share_is_cut_back_to_the_others_level():
    store = TurnStore(480, 15, max_held=900)
    now = time.monotonic()
    for i in range(5):
        store.put(b"a%d" % i, _entry(A, b"a%d" % i, 150, now), now)  # A holds 750
    out = []
    for i in range(3):
        out += store.put(b"b%d" % i, _entry(B, b"b%d" % i, 150, now), now)
    # B's 450 fit only by letting A, the largest holder, go down; B lost nothing.
    assert [e.owner for e in out] == [A, A] and store.held["http://d1"] == 900


def test_without_keys_the_oldest_go_as_before():
    store = TurnStore(480, 15, max_held=250)
    now = time.monotonic()
    store.put(b"k1", _entry(None, b"c1", 100, now), now)
    store.put(b"k2", _entry(None, b"c2", 100, now), now)
    out = store.put(b"k3", _entry(None, b"c3", 100, now), now)
    assert [e.conversation[:2] for e in out] == [b"c1"]


async def test_across_replicas_each_lets_the_largest_keys_turns_go_first(redis_server):  # noqa: F811
    store = GuardedStore(RedisStore(redis_server.url, None, 1.0), "share:", 1.0)
    try:
        a = SharedTurns(store, TurnStore(480, 15, 1000))
        released: list[Entry] = []
        now = time.monotonic()
        assert await a.put(b"a-turn-000000001", _entry(A, b"a1", 200, now), now, released.append)
        for i in range(12):
            assert await a.put(b"b-turn-%09d" % i, _entry(B, b"b%d" % i, 150, now), now, released.append)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the bound is kept in the background
        assert released and all(e.owner == B for e in released)
        got, reason, _ = await a.take(b"a-turn-000000001", None, now)
        assert got is not None and got.owner == A, reason
    finally:
        await store.close()
