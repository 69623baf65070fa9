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


@pytest.mark.parametrize("connector", ["nixl-push", "mooncake"])
@pytest.mark.parametrize("path", [MESSAGES, RESPONSES, GENERATE])
async def test_push_connectors(path, connector):
    sim = sim_config(kv_connector=connector)
    body = body_for(path, stream=True)
    rid = [(b"x-request-id", b"push-1")]
    async with single(sim) as one:
        alone = await one.post(path, body, rid)
    async with stack(sim=sim) as (cluster, proxy, client):
        reply = await client.post(path, body, rid)
        assert reply.status == 200, reply.body
        assert text_of(path, reply) == text_of(path, alone)
        assert cluster.instances("decode")[0].stats.local_prefills == 0


def not_disaggregated(metrics: bytes, reason: str) -> float:
    key = b'epd_proxy_not_disaggregated_total{reason="%s"} ' % reason.encode()
    at = metrics.find(key)
    return float(metrics[at + len(key):metrics.find(b"\n", at)]) if at >= 0 else 0.0


async def test_responses_store_through_the_proxy():
    """Retrieve, follow-up and cancel reach the decode that holds the response; a follow-up
    goes there alone, without a prefill."""
    sim = sim_config()
    async with stack(sim=sim, decode=2) as (cluster, proxy, client):
        first = await client.post(RESPONSES, body_for(RESPONSES, "the first turn"))
        assert first.status == 200, first.body
        rid = first.json()["id"]
        owner = next(i for i in cluster.instances("decode") if i.records and i.records[-1].path == RESPONSES)
        direct = Client(cluster.urls("prefill")[0])  # the prefill stored nothing (``store: false``)
        try:
            assert (await direct.request("GET", f"/v1/responses/{rid}")).status == 404
        finally:
            await direct.close()
        history = [{"role": "user", "content": "the first turn"},
                   {"role": "assistant", "content": text_of(RESPONSES, first)}]
        for _ in range(3):  # whichever decode the pool would pick
            got = await client.request("GET", f"/v1/responses/{rid}")
            assert got.status == 200 and got.json() == first.json()
        prefills = len(cluster.records("prefill"))
        follow = body_for(RESPONSES, "and the second", previous_response_id=rid)
        for stream in (False, True):
            reply = await client.post(RESPONSES, dict(follow, stream=stream))
            assert reply.status == 200, reply.body
            assert owner.records[-1].json["previous_response_id"] == rid
            assert text_of(RESPONSES, reply) == expected_text(responses_chat(follow, history))
        assert len(cluster.records("prefill")) == prefills  # no prefill for a follow-up
        metrics = (await client.request("GET", "/metrics")).body
        assert not_disaggregated(metrics, "previous_response_id") == 2
        assert b'endpoint="/v1/responses/{id}",status="200"' in metrics
        cancel = await client.post(f"/v1/responses/{rid}/cancel", b"")
        assert cancel.status == 400 and b"synchronous" in cancel.body  # the owner's answer, relayed
        missing = await client.request("GET", "/v1/responses/resp_nobody")
        assert missing.status == 404 and b"resp_nobody" in missing.body
        assert (await client.request("DELETE", f"/v1/responses/{rid}")).status == 404


async def test_an_id_this_proxy_does_not_know_is_asked_of_every_decode():
    """Another proxy (or --workers process) relayed the response: it is still found."""
    from epd_proxy import ProxyConfig, start_proxy
    from epd_proxy.runtime.serve import config_for_cluster
    async with stack(sim=sim_config(), decode=3) as (cluster, proxy, client):
        first = await client.post(RESPONSES, body_for(RESPONSES, "kept somewhere"))
        rid = first.json()["id"]
        other = await start_proxy(config_for_cluster(cluster, ProxyConfig(probe_interval=0, scrape_interval=0)))
        async with other:
            c2 = Client(other.url)
            try:
                got = await c2.request("GET", f"/v1/responses/{rid}")
                assert got.status == 200 and got.json()["id"] == rid
                follow = await c2.post(RESPONSES, body_for(RESPONSES, "more", previous_response_id=rid))
                assert follow.status == 200, follow.body
            finally:
                await c2.close()


async def test_background_response_is_served_whole():
    async with stack(sim=sim_config()) as (cluster, proxy, client):
        reply = await client.post(RESPONSES, body_for(RESPONSES, background=True))
        assert reply.status == 200 and reply.json()["status"] == "queued"
        assert not cluster.records("prefill")
        metrics = (await client.request("GET", "/metrics")).body
        assert not_disaggregated(metrics, "background") == 1


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
IMAGE_URL = "https://example.com/fish.png"


def media_body(path: str, source: str, stream: bool = False) -> dict:
    """A request with one image: an Anthropic block (base64 or URL source) or an input_image."""
    if path == MESSAGES:
        src = ({"type": "base64", "media_type": "image/png", "data": PNG} if source == "base64"
               else {"type": "url", "url": IMAGE_URL})
        content = [{"type": "text", "text": "what is this"}, {"type": "image", "source": src}]
        return {"model": "sim-model", "max_tokens": 5, "stream": stream,
                "messages": [{"role": "user", "content": content}]}
    url = f"data:image/png;base64,{PNG}" if source == "base64" else IMAGE_URL
    return {"model": "sim-model", "max_output_tokens": 5, "stream": stream, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what is this"},
                                     {"type": "input_image", "image_url": url}]}]}


MEDIA_TOPOLOGIES = {"e+p+d": dict(encode=1, prefill=1, decode=1), "e+pd": dict(encode=1, prefill=0, decode=0, pd=1)}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("topology", list(MEDIA_TOPOLOGIES))
@pytest.mark.parametrize("path,source", [(MESSAGES, "base64"), (MESSAGES, "url"), (RESPONSES, "base64"),
                                         (RESPONSES, "url")])
async def test_media_goes_through_the_encoders(path, source, topology, stream):
    """An Anthropic image block or an input_image is encoded on an encoder (a chat sub-request
    with the image_url part vLLM makes of it); the consumer gets the API's own body with the
    encoder's ec_transfer_params and finds the encoder output; the client's answer is one
    instance's, byte for byte."""
    sim = sim_config()
    body = media_body(path, source, stream)
    rid = [(b"x-request-id", b"media-1")]
    async with single(sim) as one:
        alone = await one.post(path, body, rid)
    assert alone.status == 200, alone.body
    async with stack(sim=sim, **MEDIA_TOPOLOGIES[topology]) as (cluster, proxy, client):
        reply = await client.post(path, body, rid)
        assert reply.status == 200, reply.body
        assert reply.body == alone.body
        assert text_of(path, reply) == expected(path, body)
        [enc] = cluster.records("encode")
        assert enc.path == "/v1/chat/completions"
        url = f"data:image/png;base64,{PNG}" if source == "base64" else IMAGE_URL
        assert enc.json["messages"] == [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        consumer_role = "prefill" if topology == "e+p+d" else "pd"
        consumer = cluster.records(consumer_role)[-1]
        assert consumer.path == path
        assert consumer.json.get("messages", consumer.json.get("input")) == body.get("messages", body.get("input"))
        assert consumer.json["ec_transfer_params"]["ec_items"]
        stats = cluster.instances(consumer_role)[0].stats
        assert stats.ec_hits == 1 and stats.local_encodes == 0
        if topology == "e+p+d":
            assert cluster.instances("decode")[0].stats.kv_pulls == 1
        metrics = (await client.request("GET", "/metrics")).body
        assert not_disaggregated(metrics, "media") == 0
        assert b"ec_transfer_params" not in reply.body or b'"ec_transfer_params":null' in reply.body


@pytest.mark.parametrize("path", [MESSAGES, RESPONSES])
async def test_media_rules_hold_and_an_uploaded_file_is_served_whole(path):
    body = media_body(path, "url")
    async with stack(sim=sim_config(), encode=1) as (cluster, proxy, client):
        # The operator's media rules hold for these APIs too.
        bad = msgspec.json.decode(msgspec.json.encode(body).replace(b"https://example.com", b"http://127.0.0.1"))
        refused = await client.post(path, bad)
        assert refused.status == 400 and b"media" in refused.body
        if path == RESPONSES:
            # An uploaded file's id: no URL an encoder could load; served whole, and counted.
            part = body["input"][0]["content"][1]
            del part["image_url"]
            part["file_id"] = "file-123"
            reply = await client.post(path, body)
            async with single(sim_config()) as one:
                alone = await one.post(path, body)
            assert (reply.status, reply.body) == (alone.status, alone.body)  # the instance's own answer
            assert not cluster.records("encode") and not cluster.records("prefill")
            assert cluster.records("decode")[-1].path == path
            metrics = (await client.request("GET", "/metrics")).body
            assert not_disaggregated(metrics, "media") == 1


async def test_media_in_p_d_is_disaggregated():
    content = [{"type": "text", "text": "look"},
               {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]
    body = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    async with stack(sim=sim_config()) as (cluster, proxy, client):
        reply = await client.post(MESSAGES, body)
        assert reply.status == 200 and text_of(MESSAGES, reply) == expected(MESSAGES, body)
        assert cluster.instances("decode")[0].stats.kv_pulls == 1


@pytest.mark.parametrize("path", [MESSAGES, RESPONSES, GENERATE])
async def test_a_failure_before_the_first_output_is_retried(path):
    """Decode fails before its first token (vLLM: message_start then ``event: error``; the
    Responses stream broken off; generate's in-band error): another attempt, not the client's."""
    async with stack(sim=sim_config()) as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("error-after=0", times=1)
        body = body_for(path, stream=True)
        reply = await client.post(path, body)
        assert reply.status == 200, reply.body
        assert len(cluster.records("prefill")) == 2 and len(cluster.records("decode")) == 2
        if expected(path, body) is not None:
            assert text_of(path, reply) == expected(path, body)
        assert reply.body.find(b"error") < 0


@pytest.mark.parametrize("path", [MESSAGES, RESPONSES, GENERATE])
async def test_in_band_error_after_the_commit_is_in_the_apis_form(path):
    async with stack(sim=sim_config(), decode_retries=0) as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        reply = await client.post(path, body_for(path, stream=True))
        assert reply.status == 200
        if path == MESSAGES:
            name, data = named(reply.body)[-1]
            # Anthropic's type for the proxy's 502 (vLLM's own says ``internal_error``).
            assert name == "error" and data["type"] == "error" and data["error"]["type"] == "api_error"
            assert b"[DONE]" not in reply.body
        elif path == RESPONSES:
            events = named(reply.body)
            (name, data), (failed, end) = events[-2:]
            assert name == "error" and data["type"] == "error" and data["code"] == "server_error"
            assert data["sequence_number"] == events[-3][1]["sequence_number"] + 1
            created = events[0][1]["response"]
            assert failed == "response.failed" and end["sequence_number"] == data["sequence_number"] + 1
            assert end["response"]["id"] == created["id"] and end["response"]["status"] == "failed"
            assert end["response"]["error"] == {"code": "server_error", "message": data["message"]}
        else:
            assert reply.body.endswith(b"data: [DONE]\n\n")
            assert b'data: {"error":' in reply.body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [MESSAGES, RESPONSES])
async def test_token_metrics_count_these_apis(path, stream):
    """The token metrics (and the access log, from the same reading) count Messages and
    Responses answers from their own usage fields."""
    async with stack(sim=sim_config()) as (cluster, proxy, client):
        reply = await client.post(path, body_for(path, stream=stream))
        assert reply.status == 200
        metrics = (await client.request("GET", "/metrics")).body
        assert b'epd_proxy_completion_tokens_total{model="sim-model"} 7.0' in metrics, metrics
        key = b'epd_proxy_prompt_tokens_total{model="sim-model"} '
        at = metrics.index(key) + len(key)
        assert float(metrics[at:metrics.index(b"\n", at)]) > 0
