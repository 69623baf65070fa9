"""--workers N (workers.py): a roster change made through any worker reaches every worker.
A real proxy process with two workers; the kernel picks the worker per connection, so
each check is repeated over new connections until both workers have answered."""

import asyncio
import os
import signal
import socket
import time

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


# -- supervision: a worker that dies is replaced ----------------------------------------------

CHAT_200 = 'epd_proxy_requests_total{endpoint="/v1/chat/completions",status="200"}'


async def _get(proxy: ProxyProcess, path: str):
    """GET over a new connection; again if a just-killed worker had accepted it (reset)."""
    for attempt in range(20):
        try:
            return await proxy.fresh_get(path, headers=KEY)
        except Exception:
            if attempt == 19:
                raise
            await asyncio.sleep(0.02)


async def _supervisor(proxy: ProxyProcess) -> list[dict]:
    return (await _get(proxy, "/status")).json()["supervisor"]


async def _serving(proxy: ProxyProcess, index: int, not_pid: int | None = None, timeout: float = 20.0) -> dict:
    """Worker ``index``'s supervisor entry once a worker other than ``not_pid`` serves there
    and every worker answers."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        status = (await _get(proxy, "/status")).json()
        slot = status["supervisor"][index]
        if slot["serving"] and slot["pid"] != not_pid and status["workers"] == 2:
            return slot
        assert loop.time() < end, f"worker {index} not back: {status['supervisor']}\n{proxy.log()}"
        await asyncio.sleep(0.05)


async def _scrape(proxy: ProxyProcess) -> float:
    text = (await _get(proxy, "/metrics")).body.decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(CHAT_200))


async def _chat(proxy: ProxyProcess, n: int) -> int:
    """``n`` requests over new connections (either worker); how many were answered 200."""
    ok = 0
    for i in range(n):
        client = Client(proxy.url)
        try:
            ok += (await client.chat(chat_body(f"request {i}", max_tokens=2))).status == 200
        except Exception:  # a connection the killed worker had accepted
            pass
        finally:
            await client.close()
    return ok


async def test_a_killed_worker_is_replaced_and_no_scrape_counts_less():
    """The issue: after kill -9 one worker was gone for good, /ready said workers 1 and the
    request counter fell from 20 to 15 (a counter reset to Prometheus)."""
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        async with ProxyProcess(["--workers", "2", "--prefill", cluster.urls("prefill")[0],
                                 "--decode", cluster.urls("decode")[0], "--probe-interval", "0",
                                 "--admin-api-key", "k3y"]) as proxy:
            old = await _serving(proxy, 1)
            sent = await _chat(proxy, 20)
            last = 0.0
            for _ in range(4):  # either worker may take the scrape
                now = await _scrape(proxy)
                assert now >= last
                last = now
            assert last == sent == 20
            os.kill(old["pid"], signal.SIGKILL)
            # Every scrape from the kill on: never less than the one before, while requests go on.
            loop = asyncio.get_running_loop()
            end = loop.time() + 20
            while True:
                now = await _scrape(proxy)
                assert now >= last, f"the counter went back from {last} to {now}"
                last = now
                sent += await _chat(proxy, 2)
                ready = (await _get(proxy, "/ready")).json()
                if ready["workers"] == 2 and "started pid" in proxy.log():
                    break
                assert ready == {"status": "ready", "workers": 1, "workers_configured": 2}
                assert loop.time() < end, proxy.log()
            new = await _serving(proxy, 1, not_pid=old["pid"])
            assert f"worker 1 (pid {old['pid']}) killed by SIGKILL; started pid {new['pid']}" in proxy.log()
            assert (new["restarts"], new["last_exit"], new["backing_off_until"]) == (1, "killed by SIGKILL", None)
            status = (await _get(proxy, "/status")).json()
            assert (status["workers"], status["workers_configured"]) == (2, 2)
            sent += await _chat(proxy, 10)
            for _ in range(4):
                now = await _scrape(proxy)
                assert now >= last
                last = now
            # Nothing was lost: every request was scraped before the kill or counted after it.
            assert last == sent


async def test_a_crash_loop_backs_off_and_shows_in_status():
    """A worker that keeps dying young is restarted after 1 s, then 2 s, ...; /status says so."""
    async with SimCluster(decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        async with ProxyProcess(["--workers", "2", "--decode", cluster.urls("decode")[0], "--probe-interval", "0",
                                 "--admin-api-key", "k3y"]) as proxy:
            slot = await _serving(proxy, 1)
            loop = asyncio.get_running_loop()
            waited = []
            for kill in range(3):
                pid = slot["pid"]
                os.kill(pid, signal.SIGKILL)
                killed = loop.time()
                if kill:  # backing off: the slot is empty and /status says until when
                    wait = 2.0 ** (kill - 1)
                    await proxy.wait_log(f"worker 1 (pid {pid}) killed by SIGKILL after")
                    assert f"restarting in {wait:.0f} s (restart {kill + 1})" in proxy.log()
                    entry = (await _supervisor(proxy))[1]
                    assert not entry["alive"] and entry["backing_off_until"] > time.time()
                    assert entry["last_exit"] == "killed by SIGKILL"
                slot = await _serving(proxy, 1, not_pid=pid)
                waited.append(loop.time() - killed)
                assert slot["restarts"] == kill + 1
            assert waited[1] >= 1.0 and waited[2] >= 2.0, waited
            assert slot["backing_off_until"] is None
            assert "replaced: started pid" in proxy.log()


async def test_a_runtime_registration_survives_a_worker_replacement():
    async with SimCluster(decode=2, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        a, b = cluster.instances("decode")
        async with ProxyProcess(["--workers", "2", "--decode", a.url, "--probe-interval", "0",
                                 "--admin-api-key", "k3y"]) as proxy:
            old = await _serving(proxy, 1)
            reply = await _once(proxy, "POST", "/instances", {"role": "decode", "url": b.url})
            assert (reply.status, reply.json()) == (200, {"registered": True})
            await _every_worker(proxy, lambda s: b.url in _decode(s))
            os.kill(old["pid"], signal.SIGKILL)
            new = await _serving(proxy, 1, not_pid=old["pid"])
            # The replacement has it too (the kernel picks the worker: ask until it answered).
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            while True:
                status = (await _get(proxy, "/status")).json()
                if status["pid"] == new["pid"]:
                    assert sorted(_decode(status)) == sorted([a.url, b.url])
                    assert sorted(status["roster"]["decode"]["live"]) == sorted([a.url, b.url])
                    break
                assert loop.time() < end, "the replacement never answered"
                await asyncio.sleep(0.01)
