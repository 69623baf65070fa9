"""Stored Responses belong to the client key that created them (request/stored_responses.py):
another key gets vLLM's 404 for the id, on every replica, for ``GET``, ``/cancel`` and a
``previous_response_id`` follow-up, and no decode is asked for it; the owner in the shared
store (a real redis-server) carries the key's scope, never the key; an owner entry written
into the store by someone else is checked, and one that fails is no owner."""

from __future__ import annotations

import contextlib
import socket

import msgspec
import pytest
import redis
from helpers import Client
from redis_server import redis_server  # noqa: F401  (the fixture)

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig

RESPONSES = "/v1/responses"
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
A = [(b"authorization", f"Bearer {KEY_A}".encode())]
B = [(b"authorization", f"Bearer {KEY_B}".encode())]
ADMIN = [(b"x-api-key", b"admin-key")]


@contextlib.asynccontextmanager
async def _replicas(url: str | None, n: int = 2, keys: tuple[str, ...] = (KEY_A, KEY_B)):
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, record_responses=True)
    async with SimCluster(prefill=0, decode=2, config=sim) as cluster:
        base = ProxyConfig(probe_interval=0, scrape_interval=0, api_keys=keys, admin_api_key="admin-key",
                           state_store=url or "",
                           state_store_prefix="s:", state_store_timeout=1.0)
        proxies = [await start_proxy(config_for_cluster(cluster, base)) for _ in range(n)]
        clients = [Client(p.url) for p in proxies]
        try:
            yield cluster, proxies, clients
        finally:
            for c in clients:
                await c.close()
            for p in proxies:
                await p.close()


def _asked(cluster) -> int:
    return sum(len(i.records) for i in cluster.instances("decode"))


def _not_found(reply, rid: str) -> None:
    assert reply.status == 404, reply.body
    assert reply.json()["error"]["message"] == f"Response with id '{rid}' not found."


async def _create(client: Client, headers, text: str = "kept for a") -> str:
    r = await client.post(RESPONSES, {"model": "sim-model", "input": text, "max_output_tokens": 5}, headers)
    assert r.status == 200, r.body
    return r.json()["id"]


async def test_another_key_cannot_read_cancel_or_continue_a_response_on_any_replica(redis_server):  # noqa: F811
    async with _replicas(redis_server.url) as (cluster, (p1, p2), (c1, c2)):
        rid = await _create(c1, A)
        await p1.app.pipeline.stored.owners.written()
        asked = _asked(cluster)
        for client in (c1, c2):
            _not_found(await client.request("GET", f"{RESPONSES}/{rid}", headers=B), rid)
            _not_found(await client.post(f"{RESPONSES}/{rid}/cancel", b"", B), rid)
            follow = await client.post(RESPONSES, {"model": "sim-model", "input": "more", "max_output_tokens": 5,
                                                   "previous_response_id": rid}, B)
            _not_found(follow, rid)
        assert _asked(cluster) == asked  # refused by the proxy: no decode asked for A's id
        # A reads and continues its own, on either replica (the second learns the owner from the store).
        for client in (c2, c1):
            got = await client.request("GET", f"{RESPONSES}/{rid}", headers=A)
            assert got.status == 200 and got.json()["id"] == rid, got.body
        follow = await c2.post(RESPONSES, {"model": "sim-model", "input": "more", "max_output_tokens": 5,
                                           "previous_response_id": rid}, A)
        assert follow.status == 200, follow.body
        # The store holds the key's scope, never the key.
        r = redis.Redis(port=redis_server.port)
        try:
            values = [r.get(k) for k in r.keys(b"s:r:*")]
        finally:
            r.close()
        assert values and all(v is not None and KEY_A.encode() not in v and KEY_B.encode() not in v
                              for v in values)
        metrics = (await c1.request("GET", "/metrics", headers=ADMIN)).body
        assert b'epd_proxy_response_lookups_total{result="refused"} 3.0' in metrics


async def test_an_unknown_id_is_404_without_asking_every_decode():
    async with _replicas(None, n=1) as (cluster, _, (c1,)):
        asked = _asked(cluster)
        for i in range(5):
            rid = f"resp_{i:032x}"
            _not_found(await c1.request("GET", f"{RESPONSES}/{rid}", headers=A), rid)
        assert _asked(cluster) == asked


async def test_an_owner_entry_written_into_the_store_is_checked(redis_server):  # noqa: F811
    async with _replicas(redis_server.url) as (cluster, (p1, p2), (c1, c2)):
        rid = await _create(c1, A)
        await p1.app.pipeline.stored.owners.written()
        r = redis.Redis(port=redis_server.port)
        try:
            (key,) = r.keys(b"s:r:*")
            owner = msgspec.msgpack.decode(r.get(key))
            # An owner naming a URL outside the pool: only the decodes of the pool are asked.
            with socket.socket() as listener:
                listener.bind(("127.0.0.1", 0))
                listener.listen(4)
                listener.setblocking(False)
                r.set(key, msgspec.msgpack.encode([f"http://127.0.0.1:{listener.getsockname()[1]}", owner[1]]))
                got = await c2.request("GET", f"{RESPONSES}/{rid}", headers=A)
                assert got.status == 200 and got.json()["id"] == rid, got.body
                with pytest.raises(BlockingIOError):
                    listener.accept()  # nobody connected
            await p2.app.pipeline.stored.owners.written()  # its own owner entry, rewritten, lands first
            p2.app.pipeline.stored.owners.forget(rid)
            for garbage in (b"\xc1", b"x" * 10000, msgspec.msgpack.encode([owner[0], b"short"]),
                            msgspec.msgpack.encode({"url": 1})):
                r.set(key, garbage)
                _not_found(await c2.request("GET", f"{RESPONSES}/{rid}", headers=A), rid)
        finally:
            r.close()
        metrics = (await c2.request("GET", "/metrics", headers=ADMIN)).body
        assert b'epd_proxy_state_store_invalid_total{entry="response_owner"} 4.0' in metrics
        # The replica that relayed it still knows the owner itself.
        assert (await c1.request("GET", f"{RESPONSES}/{rid}", headers=A)).status == 200


async def test_without_keys_any_client_reads_any_response_as_before():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, record_responses=True)
    async with SimCluster(prefill=0, decode=2, config=sim) as cluster:
        base = ProxyConfig(probe_interval=0, scrape_interval=0)
        async with await start_proxy(config_for_cluster(cluster, base)) as p1, \
                await start_proxy(config_for_cluster(cluster, base)) as p2:
            c1, c2 = Client(p1.url), Client(p2.url)
            try:
                rid = await _create(c1, [])
                got = await c2.request("GET", f"{RESPONSES}/{rid}")  # found by asking every decode
                assert got.status == 200 and got.json()["id"] == rid
            finally:
                await c1.close()
                await c2.close()
