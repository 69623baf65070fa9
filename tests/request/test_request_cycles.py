"""Memory without the collector: no object of a request's path outlives the request.

The served process freezes its start-up objects and collects rarely (serve.tune_gc), so
anything a request leaves in a reference cycle stays until a full collection. Here the
collector is off while requests of every kind run: stream, non-stream, E+P+D with an image,
an upstream error, a client error, a client that leaves mid-stream and a first-byte
deadline. Afterwards not one of the proxy's request objects may remain. The simulator
runs in a child process, and the client speaks raw HTTP, so every object counted here is
the proxy's.
"""

import asyncio
import gc
import logging
import os
import sys
from collections import Counter

import msgspec
import pytest
from helpers import chat_body, wait_for
from procs import free_port

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.config import InstanceSpec, StageTimeouts

# The types of the request path (per request or per client connection).
REQUEST_TYPES = {"Request", "ResponseWriter", "HttpServerProtocol", "RequestContext", "LegPlan", "DecodeLeg",
                 "StreamRelay", "UsageRelay", "PrefillReport", "Response", "ProxyError", "UpstreamError", "Timeout"}


def _alive() -> Counter:
    out = Counter()
    for obj in gc.get_objects():
        kind = type(obj)
        name = kind.__name__
        # asyncio's Timeout only: the HTTP SDKs some tests import keep httpx.Timeout objects.
        if name in REQUEST_TYPES and (name != "Timeout" or kind.__module__.startswith("asyncio")):
            out[name] += 1
    return out


async def _sim(kv: str):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.join(os.path.dirname(__file__), "..", "..", "src"),
                                                    env.get("PYTHONPATH", "")] if p)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "epd_proxy", "sim", "--encode", "1", "--prefill", "1", "--decode", "1",
        "--kv-connector", kv, "--itl-ms", "1", "--ttft-ms", "0.5", "--no-records", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    urls, identity = {}, {}
    while "identity" not in identity:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert line, "the simulator did not start"
        role, _, rest = line.partition(" ")
        if line.startswith("prefill identity:"):
            identity = dict(item.split("=") for item in line.split(":", 1)[1].split())
            identity["identity"] = True
        elif role in ("encode", "prefill", "decode"):
            urls[role] = rest.strip()
    return proc, urls, identity


async def _raw(url: str, body: dict, *, leave_after: int = 0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    raw = msgspec.json.encode(body)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(raw), raw))
    if leave_after:
        data = await reader.readexactly(leave_after)
        writer.transport.abort()
        return data
    data = await reader.read()
    writer.close()
    return data


@pytest.mark.parametrize("kv", ["nixl", "nixl-push"])
async def test_no_request_object_outlives_its_request_without_the_collector(kv):
    proc, urls, ident = await _sim(kv)
    prefill = InstanceSpec(urls["prefill"], "prefill", engine_id=ident["engine_id"], kv_host=ident["kv_host"],
                           kv_port=int(ident["kv_port"]), tp=1, pp=1)
    config = ProxyConfig(encode=[InstanceSpec(urls["encode"], "encode")], prefill=[prefill],
                         decode=[InstanceSpec(urls["decode"], "decode")], kv_connector=kv, probe_interval=0,
                         timeouts=StageTimeouts(first_byte=0.4))
    kinds = [
        (chat_body(stream=True), 0, b"200 OK"),
        (chat_body(), 0, b"200 OK"),
        (chat_body(stream=True, images=["https://x/a.png"]), 0, b"200 OK"),
        (chat_body(sim_fault="decode:status=500"), 0, b"502 Bad Gateway"),
        (chat_body(max_tokens=-1), 0, b"400 Bad Request"),
        (chat_body(stream=True, max_tokens=200, sim_fault="decode:slow-body=0.01"), 300, b"200 OK"),
        (chat_body(sim_fault="prefill:hang"), 0, b"504 Gateway Timeout"),
    ]
    try:
        async with await start_proxy(config) as proxy:
            async def run_all():
                for body, leave, status in kinds:
                    reply = await _raw(proxy.url, body, leave_after=leave)
                    assert reply.startswith(b"HTTP/1.1 " + status), (body, reply[:300])

            def settled() -> bool:
                return not proxy.server.connections and all(
                    i.inflight == 0 for pool in proxy.app.pools.values() for i in pool.instances)

            await run_all()  # warm: lazily created state (pooled connections, metric series)
            await wait_for(settled)
            gc.collect()
            gc.disable()
            try:
                for _ in range(2):
                    await run_all()
                await wait_for(settled)
                left = _alive()
            finally:
                gc.enable()
            assert left == Counter(), f"request objects left for the collector: {dict(left)}"
    finally:
        proc.terminate()
        await proc.wait()


async def test_failed_over_encoder_items_leave_nothing_without_the_collector():
    """Items failed over from an encoder that refuses connections (concurrent sub-requests,
    the failures kept while the others finish): nothing of the request stays behind."""
    proc, urls, ident = await _sim("nixl")
    prefill = InstanceSpec(urls["prefill"], "prefill", engine_id=ident["engine_id"], kv_host=ident["kv_host"],
                           kv_port=int(ident["kv_port"]), tp=1, pp=1)
    dead = InstanceSpec(f"http://127.0.0.1:{free_port()}", "encode")
    config = ProxyConfig(encode=[dead, InstanceSpec(urls["encode"], "encode")], prefill=[prefill],
                         decode=[InstanceSpec(urls["decode"], "decode")], probe_interval=0, fail_threshold=1000,
                         encoder_max_batch_size=1, encode_policy="round-robin")
    try:
        async with await start_proxy(config) as proxy:
            async def run_all():
                for k in range(3):
                    reply = await _raw(proxy.url, chat_body(images=[f"https://x/{k}-{j}.png" for j in range(4)]))
                    assert reply.startswith(b"HTTP/1.1 200 OK"), reply[:300]

            def settled() -> bool:
                return not proxy.server.connections and all(
                    i.inflight == 0 for pool in proxy.app.pools.values() for i in pool.instances)

            # The failures' log records hold their exceptions (and so their frames) while
            # pytest keeps the records: those are references, not cycles; the logger is muted.
            stages = logging.getLogger("epd_proxy.stages")
            stages.disabled = True
            try:
                await run_all()
                await wait_for(settled)
                gc.collect()
                gc.disable()
                try:
                    await run_all()
                    await wait_for(settled)
                    left = _alive()
                finally:
                    gc.enable()
            finally:
                stages.disabled = False
            assert left == Counter(), f"request objects left for the collector: {dict(left)}"
            assert proxy.app.pipeline.fanout.failovers == {dead.url: 12}
    finally:
        proc.terminate()
        await proc.wait()
