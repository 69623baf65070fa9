"""--workers N (workers.py): a roster change made through any worker reaches every worker.
A real proxy process with two workers; the kernel picks the worker per connection, so
each check is repeated over new connections until both workers have answered."""

import asyncio
import socket

import msgspec
from helpers import JSON, Client, chat_body, wait_for
from proxy_process import ProxyProcess

from epd_proxy.runtime.workers import PeerLink
from epd_proxy.sim import SimCluster, SimConfig

KEY = [(b"x-api-key", b"k3y")]


async def _every_worker(proxy: ProxyProcess, want, timeout: float = 10.0) -> dict:
    """{pid: status} once both workers' /status satisfy ``want``."""
    seen: dict[int, dict] = {}
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        status = (await proxy.fresh_get("/status", headers=KEY)).json()
        seen[status["pid"]] = status
        if len(seen) == 2 and all(want(s) for s in seen.values()):
            return seen
        assert loop.time() < end, f"not every worker got there: {seen}"
        await asyncio.sleep(0.01)


def _decode(status: dict) -> dict[str, str]:
    return {i["url"]: i["state"] for i in status["pools"]["decode"]}


async def _once(proxy: ProxyProcess, method: str, path: str, body: dict):
    client = Client(proxy.url)
    try:
        return await client.request(method, path, msgspec.json.encode(body), JSON + KEY)
    finally:
        await client.close()


async def test_a_registration_through_one_worker_reaches_every_worker():
    async with SimCluster(decode=2, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        a, b = cluster.instances("decode")
        async with ProxyProcess(["--workers", "2", "--decode", a.url, "--probe-interval", "0",
                                 "--admin-api-key", "k3y", "--log-level", "warning"]) as proxy:
            await _every_worker(proxy, lambda s: list(_decode(s)) == [a.url])
            reply = await _once(proxy, "POST", "/instances", {"role": "decode", "url": b.url, "ec_zmq_addrs": [],
                                                              "dp_size": 1})
            assert (reply.status, reply.json()) == (200, {"registered": True})
            seen = await _every_worker(proxy, lambda s: b.url in _decode(s))
            assert all(sorted(s["roster"]["decode"]["live"]) == sorted([a.url, b.url]) for s in seen.values())
            # Both workers route to it.
            for i in range(12):
                client = Client(proxy.url)
                try:
                    assert (await client.chat(chat_body(f"request {i}"))).status == 200
                finally:
                    await client.close()
            assert len(b.generation_records()) > 0
            # Draining and removal travel the same way.
            reply = await _once(proxy, "POST", "/instances/drain", {"url": a.url})
            assert reply.status == 200
            await _every_worker(proxy, lambda s: a.url not in _decode(s))  # idle: it left at once
            reply = await _once(proxy, "DELETE", "/instances", {"role": "decode", "url": b.url})
            assert reply.status == 200 and reply.json() == {"removed": True}
            await _every_worker(proxy, lambda s: _decode(s) == {})


async def test_a_peer_link_carries_whole_messages_both_ways():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    got: list[dict] = []
    a, b = PeerLink(left), PeerLink(right)
    try:
        b.start(got.append)
        a.send({"event": "registered", "spec": {"url": "http://x:1", "role": "decode"}})
        a.send({"event": "removed", "spec": {"url": "http://x:1", "role": "decode"}})
        await wait_for(lambda: len(got) == 2)
        assert [m["event"] for m in got] == ["registered", "removed"]
    finally:
        a.close()
        b.close()


def _roster():
    from epd_proxy.instances.membership import Membership
    from epd_proxy.instances.pool import InstancePool

    return Membership({role: InstancePool(role, ()) for role in ("encode", "prefill", "decode")})


async def test_what_each_worker_does_by_itself_is_not_shared():
    from epd_proxy.config import InstanceSpec
    from epd_proxy.instances.shared import SharedRoster

    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ma, mb = _roster(), _roster()
    a, b = SharedRoster(ma, PeerLink(left)), SharedRoster(mb, PeerLink(right))
    try:
        api = InstanceSpec("http://10.0.0.1:8000", "decode")
        ma.register(api, source="api")  # through worker A's API
        await wait_for(lambda: mb.find(api.url) is not None)
        assert mb.source_of(mb.find(api.url)) == "api"
        # DNS discovery and reloads run in every worker: not sent.
        dns = InstanceSpec("http://10.0.0.2:8000", "decode")
        with a.local():
            ma.apply([dns], source="dns:decode:http://x:8000")
        ma.drain(api.url)  # an operator's drain is shared ...
        await wait_for(lambda: mb.find(api.url).state == "draining")
        assert mb.find(dns.url) is None and b.applied == 2
        # ... but its departure is each worker's own (A's sweep removes it; B keeps its own
        # until B's requests on it are done).
        ma.sweep(0.0)
        assert ma.find(api.url) is None
        mb.find(api.url).inflight = 1
        ma.register(InstanceSpec("http://10.0.0.3:8000", "decode"), source="api")  # a marker after it
        await wait_for(lambda: b.applied == 3)
        assert mb.find(api.url) is not None
    finally:
        a.link.close()
        b.link.close()
        await ma.close()
        await mb.close()
