"""What the shared state store returns is untrusted input (turns/read_back.py): kept turns
rewritten in a real redis-server, between two proxy replicas over one simulated cluster with
bidirectional transfer. A turn pointing at a listener of the attacker's makes no prefill
connect there; a malformed one is a miss, never a 500; each is counted; honest turns still
reuse."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import msgspec
import redis
from redis_server import redis_server  # noqa: F401  (the fixture)
from test_multiturn import _next, _reads, _t1, _wrong
from test_shared_turns import _chat, _outcomes, _replicas, _turns, _until

from epd_proxy.request.turns import read_back

ADMIN = [(b"x-api-key", b"admin-key")]


class _Listener:
    """A TCP listener that counts the connections made to it (where a rewritten entry points)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()


@contextlib.contextmanager
def _redis(server):
    r = redis.Redis(port=server.port)
    try:
        yield r
    finally:
        r.close()


def _entries(r) -> dict[bytes, bytes]:
    return {k: r.get(k) for k in r.keys(b"t:t:*")}


async def _kept(r, before: dict) -> tuple[bytes, list]:
    """The one turn kept since ``before``: its store key and its fields."""
    for _ in range(100):
        new = {k: v for k, v in _entries(r).items() if k not in before}
        if new:
            (key, value), = new.items()
            return key, msgspec.msgpack.decode(value)
        await asyncio.sleep(0.02)
    raise AssertionError("no turn kept")


async def test_a_rewritten_address_never_reaches_a_prefill_and_malformed_entries_are_misses(redis_server):  # noqa: F811
    listener = _Listener()
    try:
        async with _replicas(redis_server.url) as (cluster, (a, b), (ca, cb)):
            await _chat(ca, _t1("warm up"))
            await _until(lambda: _turns(b).active)
            await _chat(cb, _t1("b learns the decode's address too"))
            with _redis(redis_server) as r:
                rewrites = {
                    "address": lambda f: f[0].update(remote_host="127.0.0.1", remote_port=listener.port),
                    "engine": lambda f: f[0].update(remote_engine_id="someone-else"),
                    "ids": lambda f: f.__setitem__(7, b"\x01\x02\x03"),
                    "blocks": lambda f: f[0].update(remote_block_ids=[["x"]]),
                    "tokens": lambda f: f.__setitem__(2, -5),
                    "params": lambda f: f.__setitem__(0, "not a dict"),
                    "extra": lambda f: f[0].update(remote_bootstrap_addr="x" * 100000),
                }
                for name, rewrite in rewrites.items():
                    before = _entries(r)
                    b1 = _t1(f"conversation {name}")
                    await _chat(ca, b1)
                    key, fields = await _kept(r, before)
                    rewrite(fields)
                    r.set(key, msgspec.msgpack.encode(fields), px=60000)
                    await _chat(cb, _next(b1))  # the plain path: the same answer, never a 500
                # A decode outside the pool: never read from, nor released through (decode_gone).
                before = _entries(r)
                b1 = _t1("conversation moved to a decode outside the pool")
                await _chat(ca, b1)
                key, fields = await _kept(r, before)
                fields[1] = f"http://127.0.0.1:{listener.port}"
                r.set(key, msgspec.msgpack.encode(fields), px=60000)
                await _chat(cb, _next(b1))
                for garbage in (b"\xc1", b"\x93\x01\x02"):  # not msgpack; not an entry
                    before = _entries(r)
                    b1 = _t1(f"garbage {garbage!r}")
                    await _chat(ca, b1)
                    key, _ = await _kept(r, before)
                    r.set(key, garbage, px=60000)
                    await _chat(cb, _next(b1))
            assert listener.connections == 0
            assert not [kv for kv in _reads(cluster) if kv.get("remote_port") == listener.port]
            assert _reads(cluster) == [] and _wrong(cluster) == 0
            outcomes = _outcomes(a, b)
            assert outcomes.get("invalid") == len(rewrites) + 2 and outcomes.get("decode_gone") == 1, outcomes
            metrics = (await cb.request("GET", "/metrics", headers=ADMIN)).body.decode()
            assert f'epd_proxy_state_store_invalid_total{{entry="turn"}} {len(rewrites) + 2}.0' in metrics
            # Honest turns still reuse across the replicas.
            c1 = _t1("an honest conversation")
            await _chat(ca, c1)
            await _chat(cb, _next(c1))
            assert len(_reads(cluster)) == 1 and _wrong(cluster) == 0
    finally:
        listener.close()


async def test_a_conversation_pointer_and_counters_rewritten_are_ignored(redis_server):  # noqa: F811
    async with _replicas(redis_server.url) as (cluster, (a, b), (ca, cb)):
        await _chat(ca, _t1("warm up"))
        await _until(lambda: _turns(b).active)
        await _chat(cb, _t1("b learns the decode's address too"))
        with _redis(redis_server) as r:
            for key in r.keys(b"t:c:*"):
                r.set(key, b"not a key of sixteen bytes")
            for key in r.keys(b"t:h:*"):
                r.set(key, b"many")
        b1 = _t1("after the rewrite")
        await _chat(ca, b1)
        b2 = _next(b1)
        await _chat(cb, b2)
        await _chat(ca, _next(b2))
        assert len(_reads(cluster)) == 2 and _wrong(cluster) == 0
        assert await a.app.pipeline.reuse.shared.held(cluster.instances("decode")[0].url) >= 0


def test_read_back_bounds():
    params = {"do_remote_decode": True, "remote_num_tokens": 100, "remote_block_ids": [[1, 2, 3, 4, 5, 6, 7]],
              "remote_engine_id": "e", "remote_host": "h", "remote_port": 5600}
    assert read_back.params_bounded(params, 100)
    assert not read_back.params_bounded(params, 99)  # the entry's tokens are the parameters'
    assert not read_back.params_bounded(dict(params, remote_block_ids=[list(range(102))]), 100)
    assert not read_back.params_bounded(dict(params, remote_port=[5600]), 100)
    assert not read_back.params_bounded(dict(params, remote_num_tokens=True), 100)
    assert not read_back.params_bounded({**params, **{f"k{i}": 1 for i in range(40)}}, 100)
    addresses = read_back.DecodeAddresses()
    addresses.learn("http://d", params)
    assert addresses.has("http://d", params) and not addresses.has("http://d", dict(params, remote_port=1))
    assert not addresses.has("http://d", dict(params, remote_host=["h"]))
    assert not addresses.knows("http://e")
    assert read_back.lengths_bounded([5, -1, 10**12, 7, 5], 16) == [7, 5]
    assert read_back.lengths_bounded(list(range(1, 100)), 3) == [99, 98, 97]
    assert read_back.counter(b"12") == 12 and read_back.counter(b"x") is None and read_back.counter(None) is None
    assert read_back.entry_bounded(10, 5, 1.0, b"c" * 16, "m", b"\0" * 40, None)
    assert not read_back.entry_bounded(10, 5, 1.0, b"c" * 16, "m", b"\0" * 44, None)  # more ids than tokens
    assert not read_back.entry_bounded(10, 5, float("nan"), b"c" * 16, "m", None, None)

