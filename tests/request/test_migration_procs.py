"""Streams survive their decode, with the decodes in processes of their own (``epd-proxy sim``):
SIGKILLed under concurrent long streams, every stream completes with the right token count, one
id and one terminator; SIGSTOPped, every stream goes on elsewhere within about 2 s of its last
event (request/migration.py)."""

import asyncio
import contextlib
import os
import signal
import sys
import time

import msgspec
import pytest
from procs import SRC, free_port, fresh_request

from epd_proxy.config import InstanceSpec, ProxyConfig
from epd_proxy.runtime.build import start_proxy

pytestmark = pytest.mark.asyncio

STREAMS = 16
TOKENS = 128
ITL_MS = 15  # a stream of 128 tokens takes about 2 s


@contextlib.asynccontextmanager
async def sim_process(role: str, itl_ms: float = ITL_MS):
    """One simulated instance of ``role`` in a child process; yields (process, url)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [SRC, os.environ.get("PYTHONPATH", "")] if p))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epd_proxy", "sim", f"--{role}", "1", "--base-port", str(port),
        "--itl-ms", str(itl_ms), "--ttft-ms", "1", "--no-records", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        while True:
            try:
                if (await fresh_request(url, "GET", "/health")).status == 200:
                    break
            except Exception:
                pass
            assert proc.returncode is None and loop.time() < end, f"the {role} simulator did not start"
            await asyncio.sleep(0.05)
        yield proc, url
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


@contextlib.asynccontextmanager
async def cluster_and_proxy(**proxy_kwargs):
    """A prefill and two decodes, each in its own process, and a proxy in front."""
    async with sim_process("prefill") as (_, p_url), sim_process("decode") as (d0, d0_url), \
            sim_process("decode") as (d1, d1_url):
        config = ProxyConfig(prefill=[InstanceSpec(p_url, "prefill")],
                             decode=[InstanceSpec(d0_url, "decode"), InstanceSpec(d1_url, "decode")],
                             probe_interval=0, scrape_interval=0, routing="round-robin", **proxy_kwargs)
        async with await start_proxy(config) as proxy:
            yield proxy, {d0_url: d0, d1_url: d1}


async def _stream(url: str, i: int) -> tuple[list, list[float]]:
    """One chat stream read event by event: its events (parsed; the terminator as the string)
    and when each arrived."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": f"stream {i}: tell me a long story"}],
            "max_tokens": TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    raw = msgspec.json.encode(body)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(raw), raw))
    events, times, buf = [], [], b""
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    try:
        while True:
            line = await reader.readline()  # chunked: a size line, then the chunk
            if not line:
                break
            size = int(line.strip(), 16)
            if size == 0:
                break
            chunk = await reader.readexactly(size + 2)
            buf += chunk[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event[len(b"data: "):]
                events.append("[DONE]" if data == b"[DONE]" else msgspec.json.decode(data))
                times.append(time.monotonic())
    finally:
        writer.close()
    return events, times


def _check(events: list) -> None:
    """One whole stream: one id, one terminator last, no error, TOKENS text events, the usage."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    data = events[:-1]
    assert not [e for e in data if "error" in e], [e for e in data if "error" in e]
    assert len({e["id"] for e in data}) == 1 and len({e["created"] for e in data}) == 1
    texts = [c["delta"].get("content") for e in data for c in e["choices"]]
    assert len([t for t in texts if t]) == TOKENS
    assert data[-1]["usage"]["completion_tokens"] == TOKENS


def moved_count(proxy) -> int:
    return sum(proxy.app.metrics.migrations.values())


async def _started(proxy, n: int) -> None:
    """Until ``n`` streams are committed."""
    end = time.monotonic() + 20
    while proxy.app.metrics.inflight < n or sum(i.inflight for i in proxy.app.pools["decode"].instances) < n:
        assert time.monotonic() < end, "the streams did not start"
        await asyncio.sleep(0.02)


async def _whole(url: str, i: int) -> dict:
    """One non-streamed chat answer."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": f"answer {i}: tell me a long story"}],
            "max_tokens": TOKENS}
    reply = await fresh_request(url, "POST", "/v1/chat/completions", msgspec.json.encode(body),
                                [(b"content-type", b"application/json")])
    assert reply.status == 200, reply.body
    return msgspec.json.decode(reply.body)


async def test_sigkill_of_a_decode_under_concurrent_streams_costs_no_stream():
    async with cluster_and_proxy() as (proxy, decodes):
        tasks = [asyncio.ensure_future(_stream(proxy.url, i)) for i in range(STREAMS)]
        await _started(proxy, STREAMS)
        # Whole answers too: nothing of theirs reached the client, they are placed again whole.
        wholes = [asyncio.ensure_future(_whole(proxy.url, i)) for i in range(4)]
        await asyncio.sleep(0.5)  # every stream well under way
        victim = proxy.app.pools["decode"].instances[0]
        assert victim.inflight > 0
        os.killpg(decodes[victim.url].pid, signal.SIGKILL)
        for answer in await asyncio.wait_for(asyncio.gather(*wholes), 60):
            assert answer["usage"]["completion_tokens"] == TOKENS
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        worst = 0.0
        for events, times in results:
            _check(events)
            worst = max(worst, max(b - a for a, b in zip(times, times[1:])))
        print(f"\nSIGKILL: {moved_count(proxy)} of {STREAMS} streams moved; the longest gap between two events "
              f"of a stream {worst:.2f} s", file=sys.stderr)
        moved = proxy.app.metrics.migrations
        assert set(moved) == {("reset", "ok")} and moved[("reset", "ok")] >= 1
        assert proxy.app.metrics.stream_errors == 0


async def test_sigstop_of_a_decode_moves_its_streams_within_two_seconds():
    async with cluster_and_proxy() as (proxy, decodes):
        tasks = [asyncio.ensure_future(_stream(proxy.url, i)) for i in range(STREAMS)]
        await _started(proxy, STREAMS)
        await asyncio.sleep(0.5)
        victim = proxy.app.pools["decode"].instances[0]
        assert victim.inflight > 0
        pid = decodes[victim.url].pid
        os.killpg(pid, signal.SIGSTOP)
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            os.killpg(pid, signal.SIGCONT)
        worst = 0.0
        for events, times in results:
            _check(events)
            worst = max(worst, max(b - a for a, b in zip(times, times[1:])))
        # The stall floor (1.5 s) and the continuation's first event; loaded test machines add some.
        print(f"\nSIGSTOP: {moved_count(proxy)} of {STREAMS} streams moved; the longest gap between two events "
              f"of a stream {worst:.2f} s", file=sys.stderr)
        assert worst < 3.0, worst
        moved = proxy.app.metrics.migrations
        assert set(moved) == {("stall", "ok")} and moved[("stall", "ok")] >= 1


async def test_without_migration_a_killed_decode_cuts_its_streams():
    # The same kill with --no-stream-migration: what the proxy did before (the test above's foil).
    async with cluster_and_proxy(stream_migration=False) as (proxy, decodes):
        tasks = [asyncio.ensure_future(_stream(proxy.url, i)) for i in range(4)]
        await _started(proxy, 4)
        await asyncio.sleep(0.3)
        victim = proxy.app.pools["decode"].instances[0]
        os.killpg(decodes[victim.url].pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        cut = [events for events, _ in results if any("error" in e for e in events[:-1])]
        assert len(cut) == 2

