"""/v1/messages, /v1/responses and /inference/v1/generate through the proxy, over loopback,
against the simulator: the client's answer is one instance's, byte for byte, in every
topology; the per-API prefill limit; the commit point and the in-band errors in each
API's own form; the Responses store through the proxy."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from helpers import Client, stack

from epd_proxy.sim import SimCluster, SimConfig, expected_text
from epd_proxy.sim.messages import to_chat as messages_chat
from epd_proxy.sim.responses_api import to_chat as responses_chat

MESSAGES, RESPONSES, GENERATE = "/v1/messages", "/v1/responses", "/inference/v1/generate"


def sim_config(**kw) -> SimConfig:
    base = dict(itl_ms=0, ttft_ms=0.5, created=1_700_000_000, enable_scale_out=True, record_responses=True)
    base.update(kw)
    return SimConfig(**base)


def body_for(path: str, text: str = "say something about disaggregated serving", n: int = 7, **kw) -> dict:
    if path == MESSAGES:
        body: dict = {"model": "sim-model", "max_tokens": n, "messages": [{"role": "user", "content": text}]}
    elif path == RESPONSES:
        body = {"model": "sim-model", "input": text, "max_output_tokens": n}
    else:
        body = {"model": "sim-model", "token_ids": [3, 14, 15, 92, 65, 35], "sampling_params": {"max_tokens": n}}
    body.update(kw)
    return body


def named(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in data.split(b"\n\n"):
        if block:
            head, _, payload = block.partition(b"\n")
            assert head.startswith(b"event: ") and payload.startswith(b"data: "), block
            out.append((head[7:].decode(), msgspec.json.decode(payload[6:])))
    return out


def text_of(path: str, reply) -> str:
    stream = reply.headers[b"content-type"].startswith(b"text/event-stream")
    if path == MESSAGES:
        if stream:
            return "".join(d["delta"]["text"] for n, d in named(reply.body) if n == "content_block_delta")
        return "".join(b["text"] for b in reply.json()["content"])
    if path == RESPONSES:
        if stream:
            return "".join(d["delta"] for n, d in named(reply.body) if n == "response.output_text.delta")
        return "".join(p["text"] for item in reply.json()["output"] for p in item["content"])
    if stream:
        ids = []
        for event in reply.body.split(b"\n\n"):
            if event.startswith(b"data: {"):
                for c in msgspec.json.decode(event[6:])["choices"]:
                    ids += c["token_ids"]
        return repr(ids)
    return repr(reply.json()["choices"][0]["token_ids"])


def expected(path: str, body: dict) -> str | None:
    if path == MESSAGES:
        return expected_text(messages_chat(body))
    if path == RESPONSES:
        return expected_text(responses_chat(body))
    return None  # token ids: compared with the single instance's


@contextlib.asynccontextmanager
async def single(sim: SimConfig):
    """One plain instance: what a client of one vLLM would get."""
    async with SimCluster(pd=1, config=sim) as cluster:
        client = Client(cluster.urls("pd")[0])
        try:
            yield client
        finally:
            await client.close()


TOPOLOGIES = {"pd": dict(prefill=0, decode=0, pd=1), "p/d": dict(prefill=1, decode=1)}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
@pytest.mark.parametrize("path", [MESSAGES, RESPONSES, GENERATE])
async def test_answer_is_one_instances_byte_for_byte(path, topology, stream):
    sim = sim_config()
    body = body_for(path, stream=stream)
    rid = [(b"x-request-id", b"same-id-1")]
    async with single(sim) as one:
        alone = await one.post(path, body, rid)
    assert alone.status == 200, alone.body
    async with stack(sim=sim, **TOPOLOGIES[topology]) as (cluster, proxy, client):
        reply = await client.post(path, body, rid)
        assert reply.status == 200, reply.body
        assert reply.headers[b"content-type"] == alone.headers[b"content-type"]
        assert reply.body == alone.body
        assert text_of(path, reply) == text_of(path, alone)
        if expected(path, body) is not None:
            assert text_of(path, reply) == expected(path, body)
        assert reply.body.find(b'"do_remote') < 0  # no kv_transfer_params of the proxy's reach the client
        assert reply.headers[b"x-request-id"] == b"same-id-1"
        if topology == "p/d":
            p, d = cluster.records("prefill")[-1], cluster.records("decode")[-1]
            assert p.path == d.path == path
            assert p.json["stream"] is False and p.json["kv_transfer_params"]["do_remote_decode"] is True
            if path == MESSAGES:
                assert p.json["max_tokens"] == 1 and d.json["max_tokens"] == 7
            elif path == RESPONSES:
                assert p.json["max_output_tokens"] == 1 and p.json["store"] is False
                assert d.json["max_output_tokens"] == 7 and "store" not in d.json
            else:
                assert p.json["sampling_params"] == {"max_tokens": 1}
                assert d.json["sampling_params"] == {"max_tokens": 7}
            assert d.json["kv_transfer_params"]["do_remote_prefill"] is True
            decode = cluster.instances("decode")[0]
            assert decode.stats.kv_pulls == 1 and decode.stats.local_prefills == 0
            assert cluster.held_kv_blocks == 0
            assert reply.headers[b"server-timing"].startswith(b"prefill;dur=")
        metrics = (await client.request("GET", "/metrics")).body
        assert b'epd_proxy_requests_total{endpoint="%s",status="200"} 1.0' % path.encode() in metrics
