"""The sidecar's ``/metrics`` is its decode's (llm-d's convention for the pod's served port), so
an endpoint picker scraping the pod weighs vLLM's queue and KV cache; the sidecar's own families
are at ``/sidecar/metrics``. Real sockets: a simulated decode, ``epd-proxy sidecar`` over it and
``epd-proxy epp`` scraping the sidecar."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
from helpers import Client, chat_body
from procs import free_port

from epd_proxy.api.decode_metrics import SIDECAR_METRICS
from epd_proxy.config import InstanceSpec, ProxyConfig
from epd_proxy.instances.load_signals import gauge_samples
from epd_proxy.runtime.sidecar import start_sidecar
from epd_proxy.sim import SimCluster, SimConfig

GPU_BLOCKS = 96


def _sidecar_config(decode: str, **kw) -> ProxyConfig:
    return ProxyConfig(probe_interval=0, scrape_interval=0, decode=[InstanceSpec(decode, "decode")], **kw)


async def _get(url: str, path: str, headers=None):
    client = Client(url)
    try:
        return await client.request("GET", path, headers=headers)
    finally:
        await client.close()


async def _until(check, timeout: float = 10.0):
    """Poll the coroutine function ``check`` until it returns something true; that value."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        got = await check()
        if got:
            return got
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.05)


async def test_the_picker_scraping_a_sidecar_weighs_its_decodes_queue_and_kv_cache():
    """Three requests straight to the decode, one running and two waiting (max_num_seqs 1): the
    picker, which placed none of them, sees them through the sidecar's /metrics as that decode's
    load, with its KV cache's use and size as vLLM's gauges give them."""
    pytest.importorskip("grpc")
    pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
    from epd_proxy.runtime.build import start_epp

    sim = SimConfig(itl_ms=20, ttft_ms=0.5, max_num_seqs=1, num_gpu_blocks=GPU_BLOCKS)
    async with SimCluster(decode=1, config=sim) as cluster:
        decode = cluster.urls("decode")[0]
        async with await start_sidecar(_sidecar_config(decode)) as sidecar:
            epp = await start_epp(ProxyConfig(probe_interval=0, scrape_interval=0.05,  # decode: load-aware
                                              decode=[InstanceSpec(sidecar.url, "decode")]))
            busy = Client(decode)
            try:
                tasks = [asyncio.create_task(busy.chat(chat_body(f"busy {i} " + "word " * 40, max_tokens=400)))
                         for i in range(3)]
                engine = cluster.instances("decode")[0].engine

                async def queued():
                    return engine.num_running == 1 and engine.num_waiting == 2

                await _until(queued)

                async def seen():
                    reply = await _get(epp.proxy.url, "/console/api/state")
                    [view] = [i for i in msgspec.json.decode(reply.body)["instances"] if i["url"] == sidecar.url]
                    load = view["load"]
                    return load if load is not None and load["waiting"] == 2 else None

                load = await _until(seen)
                assert load["others"] == 3  # running + waiting, none of them the picker's
                assert load["kv_blocks"] == GPU_BLOCKS  # vllm:cache_config_info's num_gpu_blocks
                vllm = (await _get(decode, "/metrics")).body
                [usage] = gauge_samples(vllm, b"vllm:kv_cache_usage_perc")
                # The prompts' blocks, then more as the stream grows (shown to 6 places).
                assert 0 < load["kv_usage"] <= usage + 1e-6
                [inst] = epp.app.pools["decode"].instances
                assert inst.signals.load == 3  # what the load-aware score adds to the picker's own count
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await busy.close()
                await epp.close()


async def test_metrics_is_the_decodes_as_it_answers_and_the_sidecars_own_are_beside_it():
    async with SimCluster(decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        decode = cluster.instances("decode")[0]
        async with await start_sidecar(_sidecar_config(decode.url)) as sidecar:
            accept = b"text/plain;version=0.0.4;q=0.5,*/*;q=0.1"  # what a scraper negotiates reaches vLLM
            reply = await _get(sidecar.url, "/metrics", [(b"accept", accept)])
            assert reply.status == 200
            assert reply.headers[b"content-type"] == b"text/plain; version=0.0.4; charset=utf-8"
            text = reply.body.decode()
            assert "vllm:num_requests_waiting{" in text and "vllm:kv_cache_usage_perc{" in text
            assert "epd_proxy_" not in text
            [scrape] = [r for r in decode.records if r.path == "/metrics"]
            assert scrape.headers.get("accept") == accept.decode()
            head = await Client(sidecar.url).request("HEAD", "/metrics")
            assert head.status == 200 and head.body == b""
            own = await _get(sidecar.url, SIDECAR_METRICS)
            assert own.status == 200 and "epd_proxy_instance_healthy{" in own.body.decode()
            assert "vllm:" not in own.body.decode()


async def test_the_decodes_metrics_open_the_sidecars_own_behind_the_admin_key():
    """vLLM's exposition names no instance: open, as vLLM's own, to the pickers that scrape it
    with no key; the sidecar's own (its labels are the instances' URLs) need the admin key."""
    async with SimCluster(decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        config = _sidecar_config(cluster.urls("decode")[0], api_keys=("client-key",), admin_api_key="admin-key")
        async with await start_sidecar(config) as sidecar:
            assert (await _get(sidecar.url, "/metrics")).status == 200
            refused = await _get(sidecar.url, SIDECAR_METRICS)
            assert refused.status == 401
            assert msgspec.json.decode(refused.body)["error"]["message"].startswith("/sidecar/metrics needs the admin")
            assert (await _get(sidecar.url, SIDECAR_METRICS, [(b"authorization", b"Bearer client-key")])).status == 401
            assert (await _get(sidecar.url, SIDECAR_METRICS, [(b"x-api-key", b"admin-key")])).status == 200


async def test_a_decode_that_does_not_answer_its_metrics_is_a_bounded_error_and_the_sidecars_own_still_answer():
    async def silent(reader, writer):  # reads the request, never answers
        with contextlib.suppress(Exception):
            await reader.read()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for decode, status in ((f"http://127.0.0.1:{port}", 504), (f"http://127.0.0.1:{free_port()}", 502)):
            async with await start_sidecar(_sidecar_config(decode, probe_timeout=0.3)) as sidecar:
                loop = asyncio.get_running_loop()
                started = loop.time()
                reply = await _get(sidecar.url, "/metrics")
                assert reply.status == status, reply.body
                assert loop.time() - started < 2.0
                assert "the decode's /metrics" in msgspec.json.decode(reply.body)["error"]["message"]
                own = await _get(sidecar.url, SIDECAR_METRICS)
                assert own.status == 200 and b"epd_proxy_requests" in own.body
    finally:
        server.close()
        await server.wait_closed()
