"""The state store's promises, the same for every implementation (in-process, the ``--workers``
parent's table, a real redis-server): taken at most once, gone at its TTL, the mark of a
take; and the guard: a dead or slow store is a miss within the budget, counted, skipped while
down, and used again by itself when it comes back."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis_server import redis_server  # noqa: F401  (the fixture)

from epd_proxy.state.guard import GuardedStore, state_collector
from epd_proxy.state.memory import MemoryStore, MemoryTable
from epd_proxy.state.parent import ParentStore, answer
from epd_proxy.state.redis_store import RedisStore, safe_url


class _Table:
    """The parent's side without the processes: every call encoded, answered by the parent's
    own function over its table, decoded (the channel itself: tests/runtime/test_workers_multiturn.py)."""

    def __init__(self) -> None:
        self.table = MemoryTable()

    async def store_call(self, request: bytes) -> bytes | None:
        return answer(self.table, request)


@pytest.fixture(params=["memory", "parent", "redis"])
async def store(request):
    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "parent":
        s = ParentStore(_Table())
    else:
        server = request.getfixturevalue("redis_server")
        s = RedisStore(server.url, None, 1.0)
    try:
        yield s
    finally:
        await s.close()


async def test_a_value_is_taken_at_most_once_even_at_once(store):
    await store.put(b"k", b"v", 10)
    results = await asyncio.gather(*[store.take(b"k", b"k-mark", 10) for _ in range(20)])
    got = [v for v, _ in results if v is not None]
    assert got == [b"v"]
    assert await store.take(b"k", b"k-mark", 10) == (None, True)  # the mark tells a second use
    assert await store.take(b"other", b"other-mark", 10) == (None, False)  # never there
    assert await store.take(b"k") == (None, False)


async def test_values_go_at_their_ttl(store):
    await store.put(b"short", b"v", 0.05)
    await store.put(b"long", b"w", 10)
    await asyncio.sleep(0.15)
    assert await store.get(b"short") is None
    assert await store.get(b"long") == b"w"


async def test_put_returns_the_value_it_replaced(store):
    assert await store.put(b"c", b"one", 10, old=True) is None
    assert await store.put(b"c", b"two", 10, old=True) == b"one"
    assert await store.get(b"c") == b"two"


async def test_counters_and_sets(store):
    assert await store.incr(b"n", 5, 10) == 5
    assert await store.incr(b"n", -2, 10) == 3
    assert [None if v is None else int(v) for v in await store.get_many([b"n", b"none"])] == [3, None]
    await store.add(b"s", 300, 10)
    await store.add(b"s", 200, 10)
    await store.add(b"s", 300, 10)
    assert await store.members(b"s") == [200, 300]
    assert await store.members(b"none") == []
    assert await store.claim(b"a", b"1", 10) is True
    assert await store.claim(b"a", b"1", 10) is False  # claimed: the others wait
    assert (await store.take(b"a"))[0] == b"1"
    assert await store.claim(b"a", b"1", 10) is True
    await store.ping()


def test_the_table_is_bounded():
    t = MemoryTable(capacity=3)
    for i in range(5):
        t.put(b"%d" % i, b"v", 10, False, 0.0)
    assert len(t) == 3 and t.get(b"0", 0.0) is None and t.get(b"4", 0.0) == b"v"
    t = MemoryTable(max_bytes=250)
    for i in range(5):
        t.put(b"%d" % i, b"x" * 100, 10, False, 0.0)
    assert len(t) == 2 and t.bytes == 200 and t.get(b"4", 0.0) is not None
    assert t.take(b"4", None, 0, 0.0)[0] is not None and t.bytes == 100
    t.put(b"3", b"y", 10, False, 0.0)
    assert t.bytes == 1


def test_urls_are_shown_without_credentials():
    assert safe_url("rediss://user:secret@cache.example:6380/2") == "rediss://cache.example:6380/2"


def _guarded(server, timeout: float = 0.05) -> GuardedStore:
    store = RedisStore(server.url, None, timeout)
    return GuardedStore(store, "test:", timeout, store.url)


async def test_a_dead_store_is_a_miss_within_the_budget_then_costs_nothing_and_comes_back(redis_server):  # noqa: F811
    g = _guarded(redis_server)
    try:
        ok, _ = await g.put(g.key(b"t", b"\x01"), b"v", 10)
        assert ok and g.up
        redis_server.stop()
        t0 = time.perf_counter()
        assert await g.take(g.key(b"t", b"\x01"), g.key(b"u", b"\x01"), 10) == (None, False)
        assert time.perf_counter() - t0 < 0.5
        assert not g.up and g.errors == {"take": 1}
        calls = g.calls
        t0 = time.perf_counter()
        for _ in range(100):  # the breaker is open: no call at all
            assert await g.get(g.key(b"t", b"\x01")) is None
        assert g.calls == calls and time.perf_counter() - t0 < 0.05
        f: dict[str, list] = {"epd_proxy_state_store_errors": [], "epd_proxy_state_store_up": [],
                              "epd_proxy_state_store_invalid": []}
        state_collector(g)(f)
        assert f == {"epd_proxy_state_store_errors": [["take", 1]], "epd_proxy_state_store_up": [["redis", 0]],
                     "epd_proxy_state_store_invalid": []}
        assert g.status()["up"] is False and g.status()["url"] == redis_server.url
        redis_server.start()  # back, empty
        deadline = time.monotonic() + 5
        while not g.up and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert g.up
        ok, _ = await g.put(g.key(b"t", b"\x02"), b"w", 10)
        assert ok and await g.get(g.key(b"t", b"\x02")) == b"w"
    finally:
        await g.close()


class _Slow(MemoryStore):
    async def get(self, key: bytes) -> bytes | None:
        await asyncio.sleep(1.0)
        return b"late"


async def test_a_slow_store_counts_as_failed_at_the_budget():
    g = GuardedStore(_Slow(), "p:", 0.02)
    try:
        t0 = time.perf_counter()
        assert await g.get(b"x") is None
        assert time.perf_counter() - t0 < 0.3
        assert g.errors == {"get": 1} and not g.up
        await asyncio.sleep(1.2)  # the probe (ping) answers: up again
        assert g.up
    finally:
        await g.close()


async def test_a_password_from_the_configuration(tmp_path):
    from redis_server import SERVER, RedisServer

    from epd_proxy.config import ProxyConfig
    from epd_proxy.state.configured import open_store
    if SERVER is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(password="s3cret")
    try:
        pw = tmp_path / "pw"
        pw.write_text("s3cret\n")
        g = open_store(ProxyConfig(decode=(), state_store=server.url, state_store_password_file=str(pw)))
        assert g is not None
        ok, _ = await g.put(b"k", b"v", 10)
        assert ok
        await g.close()
        g = open_store(ProxyConfig(decode=(), state_store=server.url))  # no password: refused, a miss
        assert g is not None
        ok, _ = await g.put(b"k", b"v", 10)
        assert not ok and g.errors == {"put": 1}
        await g.close()
    finally:
        server.close()
