"""The client's usage for a P/D request: the pure rewrite, and what clients get through the
proxy from simulated prefill/decode instances with prefix caches."""

from __future__ import annotations

import msgspec
import pytest
from helpers import chat_body, stack
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.observe.tokens import usage_of
from epd_proxy.request.usage.rewrite import (
    PrefillReport,
    merged_usage,
    rewrite_answer_usage,
    rewrite_final_usage_events,
    rewrite_usage,
)
from epd_proxy.sim import SimConfig, expected_text, prompt_tokens


def report(usage: dict | None, kv: dict | None = None) -> PrefillReport:
    return PrefillReport(msgspec.json.encode(usage), msgspec.json.encode(kv))


# -- the pure rewrite -------------------------------------------------------------------------
def test_the_transferred_tokens_become_the_prefills_prefix_hits():
    decode = {"prompt_tokens": 40, "total_tokens": 48, "completion_tokens": 8,
              "prompt_tokens_details": {"cached_tokens": 40}}  # what it loaded
    prefill = {"prompt_tokens": 40, "total_tokens": 41, "completion_tokens": 1,
               "prompt_tokens_details": {"cached_tokens": 32}}
    assert merged_usage(decode, prefill, None) == {"prompt_tokens": 40, "total_tokens": 48,
                                                   "completion_tokens": 8,
                                                   "prompt_tokens_details": {"cached_tokens": 32}}


def test_no_prefix_hit_means_no_details_as_one_instance_reports():
    decode = {"prompt_tokens": 40, "total_tokens": 48, "completion_tokens": 8,
              "prompt_tokens_details": {"cached_tokens": 40}}
    prefill = {"prompt_tokens": 40, "total_tokens": 41, "completion_tokens": 1, "prompt_tokens_details": None}
    out = merged_usage(decode, prefill, 0)
    assert out["prompt_tokens_details"] is None and out["total_tokens"] == 48


def test_the_kv_params_count_is_used_when_the_prefill_reports_no_details():
    decode = {"prompt_tokens": 40, "total_tokens": 48, "completion_tokens": 8,
              "prompt_tokens_details": {"cached_tokens": 40}}
    assert merged_usage(decode, {"prompt_tokens": 40}, 16)["prompt_tokens_details"] == {"cached_tokens": 16}
    # Nothing known about the prefill's hits: no number rather than the transferred one.
    assert merged_usage(decode, {"prompt_tokens": 40}, None)["prompt_tokens_details"] is None


def test_details_only_when_an_instance_reports_them():
    decode = {"prompt_tokens": 40, "total_tokens": 48, "completion_tokens": 8}
    # Neither runs with --enable-prompt-tokens-details: nothing to add.
    assert merged_usage(decode, {"prompt_tokens": 40, "prompt_tokens_details": None}, 16) is None
    # Only the prefill does: its count reaches the client.
    out = merged_usage(decode, {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 16}}, 16)
    assert out["prompt_tokens_details"] == {"cached_tokens": 16}


def test_prompt_tokens_are_the_prefills_and_the_total_adds_up():
    decode = {"prompt_tokens": 39, "total_tokens": 47, "completion_tokens": 8}
    assert merged_usage(decode, {"prompt_tokens": 40}, None) == {"prompt_tokens": 40, "total_tokens": 48,
                                                                 "completion_tokens": 8}


def test_a_right_usage_is_left_alone():
    decode = {"prompt_tokens": 40, "total_tokens": 48, "completion_tokens": 8,
              "prompt_tokens_details": {"cached_tokens": 32}}
    prefill = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}
    assert merged_usage(decode, prefill, 32) is None
    body = b'{"id":"x","usage":' + msgspec.json.encode(decode) + b',"kv_transfer_params":null}'
    assert rewrite_usage(body, report(prefill)) is body


def test_only_the_usage_bytes_change():
    body = (b'{"id":"chatcmpl-1","choices":[{"index":0,"message":{"content":"a \\"usage\\": {} b"}}],'
            b'"usage": {"prompt_tokens":40,"total_tokens":48,"completion_tokens":8,'
            b'"prompt_tokens_details":{"cached_tokens":40}} ,"metrics":null}')
    out = rewrite_usage(body, report({"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 16}}))
    new_usage = (b'{"prompt_tokens":40,"total_tokens":48,"completion_tokens":8,'
                 b'"prompt_tokens_details":{"cached_tokens":16}}')
    assert out == body.replace(body[body.index(b'{"prompt_tokens"'):body.index(b" ,\"metrics\"")], new_usage)


def test_unreadable_answers_pass_unchanged():
    r = report({"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 1}})
    for doc in (b"not json", b'{"usage":null}', b'{"usage":[1]}', b"[]", b'{"choices":[]}'):
        assert rewrite_usage(doc, r) is doc
    assert rewrite_usage(b'{"usage":{"prompt_tokens":1}}', PrefillReport(b"garbage", b"{")) == \
        b'{"usage":{"prompt_tokens":1}}'


def test_only_the_final_usage_event_is_rewritten():
    r = report({"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 16}})
    running = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"usage":{"prompt_tokens":40,' \
              b'"total_tokens":41,"completion_tokens":1}}'
    final = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":40,"total_tokens":48,"completion_tokens":8,' \
            b'"prompt_tokens_details":{"cached_tokens":40}}}'
    data = running + b"\n\n" + final + b"\n\ndata: [DONE]\n\n"
    out = rewrite_final_usage_events(data, r)
    assert out.startswith(running + b"\n\n")
    assert b'"prompt_tokens_details":{"cached_tokens":16}}}\n\ndata: [DONE]\n\n' in out
    assert rewrite_final_usage_events(running + b"\n\n", r) == running + b"\n\n"


_counts = st.integers(min_value=0, max_value=10**6)
_details = st.one_of(st.none(), st.fixed_dictionaries({"cached_tokens": _counts}))
_usage = st.fixed_dictionaries({"prompt_tokens": _counts, "total_tokens": _counts,
                                "completion_tokens": _counts, "prompt_tokens_details": _details})


@settings(max_examples=100, deadline=None)
@given(decode=_usage, prefill=st.one_of(st.none(), _usage), remote=st.one_of(st.none(), _counts),
       text=st.text(max_size=40))
def test_the_rewrite_keeps_every_other_byte_and_a_consistent_usage(decode, prefill, remote, text):
    head = b'{"id":"x","choices":[{"message":{"content":' + msgspec.json.encode(text) + b'}}],"usage":'
    tail = b',"kv_transfer_params":null}'
    body = head + msgspec.json.encode(decode) + tail
    out = rewrite_usage(body, report(prefill, {"remote_prefill_cached_tokens": remote}))
    assert out.startswith(head) and out.endswith(tail)
    usage = msgspec.json.decode(out)["usage"]
    assert usage["completion_tokens"] == decode["completion_tokens"]
    if out is not body:
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    details = usage.get("prompt_tokens_details")
    assert details is None or details["cached_tokens"] > 0
    # The shape vLLM writes is read without decoding the whole answer; any other shape (here a
    # space after the key) is read whole. Both give the same usage.
    spaced = body.replace(b'"usage":', b'"usage": ')
    slow = rewrite_usage(spaced, report(prefill, {"remote_prefill_cached_tokens": remote}))
    assert msgspec.json.decode(slow)["usage"] == usage


_extra = st.dictionaries(st.sampled_from(["input_tokens", "output_tokens", "cache_read_input_tokens",
                                          "input_tokens_details", "completion_tokens_details"]),
                         st.one_of(_counts, st.just("x"), st.none()), max_size=2)


@settings(max_examples=200, deadline=None)
@given(decode=_usage, extra=_extra, prefill=st.one_of(st.none(), _usage), agree=st.booleans(),
       drop_details=st.booleans())
def test_a_whole_answers_usage_is_read_once_for_the_client_and_the_metrics(decode, extra, prefill, agree,
                                                                          drop_details):
    """What the metrics and the access log read from the client's answer (usage_of) is what the
    rewrite read on the way, when it says so; the answer's bytes are rewrite_usage's."""
    if agree:  # the common case: both counted the same prompt, the total adds up
        decode["total_tokens"] = decode["prompt_tokens"] + decode["completion_tokens"]
        if prefill is not None:
            prefill["prompt_tokens"] = decode["prompt_tokens"]
    if drop_details:
        del decode["prompt_tokens_details"]
    decode.update(extra)
    body = b'{"id":"x","choices":[],"usage":' + msgspec.json.encode(decode) + b',"kv_transfer_params":null}'
    r = report(prefill)
    out, tokens = rewrite_answer_usage(body, r)
    assert out == rewrite_usage(body, r)
    if tokens is not None:
        assert out is body and tokens == usage_of(out)


def test_the_common_answer_s_tokens_come_with_it():
    body = (b'{"id":"x","choices":[],"usage":{"prompt_tokens":40,"total_tokens":48,"completion_tokens":8,'
            b'"prompt_tokens_details":null,"completion_tokens_details":null},"kv_transfer_params":null}')
    out, tokens = rewrite_answer_usage(body, report({"prompt_tokens": 40, "total_tokens": 41,
                                                     "completion_tokens": 1, "prompt_tokens_details": None}))
    assert out is body and tokens == (40, 8, None) == usage_of(body)


def test_a_usage_key_inside_the_text_is_not_the_usage():
    text = 'see "usage":{"prompt_tokens":1} and }{'
    body = (b'{"id":"x","choices":[{"message":{"content":' + msgspec.json.encode(text) + b'}}],'
            b'"usage":{"prompt_tokens":40,"total_tokens":48,"completion_tokens":8,"prompt_tokens_details":null}}')
    out = rewrite_usage(body, report({"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 16}}))
    doc = msgspec.json.decode(out)
    assert doc["choices"][0]["message"]["content"] == text
    assert doc["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


# -- through the proxy ------------------------------------------------------------------------
LONG = " ".join(f"word{i}" for i in range(80))  # several 16-token blocks


def _prefill_hits(cluster) -> int:
    return cluster.records("prefill")[-1].kv["remote_prefill_cached_tokens"]


def _final_usage(reply) -> dict:
    events = [msgspec.json.decode(e[6:]) for e in reply.events if e != b"data: [DONE]"]
    final = events[-1]
    assert final["choices"] == []
    return final["usage"]


@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_are_the_prefills_prefix_hits_for_a_repeated_prefix(stream):
    # --enable-prompt-tokens-details on the prefill only: decode reports nothing itself.
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"prefill": {"prompt_tokens_details": True}})
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    async with stack(sim=sim) as (cluster, proxy, client):
        first = await client.chat(chat_body(LONG + " first question", stream=stream, **extra))
        usage = _final_usage(first) if stream else first.json()["usage"]
        assert _prefill_hits(cluster) == 0
        assert usage.get("prompt_tokens_details") is None
        body = chat_body(LONG + " another question", stream=stream, **extra)
        second = await client.chat(body)
        usage = _final_usage(second) if stream else second.json()["usage"]
        hits = _prefill_hits(cluster)
        assert hits >= 64  # the shared prefix's full blocks
        assert usage["prompt_tokens_details"] == {"cached_tokens": hits}
        assert usage["completion_tokens"] == 8
        assert usage["prompt_tokens"] == prompt_tokens(body)
        assert usage["total_tokens"] == usage["prompt_tokens"] + 8
        assert second.text() == expected_text(body)  # everything but the usage is relayed as received


async def test_with_details_on_both_roles_the_count_is_the_prefills():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, prompt_tokens_details=True)
    async with stack(sim=sim) as (cluster, proxy, client):
        await client.chat(chat_body(LONG + " one"))
        reply = await client.chat(chat_body(LONG + " two"))
        assert reply.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": _prefill_hits(cluster)}


async def test_a_plain_pool_is_not_rewritten():
    # PD (no prefill pool): the instance that computed the prompt answers; its bytes go as received.
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, prompt_tokens_details=True)
    async with stack(prefill=0, decode=0, pd=1, sim=sim) as (cluster, proxy, client):
        await client.chat(chat_body(LONG + " one"))
        reply = await client.chat(chat_body(LONG + " two"))
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_get_the_same_usage(stream):
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"prefill": {"prompt_tokens_details": True}})
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    async with stack(sim=sim) as (cluster, proxy, client):
        for tail in ("one", "two"):
            body = {"model": "sim-model", "prompt": LONG + " " + tail, "max_tokens": 4, "stream": stream, **extra}
            reply = await client.post("/v1/completions", body)
            assert reply.status == 200
        usage = _final_usage(reply) if stream else reply.json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": _prefill_hits(cluster)}
        assert usage["completion_tokens"] == 4
