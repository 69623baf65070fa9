"""Instances leaving and coming back, over real sockets: re-admission with probes off,
an instance that starts after the proxy, the proxy's own descriptor shortage, and a
wedged instance (accepts connections, answers nothing)."""

import asyncio
import os
import socket
import sys
from pathlib import Path

import msgspec
from helpers import Client, chat_body, wait_for

import epd_proxy
from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.config import InstanceSpec, StageTimeouts
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig
from epd_proxy.sim.instance import SimInstance

SIM = SimConfig(itl_ms=0, ttft_ms=0.5)


async def test_an_ejected_instance_comes_back_with_probes_off():
    async with SimCluster(pd=2, config=SIM) as cluster:
        base = ProxyConfig(probe_interval=0, fail_threshold=1, ejection_time=0.2, routing="round-robin")
        async with await start_proxy(config_for_cluster(cluster, base)) as proxy:
            client = Client(proxy.url)
            pool = proxy.app.pools["decode"]
            down = cluster.instances("pd")[0]
            await down.crash()
            for _ in range(2):  # one of them meets the dead instance first, and is retried
                assert (await client.chat(chat_body())).status == 200
            assert pool.instances[0].state == "ejected"
            await down.restart()
            # No probe and no traffic: the ejection runs out by itself ...
            await wait_for(lambda: pool.instances[0].state == "half-open")
            # ... and a share of live traffic brings it back.
            replies = [await client.chat(chat_body()) for _ in range(8)]
            assert [r.status for r in replies] == [200] * 8
            assert pool.instances[0].state == "healthy"
            assert down.generation_records()
            await client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_an_instance_started_after_the_proxy_serves_the_first_request_once_ready():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = ProxyConfig(decode=[InstanceSpec(url, "decode")], probe_interval=5.0, probe_timeout=0.5)
    async with await start_proxy(cfg) as proxy:
        client = Client(proxy.url)
        for _ in range(3):  # vLLM still loading: the role is unreachable, say so
            reply = await client.chat(chat_body())
            assert reply.status == 503
            assert reply.headers[b"retry-after"] == b"5"
            assert url not in reply.body.decode()
        late = SimInstance("pd", 0, SIM, port=port)
        await late.start()
        try:
            reply = await client.chat(chat_body(stream=True))
            assert reply.status == 200, reply.body
            # An instance never seen healthy is probed at the fast interval, not every 5 s.
            inst = proxy.app.pools["decode"].instances[0]
            await wait_for(lambda: inst.health.seen_healthy and inst.healthy, timeout=4.0)
        finally:
            await client.close()
            await late.stop()


_CHILD = r"""
import asyncio, os, resource, sys
import epd_proxy
from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.config import InstanceSpec
from epd_proxy.http.event_loop import run

async def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    # No background scrape: its pooled connection would spare the request the failing connect.
    cfg = ProxyConfig(decode=[InstanceSpec(u, "decode") for u in sys.argv[1:]], probe_interval=0,
                      fail_threshold=1, decode_retries=1, scrape_interval=0)
    proxy = await start_proxy(cfg)
    print("port", proxy.server.port, flush=True)
    loop = asyncio.get_running_loop()
    held = []
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        if line == "fill":  # every descriptor this process may still open
            try:
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            print("filled", len(held), flush=True)
        elif line == "free":
            for fd in held:
                os.close(fd)
            held.clear()
            print("freed", flush=True)
    await proxy.close()

run(main())
"""


async def test_too_many_open_files_in_the_proxy_ejects_nothing():
    async with SimCluster(pd=2, config=SIM) as cluster:
        src = str(Path(epd_proxy.__file__).resolve().parents[1])  # the code under test, in the child too
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD, *cluster.urls("pd"), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env)
        client = None
        try:
            line = await asyncio.wait_for(child.stdout.readline(), 20)
            port = int(line.split()[1])
            client = Client(f"http://127.0.0.1:{port}")
            assert (await client.request("GET", "/status")).status == 200  # connected before the shortage
            child.stdin.write(b"fill\n")
            assert (await asyncio.wait_for(child.stdout.readline(), 10)).startswith(b"filled")
            for stream in (False, True, False):
                reply = await client.chat(chat_body(stream=stream))
                assert reply.status == 503, reply.body
                assert reply.headers[b"retry-after"] == b"5"
                assert "local resources" in reply.json()["error"]["message"]
            status = (await client.request("GET", "/status")).json()
            assert [i["state"] for i in status["pools"]["decode"]] == ["healthy", "healthy"]
            assert all(i["errors"] == {} and i["consecutive_failures"] == 0 for i in status["pools"]["decode"])
            metrics = (await client.request("GET", "/metrics")).body
            assert b'epd_proxy_local_errors_total{role="decode"} 3.0' in metrics
            child.stdin.write(b"free\n")
            assert (await asyncio.wait_for(child.stdout.readline(), 10)).startswith(b"freed")
            assert (await client.chat(chat_body())).status == 200
        finally:
            if client is not None:
                await client.close()
            if child.returncode is None:
                child.stdin.close()
                try:
                    await asyncio.wait_for(child.wait(), 10)
                except TimeoutError:
                    child.kill()
                    await child.wait()


class Wedged:
    """A listener that accepts connections and never answers (a stopped process's socket)."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        async def hold(reader, writer):
            self.writers.append(writer)
            await reader.read()  # until the peer gives up

        self.server = await asyncio.start_server(hold, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        self.server.close()
        for w in self.writers:
            w.close()


async def test_a_wedged_instance_is_ejected_and_its_pending_requests_fail_over():
    wedged = Wedged()
    stuck_url = await wedged.start()
    async with SimCluster(pd=1, config=SIM) as cluster:
        cfg = ProxyConfig(decode=[InstanceSpec(cluster.urls("pd")[0], "decode"), InstanceSpec(stuck_url, "decode")],
                          probe_interval=0.2, probe_timeout=0.5, fail_threshold=2, routing="round-robin",
                          timeouts=StageTimeouts(decode_first=60.0, stream_idle=60.0))
        async with await start_proxy(cfg) as proxy:
            clients = [Client(proxy.url) for _ in range(6)]
            try:
                # Half of these are routed to the wedged instance before its probes fail; a
                # stage timeout (60 s) would outlast the client's own (10 s).
                replies = await asyncio.gather(*(c.chat(chat_body(stream=i % 2 == 0))
                                                 for i, c in enumerate(clients)))
                assert [r.status for r in replies] == [200] * 6, [r.body for r in replies]
                stuck = proxy.app.pools["decode"].instances[1]
                assert stuck.state == "ejected"
                assert stuck.health.errors.get("timeout", 0) >= 2
                assert stuck.health.errors.get("ejected", 0) >= 1  # pending requests failed over ...
                assert proxy.app.metrics.retries >= 1  # ... and retried on the other instance
                status = msgspec.json.decode((await clients[0].request("GET", "/status")).body)
                assert status["pools"]["decode"][1]["state"] == "ejected"
            finally:
                for c in clients:
                    await c.close()
    await wedged.close()
