"""A stream's usage event the client did not ask for (usage/hidden.py): taken out, with the
fingerprint put back where vLLM writes it without the option; and over real sockets, the
client's bytes are decode's own answer to the request without the option."""

import pytest
from helpers import Client, chat_body, stack

from epd_proxy.request.legs.stage_bodies import stream_options_with_usage
from epd_proxy.request.usage.hidden import HiddenUsage, split_usage_event, stamp_fingerprint
from epd_proxy.sim import SimConfig

HEAD = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
TOKEN = HEAD + b'"delta":{"content":"a"},"logprobs":null,"finish_reason":null}]}\n\n'
FINISH = HEAD + b'"delta":{"content":"b"},"logprobs":null,"finish_reason":"stop"}]}\n\n'
USAGE = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
         b'"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2},"system_fingerprint":"fp-1"}\n\n')
DONE = b"data: [DONE]\n\n"
FINISH_STAMPED = FINISH[:-3] + b',"system_fingerprint":"fp-1"}\n\n'


def test_the_options_ask_for_usage_only_when_the_client_did_not():
    assert stream_options_with_usage(None) == {"include_usage": True}
    assert stream_options_with_usage({"include_usage": False}) == {"include_usage": True}
    assert stream_options_with_usage({"continuous_usage_stats": True}) == {"include_usage": True}
    assert stream_options_with_usage({"include_usage": True}) is None


def test_split_and_stamp():
    assert split_usage_event(TOKEN + USAGE + DONE) == (TOKEN + DONE, USAGE)
    assert split_usage_event(TOKEN + DONE) == (TOKEN + DONE, b"")
    assert stamp_fingerprint(TOKEN + FINISH, b'"fp-1"') == TOKEN + FINISH_STAMPED
    assert stamp_fingerprint(TOKEN + FINISH, b"") == TOKEN + FINISH


@pytest.mark.parametrize("reads", [
    [TOKEN + FINISH + USAGE + DONE],  # one read
    [TOKEN, FINISH, USAGE, DONE],  # one event per read
    [TOKEN + FINISH, USAGE + DONE],
    [TOKEN, FINISH + USAGE, DONE],
])
def test_the_usage_event_is_taken_out_and_the_fingerprint_put_back(reads):
    hidden = HiddenUsage()
    out = b"".join(hidden.feed(r) for r in reads) + hidden.flush()
    assert out == TOKEN + FINISH_STAMPED + DONE
    assert hidden.usage == USAGE


def test_only_the_end_is_held_and_a_missing_usage_event_leaves_the_stream_as_received():
    hidden = HiddenUsage()
    assert hidden.feed(TOKEN) == TOKEN  # nothing held before a choice finishes
    assert hidden.feed(FINISH) == b""
    assert hidden.feed(DONE) == b""
    assert hidden.flush() == FINISH + DONE


def _without_usage_option(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "stream_options"}


@pytest.mark.parametrize("prefill, path, body", [
    (0, "/v1/chat/completions", chat_body(stream=True, max_tokens=6)),
    (1, "/v1/chat/completions", chat_body(stream=True, max_tokens=6)),
    (0, "/v1/chat/completions", chat_body(stream=True, max_tokens=4, n=2)),
    (0, "/v1/completions", {"model": "sim-model", "prompt": "Hello there", "max_tokens": 5, "stream": True}),
    (0, "/v1/chat/completions", chat_body(stream=True, max_tokens=6, stream_options={"continuous_usage_stats": True})),
])
async def test_the_client_gets_decodes_bytes_without_the_usage_event(prefill, path, body):
    """Byte for byte, what decode answers to the same request without the option (the same
    X-Request-Id: the same ids; the simulator stamps a fingerprint, as vLLM does)."""
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, record_responses=True)
    async with stack(prefill=prefill, sim=sim) as (cluster, proxy, client):
        rid = [(b"x-request-id", b"same-id")]
        via_proxy = await client.post(path, body, rid)
        assert via_proxy.status == 200, via_proxy.body
        sent = cluster.records("decode")[-1]
        assert sent.json["stream_options"]["include_usage"] is True  # the proxy asked for it
        assert sent.response_body.find(b'"choices":[],"usage":') >= 0
        decode_url = cluster.urls("decode")[0]
        direct_client = Client(decode_url)
        try:
            direct = await direct_client.post(path, _without_usage_option(body), rid)
        finally:
            await direct_client.close()
    assert direct.status == 200
    assert direct.body.find(b'"usage"') < 0 and direct.body.find(b'"system_fingerprint":') >= 0
    assert via_proxy.body == direct.body
