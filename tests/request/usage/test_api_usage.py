"""The client's usage for a P/D Messages or Responses request: the pure rewrite in each API's
fields, and what clients get through the proxy from simulated prefill/decode instances whose
prefill found a prefix in its cache and whose decode does not report it."""

from __future__ import annotations

import msgspec
import pytest
from helpers import stack

from epd_proxy.request.usage.api_fields import (
    messages_usage,
    prompt_side_same,
    responses_usage,
    rewrite_api_usage,
    rewrite_usage_events,
)
from epd_proxy.request.usage.rewrite import PrefillReport
from epd_proxy.sim import SimConfig

MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"


def report(usage: dict | None) -> PrefillReport:
    return PrefillReport(msgspec.json.encode(usage), b"null")


def responses_usage_obj(inp: int, cached: int, out: int) -> dict:
    return {"input_tokens": inp,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0,
                                     "input_tokens_per_turn": [inp], "cached_tokens_per_turn": [cached]},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [out], "tool_output_tokens_per_turn": [0]},
            "total_tokens": inp + out}


# -- the pure rewrite -------------------------------------------------------------------------
def test_messages_take_the_prompt_side_from_prefill_and_the_output_from_decode():
    decode = {"input_tokens": 0, "output_tokens": 8, "cache_read_input_tokens": 40}  # all loaded
    prefill = {"input_tokens": 8, "output_tokens": 1, "cache_read_input_tokens": 32}
    assert messages_usage(decode, prefill) == {"input_tokens": 8, "output_tokens": 8, "cache_read_input_tokens": 32}
    # A prefill that reports no cache fields (no --enable-prompt-tokens-details): none reach the client.
    assert messages_usage(decode, {"input_tokens": 40, "output_tokens": 1}) == {"input_tokens": 40,
                                                                                 "output_tokens": 8}
    # Decode without the fields, prefill with: the order is vLLM's (AnthropicUsage's fields).
    out = messages_usage({"input_tokens": 40, "output_tokens": 8},
                         {"input_tokens": 8, "output_tokens": 1, "cache_read_input_tokens": 32})
    assert list(out) == ["input_tokens", "output_tokens", "cache_read_input_tokens"]
    # Right already, or nothing known about the prefill: unchanged.
    assert messages_usage({"input_tokens": 8, "output_tokens": 8}, {"input_tokens": 8, "output_tokens": 1}) is None
    assert messages_usage(decode, None) is None and messages_usage(decode, {"output_tokens": 1}) is None


def test_responses_take_input_and_details_from_prefill_and_the_total_adds_up():
    decode = responses_usage_obj(40, 40, 8)
    prefill = responses_usage_obj(40, 32, 1)
    out = responses_usage(decode, prefill)
    assert out == responses_usage_obj(40, 32, 8) and list(out) == list(decode)
    assert responses_usage(responses_usage_obj(40, 32, 8), prefill) is None


def test_only_the_usage_bytes_change():
    text = 'a "usage":{"input_tokens":1} and }{'
    body = (b'{"id":"msg_1","type":"message","content":[{"type":"text","text":' + msgspec.json.encode(text)
            + b'}],"stop_reason":"max_tokens","usage":{"input_tokens":0,"output_tokens":8,'
            b'"cache_read_input_tokens":40},"kv_transfer_params":null}')
    out = rewrite_api_usage(body, report({"input_tokens": 8, "output_tokens": 1, "cache_read_input_tokens": 32}),
                            messages_usage, True)
    new = b'{"input_tokens":8,"output_tokens":8,"cache_read_input_tokens":32}'
    assert out == body.replace(b'{"input_tokens":0,"output_tokens":8,"cache_read_input_tokens":40}', new)
    assert msgspec.json.decode(out)["content"][0]["text"] == text
    # Unreadable prefill usage, or an answer without usage: as received.
    assert rewrite_api_usage(body, PrefillReport(b"null", b"null"), messages_usage, True) is body
    assert rewrite_api_usage(b'{"id":"x"}', report({"input_tokens": 1}), messages_usage, True) == b'{"id":"x"}'


def test_only_the_named_event_is_rewritten():
    usage = b'{"input_tokens":40,"output_tokens":0}'
    events = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":' + usage + b'}}\n\n'
              b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"x"}}\n\n'
              b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
              b'"usage":{"input_tokens":0,"output_tokens":8,"cache_read_input_tokens":40}}\n\n'
              b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    out = rewrite_usage_events(events, report({"input_tokens": 40, "output_tokens": 1}), b"message_delta",
                               messages_usage, True)
    assert out == events.replace(b'"usage":{"input_tokens":0,"output_tokens":8,"cache_read_input_tokens":40}',
                                 b'"usage":{"input_tokens":40,"output_tokens":8}')
    assert rewrite_usage_events(events, report({"input_tokens": 40}), b"response.completed", messages_usage,
                                True) is events


def test_a_usage_whose_prompt_side_is_the_prefills_is_read_from_its_bytes():
    enc = msgspec.json.encode
    # Anthropic: the cache fields follow the output count.
    d = enc({"input_tokens": 8, "output_tokens": 64, "cache_read_input_tokens": 32})
    assert prompt_side_same(d, enc({"input_tokens": 8, "output_tokens": 1, "cache_read_input_tokens": 32}), True)
    assert not prompt_side_same(d, enc({"input_tokens": 8, "output_tokens": 1, "cache_read_input_tokens": 16}), True)
    assert not prompt_side_same(d, enc({"input_tokens": 8, "output_tokens": 1}), True)
    short = enc({"input_tokens": 8, "output_tokens": 1})
    assert prompt_side_same(enc({"input_tokens": 8, "output_tokens": 64}), short, True)
    assert not prompt_side_same(enc({"input_tokens": 40, "output_tokens": 64}), short, True)
    # Responses: only what precedes the output count is the prompt's.
    assert prompt_side_same(enc(responses_usage_obj(40, 32, 64)), enc(responses_usage_obj(40, 32, 1)), False)
    assert not prompt_side_same(enc(responses_usage_obj(40, 40, 64)), enc(responses_usage_obj(40, 32, 1)), False)
    assert not prompt_side_same(d, b"null", True)
    # ... and such an answer is returned as it is, undecoded.
    body = b'{"id":"r","usage":' + enc(responses_usage_obj(40, 32, 64)) + b'}'
    assert rewrite_api_usage(body, report(responses_usage_obj(40, 32, 1)), responses_usage, False) is body


# -- through the proxy ------------------------------------------------------------------------
LONG = " ".join(f"word{i}" for i in range(80))  # several 16-token blocks


def body_for(path: str, text: str, stream: bool) -> dict:
    if path == MESSAGES:
        return {"model": "sim-model", "max_tokens": 6, "stream": stream,
                "messages": [{"role": "user", "content": text}]}
    return {"model": "sim-model", "input": text, "max_output_tokens": 6, "stream": stream}


def named(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in data.split(b"\n\n"):
        if block:
            head, _, payload = block.partition(b"\n")
            out.append((head[7:].decode(), msgspec.json.decode(payload[6:])))
    return out


def final_usage(path: str, reply, stream: bool) -> dict:
    if not stream:
        return reply.json()["usage"]
    events = named(reply.body)
    if path == MESSAGES:
        return [d["usage"] for n, d in events if n == "message_delta"][-1]
    return next(d for n, d in events if n == "response.completed")["response"]["usage"]


def prompt_cached(path: str, usage: dict) -> int:
    if path == MESSAGES:
        return usage.get("cache_read_input_tokens", 0)
    return usage["input_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("connector", ["nixl", "mooncake"])
@pytest.mark.parametrize("path", [MESSAGES, RESPONSES])
async def test_cached_tokens_are_the_prefills_prefix_hits(path, connector, stream):
    # NIXL: decode reports the prefill's count it received (vLLM 0.31+), but without
    # --enable-prompt-tokens-details its Anthropic usage has no cache fields. Mooncake: no count
    # in the params, so decode reports the tokens it loaded (as vLLM 0.30 did with NIXL too).
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, record_responses=True, kv_connector=connector,
                    roles={"prefill": {"prompt_tokens_details": True},
                           "decode": {"prompt_tokens_details": connector == "mooncake"}})
    async with stack(sim=sim) as (cluster, proxy, client):
        first = await client.post(path, body_for(path, LONG + " first question", stream))
        assert first.status == 200
        second = await client.post(path, body_for(path, LONG + " another question", stream))
        assert second.status == 200, second.body
        prefill, decode = cluster.records("prefill")[-1], cluster.records("decode")[-1]
        p_usage = msgspec.json.decode(prefill.response_body)["usage"]
        hits = prompt_cached(path, p_usage)
        assert hits >= 64  # the shared prefix's full blocks
        usage = final_usage(path, second, stream)
        assert prompt_cached(path, usage) == hits
        assert usage["input_tokens"] == p_usage["input_tokens"]
        assert usage["output_tokens"] == 6
        if path == RESPONSES:
            assert usage["input_tokens_details"] == p_usage["input_tokens_details"]
            assert usage["total_tokens"] == usage["input_tokens"] + 6
        # Every other byte is decode's: the answer without its usage object is as decode sent it,
        assert decode.response_body is not None
        assert _without_usage(second.body) == _without_usage(decode.response_body)
        # ... and decode's usage is what the rewrite replaced (it counted other cached tokens).
        if path == MESSAGES or connector == "mooncake":
            assert usage != final_usage(path, _Reply(decode.response_body), stream)


def _without_usage(data: bytes) -> bytes:
    out, at = data, 0
    while True:
        key = out.find(b'"usage":{', at)
        if key < 0:
            return out
        depth, end = 0, key + 8
        while True:
            depth += {0x7B: 1, 0x7D: -1}.get(out[end], 0)
            end += 1
            if depth == 0:
                break
        out, at = out[:key] + out[end:], key


class _Reply:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def json(self):
        return msgspec.json.decode(self.body)
