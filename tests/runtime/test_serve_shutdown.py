"""Graceful shutdown (serve.py): in-process (the shutdown timeout) and as a real child process (SIGTERM)."""

import asyncio
import os
import signal
import sys

import pytest
from helpers import Client, chat_body, stack, wait_for
from procs import free_port

from epd_proxy.sim import SimCluster, SimConfig, expected_text


def _legs_closed(cluster) -> bool:
    return all(inst._in_flight == 0 for inst in cluster.all_instances())


# -- in process: what is left at the shutdown timeout is ended properly -----------------------------

async def test_shutdown_timeout_ends_a_stream_in_band_and_an_uncommitted_request_with_503():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"decode": {"itl_ms": 20}})
    async with stack(sim=sim) as (cluster, proxy, client):
        stream = asyncio.ensure_future(client.chat(chat_body(stream=True, max_tokens=2000), timeout=30))
        await wait_for(lambda: cluster.instances("decode")[0]._in_flight == 1)
        cluster.instances("prefill")[0].inject("hang")
        hung = asyncio.ensure_future(client.chat(chat_body(), timeout=30))
        await wait_for(lambda: len(cluster.records("prefill")) == 2)
        await proxy.shutdown(grace=0, timeout=0.2)
        s, h = await stream, await hung
        assert s.status == 200
        assert s.events[-2].startswith(b'data: {"error"') and s.events[-1] == b"data: [DONE]"
        assert b"shut down" in s.events[-2]
        assert h.status == 503 and h.json()["error"]["code"] == 503
        assert h.headers[b"connection"] == b"close"
        await wait_for(lambda: _legs_closed(cluster), timeout=2)


async def test_once_the_listener_closed_queued_and_new_requests_get_503():
    async with stack(max_inflight=1, queue_size=2, queue_timeout=30) as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("hang")
        held = asyncio.ensure_future(client.chat(chat_body(), timeout=30))
        await wait_for(lambda: len(cluster.records("prefill")) == 1)
        queued = asyncio.ensure_future(client.chat(chat_body(), timeout=30))
        await wait_for(lambda: proxy.app.pipeline.admission.waiting == 1)
        proxy.app.pipeline.close_admission()
        reply = await queued  # sent away at once, while the held request goes on
        assert reply.status == 503 and "shutting down" in reply.json()["error"]["message"]
        assert reply.headers[b"retry-after"] == b"1"
        assert not held.done()
        assert (await client.chat(chat_body())).status == 503
        assert len(cluster.records("prefill")) == 1
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await wait_for(lambda: proxy.app.pipeline.admission.active == 0)


# -- a real child process --------------------------------------------------------------------------

async def _start_proxy(cluster, *extra: str):
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.join(os.path.dirname(__file__), "..", "..", "src"),
                                                    env.get("PYTHONPATH", "")] if p)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epd_proxy", "serve", "--port", str(port), "--probe-interval", "0",
        "--scrape-interval", "0", "--prefill", cluster.urls("prefill")[0], "--decode", cluster.urls("decode")[0],
        "--log-level", "warning", *extra, env=env, stdout=asyncio.subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    client = Client(url)
    client.url = url

    async def up() -> bool:
        try:
            return (await client.request("GET", "/health", timeout=1)).status == 200
        except Exception:
            return False

    loop = asyncio.get_running_loop()
    end = loop.time() + 20
    while not await up():
        assert proc.returncode is None and loop.time() < end, "the proxy did not start"
        await asyncio.sleep(0.05)
    # It is our proxy on that port (in front of this cluster), not someone else's server.
    status = (await client.request("GET", "/status")).json()
    assert status["pools"]["decode"][0]["url"] == cluster.urls("decode")[0]
    return proc, client


async def _fresh_get(client: Client, path: str):
    fresh = Client(client.url)
    try:
        return await fresh.request("GET", path, timeout=5)
    finally:
        await fresh.close()


async def _ready_turns_503(client: Client):
    """/ready over new connections until the signal has been handled (it is 200 until then)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while True:
        reply = await _fresh_get(client, "/ready")
        if reply.status == 503 or loop.time() > end:
            return reply
        assert reply.status == 200
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("workers, group", [(1, False), (2, False), (2, True)])
async def test_sigterm_lets_every_request_in_flight_finish_and_exits_0(workers, group):
    # group: SIGTERM to every process of the group at once (a service manager's stop), so
    # each worker gets it twice (directly and from the parent) and must still drain.
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"decode": {"itl_ms": 15}})
    async with SimCluster(prefill=1, decode=1, config=sim) as cluster:
        proc, client = await _start_proxy(cluster, "--workers", str(workers), "--shutdown-grace", "1",
                                          "--shutdown-timeout", "20")
        try:
            bodies = [chat_body(f"stream {i}", stream=True, max_tokens=40) for i in range(20)]
            bodies += [chat_body(f"whole {i}", max_tokens=40) for i in range(5)]
            tasks = [asyncio.ensure_future(client.chat(b, timeout=30)) for b in bodies]
            decode = cluster.instances("decode")[0]
            await wait_for(lambda: decode._in_flight == 25, timeout=10)
            if group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            # /ready turns 503 at once (a new connection, during the grace period: the
            # proxy closes idle keep-alive connections when it starts draining).
            ready = await _ready_turns_503(client)
            assert ready.status == 503 and ready.json() == {"status": "draining"}
            assert ready.headers[b"connection"] == b"close"
            replies = await asyncio.gather(*tasks)
            for body, reply in zip(bodies, replies):
                assert reply.status == 200, reply.body
                assert reply.text() == expected_text(body)
                if body["stream"]:
                    assert reply.body.endswith(b"data: [DONE]\n\n")
            assert await asyncio.wait_for(proc.wait(), 20) == 0
            assert decode.stats.aborted == 0
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            await client.close()


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_second_sigterm_exits_at_once(workers):
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        proc, client = await _start_proxy(cluster, "--shutdown-grace", "30", "--shutdown-timeout", "60",
                                          "--workers", str(workers))
        try:
            cluster.instances("prefill")[0].inject("hang")
            held = asyncio.ensure_future(client.chat(chat_body(), timeout=30))
            await wait_for(lambda: len(cluster.records("prefill")) == 1)
            proc.send_signal(signal.SIGTERM)
            assert (await _ready_turns_503(client)).status == 503
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 5) == 1
            await asyncio.gather(held, return_exceptions=True)
            await wait_for(lambda: _legs_closed(cluster), timeout=2)
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            await client.close()


async def test_past_the_shutdown_timeout_what_is_left_is_ended_and_the_exit_is_0():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"decode": {"itl_ms": 20}})
    async with SimCluster(prefill=1, decode=1, config=sim) as cluster:
        proc, client = await _start_proxy(cluster, "--shutdown-grace", "0", "--shutdown-timeout", "0.5")
        try:
            stream = asyncio.ensure_future(client.chat(chat_body(stream=True, max_tokens=2000), timeout=30))
            await wait_for(lambda: cluster.instances("decode")[0]._in_flight == 1)
            cluster.instances("prefill")[0].inject("hang")
            hung = asyncio.ensure_future(client.chat(chat_body(), timeout=30))
            await wait_for(lambda: len(cluster.records("prefill")) == 2)
            proc.send_signal(signal.SIGTERM)
            s, h = await stream, await hung
            assert s.events[-2].startswith(b'data: {"error"') and s.events[-1] == b"data: [DONE]"
            assert h.status == 503 and h.json()["error"]["code"] == 503
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            await wait_for(lambda: _legs_closed(cluster), timeout=2)
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            await client.close()
