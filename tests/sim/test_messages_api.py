"""``POST /v1/messages`` (Anthropic), as vLLM 0.32 serves it: shapes, events, media, errors, P/D."""

from __future__ import annotations

import asyncio

import pytest
from simhelpers import chat_body, fast_config, named_events, nixl_prefill_params, push_decode_params

from epd_proxy.sim import SimCluster, expected_text, prompt_tokens
from epd_proxy.sim.messages import to_chat
from epd_proxy.sim.tokens import expected_tokens

PATH = "/v1/messages"


def messages_body(text: str = "tell me about the messages api", **kw) -> dict:
    body = {"model": "sim-model", "max_tokens": 6, "messages": [{"role": "user", "content": text}]}
    body.update(kw)
    return body


def text_of(reply) -> str:
    if reply.headers[b"content-type"].startswith(b"text/event-stream"):
        return "".join(d["delta"]["text"] for name, d in named_events(reply.data) if name == "content_block_delta")
    return "".join(b["text"] for b in reply.json["content"])


async def test_non_stream_shape(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        body = messages_body(system="be brief")
        r = await http.post(c.urls("pd")[0], PATH, body, headers=[(b"x-request-id", b"m-1")])
        assert r.status == 200
        chat = to_chat(body)
        assert r.json == {"id": "chatcmpl-m-1", "type": "message", "role": "assistant",
                          "content": [{"type": "text", "text": expected_text(chat)}], "model": "sim-model",
                          "stop_reason": "max_tokens",
                          "usage": {"input_tokens": prompt_tokens(chat), "output_tokens": 6}}
        # The same prompt through chat gives the same text.
        r2 = await http.chat(c.urls("pd")[0], chat_body("tell me about the messages api", max_tokens=6,
                                                        messages=chat["messages"]))
        assert r2.json["choices"][0]["message"]["content"] == text_of(r)


async def test_stream_named_events(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        body = messages_body(max_tokens=4, stream=True)
        r = await http.post(c.urls("pd")[0], PATH, body, headers=[(b"x-request-id", b"m-2")])
        assert r.status == 200 and r.headers[b"content-type"].startswith(b"text/event-stream")
        assert b"[DONE]" not in r.data
        evs = named_events(r.data)
        names = [n for n, _ in evs]
        assert names == ["message_start", "content_block_start"] + ["content_block_delta"] * 4 + [
            "content_block_stop", "message_delta", "message_stop"]
        assert all(d["type"] == n for n, d in evs)
        chat = to_chat(body)
        p = prompt_tokens(chat)
        assert evs[0][1] == {"type": "message_start", "message": {
            "id": "chatcmpl-m-2", "type": "message", "role": "assistant", "content": [], "model": "sim-model",
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": p, "output_tokens": 0}}}
        assert evs[1][1] == {"type": "content_block_start", "content_block": {"type": "text", "text": ""},
                             "index": 0}
        assert evs[-3][1] == {"type": "content_block_stop", "index": 0}
        assert evs[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                              "usage": {"input_tokens": p, "output_tokens": 4}}
        assert evs[-1][1] == {"type": "message_stop"}
        assert text_of(r) == expected_text(chat)


async def test_image_blocks_are_media(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        url = "https://example.com/cat.png"
        content = [{"type": "text", "text": "what is this"},
                   {"type": "image", "source": {"type": "url", "url": url}},
                   {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}]
        body = messages_body(messages=[{"role": "user", "content": content}])
        chat = to_chat(body)
        parts = chat["messages"][0]["content"]
        assert parts[1] == {"type": "image_url", "image_url": {"url": url}}
        assert parts[2] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
        r = await http.post(c.urls("pd")[0], PATH, body)
        assert r.status == 200
        assert r.json["usage"]["input_tokens"] == prompt_tokens(chat) > 1 + 3 + 2
        assert text_of(r) == expected_text(chat)
        assert c.instances("pd")[0].stats.local_encodes == 2


async def test_errors_in_anthropic_envelope(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        url = c.urls("pd")[0]
        r = await http.post(url, PATH, messages_body(model="nope"))
        assert r.status == 404
        assert r.json == {"type": "error", "error": {
            "type": "NotFoundError", "message": "The model `nope` does not exist. Valid aliases: sim-model."}}
        # A schema error is answered by vLLM's handler for all routes, in its own envelope.
        body = messages_body()
        del body["max_tokens"]
        r = await http.post(url, PATH, body)
        assert r.status == 400 and r.json["error"]["param"] == "body.max_tokens"
        # A generation failure: 500 in the envelope; in a stream, an error event and no message_stop.
        r = await http.post(url, PATH, messages_body(sim_fault="error-after=0"))
        assert r.status == 500
        assert r.json == {"type": "error", "error": {"type": "InternalServerError", "message": "Internal server error"}}
        r = await http.post(url, PATH, messages_body(stream=True, sim_fault="error-after=2"))
        names = [n for n, _ in named_events(r.data)]
        assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                         "error"]
        assert named_events(r.data)[-1][1]["error"]["type"] == "internal_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_then_decode_equals_one_instance(http, stream):
    async with SimCluster(prefill=1, decode=1, pd=1, config=fast_config()) as c:
        body = messages_body("a prompt that is split between prefill and decode", max_tokens=7, stream=stream)
        alone = await http.post(c.urls("pd")[0], PATH, body)
        pre = dict(body, max_tokens=1, stream=False, kv_transfer_params=nixl_prefill_params())
        rp = await http.post(c.urls("prefill")[0], PATH, pre, headers=[(b"x-request-id", b"pd-1")])
        assert rp.status == 200
        kv = rp.json["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_block_ids"]
        assert kv["remote_request_id"].startswith("chatcmpl-pd-1-")
        rd = await http.post(c.urls("decode")[0], PATH, dict(body, kv_transfer_params=kv))
        assert rd.status == 200
        assert text_of(rd) == text_of(alone) == expected_text(to_chat(body))
        assert c.instances("decode")[0].stats.kv_pulls == 1
        assert c.instances("decode")[0].stats.local_prefills == 0
        assert c.held_kv_blocks == 0
        if not stream:
            assert "kv_transfer_params" not in rd.json  # exclude_none: vLLM leaves the field out


async def test_push_connector(http):
    async with SimCluster(prefill=1, decode=1, pd=1, config=fast_config(kv_connector="nixl-push")) as c:
        body = messages_body("pushed from prefill to decode", max_tokens=5)
        alone = await http.post(c.urls("pd")[0], PATH, body)
        pre = dict(body, max_tokens=1, kv_transfer_params=dict(nixl_prefill_params(), transfer_id="t-1"))
        d = dict(body, kv_transfer_params=push_decode_params(c.prefill_identity(0), "t-1"))
        rp, rd = await asyncio.gather(http.post(c.urls("prefill")[0], PATH, pre),
                                      http.post(c.urls("decode")[0], PATH, d))
        assert rp.status == 200 and rp.json["kv_transfer_params"]["transfer_mode"] == "push"
        assert rd.status == 200 and text_of(rd) == text_of(alone)
        assert c.held_kv_blocks == 0


async def test_count_tokens(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        body = messages_body(system="count me")
        del body["max_tokens"]
        r = await http.post(c.urls("pd")[0], PATH + "/count_tokens", body)
        assert r.status == 200 and r.json == {"input_tokens": prompt_tokens(to_chat(body, count_only=True))}
        r = await http.post(c.urls("pd")[0], PATH + "/count_tokens", {"model": "sim-model"})
        assert r.status == 400 and r.json["error"]["param"] == "body.messages"
        assert c.instances("pd")[0].stats.requests == 0  # not a generation


async def test_encode_prefill_decode_with_an_image(http):
    async with SimCluster(encode=1, prefill=1, decode=1, pd=1, config=fast_config()) as c:
        content = [{"type": "text", "text": "what is in the picture"},
                   {"type": "image", "source": {"type": "url", "url": "https://example.com/fish.png"}}]
        body = messages_body(messages=[{"role": "user", "content": content}], max_tokens=5)
        alone = await http.post(c.urls("pd")[0], PATH, body)
        re = await http.post(c.urls("encode")[0], PATH, body)
        assert re.status == 200 and text_of(re) == "" and re.json["usage"]["output_tokens"] == 0
        ec = re.json["ec_transfer_params"]
        pre = dict(body, max_tokens=1, kv_transfer_params=nixl_prefill_params(), ec_transfer_params=ec)
        rp = await http.post(c.urls("prefill")[0], PATH, pre)
        assert rp.status == 200 and c.instances("prefill")[0].stats.ec_hits == 1
        rd = await http.post(c.urls("decode")[0], PATH, dict(body, kv_transfer_params=rp.json["kv_transfer_params"]))
        assert text_of(rd) == text_of(alone) == expected_text(to_chat(body))
        assert c.instances("decode")[0].stats.local_encodes == 0


async def test_cache_read_tokens_with_prompt_tokens_details(http):
    """vLLM 0.32 (``_build_anthropic_usage``): with ``--enable-prompt-tokens-details`` the final
    usage has ``cache_read_input_tokens`` even at 0, and ``input_tokens`` leaves them out;
    ``message_start`` has the whole prompt and no cache fields; without the flag, none."""
    long = " ".join(f"word{i}" for i in range(80))
    async with SimCluster(pd=1, config=fast_config(prompt_tokens_details=True)) as c:
        url = c.urls("pd")[0]
        first = await http.post(url, PATH, messages_body(long + " one"))
        assert first.json["usage"]["cache_read_input_tokens"] == 0
        second = await http.post(url, PATH, messages_body(long + " two", stream=True))
        events = named_events(second.data)
        start = next(d for n, d in events if n == "message_start")["message"]["usage"]
        end = next(d for n, d in events if n == "message_delta")["usage"]
        assert set(start) == {"input_tokens", "output_tokens"}
        assert end["cache_read_input_tokens"] >= 64
        assert end["input_tokens"] + end["cache_read_input_tokens"] == start["input_tokens"]
    async with SimCluster(pd=1, config=fast_config()) as c:
        r = await http.post(c.urls("pd")[0], PATH, messages_body(long))
        assert "cache_read_input_tokens" not in r.json["usage"]


async def test_a_stream_merges_tokens_into_deltas(http):
    async with SimCluster(pd=1, config=fast_config(stream_merge=2)) as c:
        body = messages_body(max_tokens=5, stream=True)
        reply = await http.post(c.urls("pd")[0], "/v1/messages", body)
        deltas = [d["delta"]["text"] for name, d in named_events(reply.data) if name == "content_block_delta"]
        tokens = expected_tokens(to_chat(body))
        assert deltas == ["".join(tokens[0:2]), "".join(tokens[2:4]), tokens[4]]
        names = [name for name, _ in named_events(reply.data)]
        assert names.count("message_start") == 1 and names[-1] == "message_stop"
