"""The pure parts of a stream's continuation (request/continuation/): which requests may be
continued, what the client received, the continuation's body and its events made the stream's."""

import msgspec
import pytest

from epd_proxy.request.apis import GENERATE
from epd_proxy.request.continuation import continuation_body, own_event, received, unsound, whole_usage
from epd_proxy.request.ingress import CHAT, COMPLETIONS


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else msgspec.json.encode(e)) + b"\n\n" for e in events)


def _chunk(content=None, role=None, finish=None, i="chatcmpl-1", created=5):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"id": i, "object": "chat.completion.chunk", "created": created, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 10}


@pytest.mark.parametrize("extra,why", [
    ({}, None), ({"n": 1}, None), ({"tools": []}, None), ({"seed": None}, None), ({"logprobs": False}, None),
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"seed": 3}, "seed"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 0}, None),
])
def test_what_may_be_continued(extra, why):
    assert unsound(CHAT, dict(CHAT_BODY, **extra)) == why


def test_only_chat_and_completions_with_a_text_prompt():
    assert unsound("/v1/messages", CHAT_BODY) == "api"
    assert unsound(COMPLETIONS, {"prompt": "x"}) is None
    assert unsound(COMPLETIONS, {"prompt": ["x"]}) is None
    assert unsound(COMPLETIONS, {"prompt": [1, 2, 3]}) == "prompt"


def test_what_the_client_received_stops_at_the_partial_event_and_an_error():
    data = _sse(_chunk("", role="assistant"), _chunk("Hel"), _chunk("lo")) + b'data: {"id":"chatcmpl-1","choi'
    got = received(CHAT, data)
    assert (got.id, got.created, got.model) == ("chatcmpl-1", 5, "m")
    assert "".join(got.text) == "Hello" and got.tokens == 2 and not got.finished and got.unsound is None
    got = received(CHAT, _sse(_chunk("a"), {"error": {"message": "x"}}, _chunk("b")))
    assert got.text == ["a"]
    assert received(CHAT, _sse(_chunk("a"), _chunk(None, finish="stop"))).finished
    tool = _chunk()
    tool["choices"][0]["delta"]["tool_calls"] = [{"index": 0}]
    assert received(CHAT, _sse(tool)).unsound == "tool_calls"


def test_the_chat_continuation_continues_the_final_message_with_the_rest_of_the_budget():
    got = received(CHAT, _sse(_chunk("", role="assistant"), _chunk("Hel"), _chunk("lo")))
    body = continuation_body(CHAT, dict(CHAT_BODY, min_tokens=5, max_completion_tokens=8), got)
    assert body["messages"] == CHAT_BODY["messages"] + [{"role": "assistant", "content": "Hello"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["max_completion_tokens"], body["min_tokens"]) == (8, 6, 3)
    assert CHAT_BODY["messages"] == [{"role": "user", "content": "hi"}]  # the client's body untouched


def test_the_completions_continuation_appends_the_text_to_the_prompt():
    event = {"id": "cmpl-1", "created": 1, "model": "m", "choices": [{"index": 0, "text": " there"}]}
    got = received(COMPLETIONS, _sse(event))
    body = continuation_body(COMPLETIONS, {"prompt": ["Hi"], "max_tokens": 4}, got)
    assert body["prompt"] == "Hi there" and body["max_tokens"] == 3


def test_a_continuation_event_is_the_streams_own():
    got = received(CHAT, _sse(_chunk("", role="assistant"), _chunk("a")))
    got.before = got.tokens
    assert own_event(_chunk("", role="assistant", i="chatcmpl-2", created=9), got) is None  # the role again
    out = msgspec.json.decode(own_event(_chunk("b", role="assistant", i="chatcmpl-2", created=9), got)[6:])
    assert out["id"] == "chatcmpl-1" and out["created"] == 5 and out["choices"][0]["delta"] == {"content": "b"}
    usage = {"id": "chatcmpl-2", "created": 9, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}}
    out = msgspec.json.decode(own_event(usage, got)[6:])
    assert out["usage"] == {"prompt_tokens": 11, "completion_tokens": 8, "total_tokens": 19}
    assert got.text == ["a", "b"] and got.tokens == 2


def test_the_whole_usage_never_goes_below_zero():
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    whole_usage(usage, 4)
    assert usage == {"prompt_tokens": 0, "completion_tokens": 7, "total_tokens": 7}


GENERATE_BODY = {"model": "m", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 10, "min_tokens": 4},
                 "stream": True, "token_offsets": [[0, 1], [1, 2], [2, 3]]}


def _gen(ids, finish=None, rid="generate-tokens-1", **kw):
    return dict({"request_id": rid, "usage": None, "output_mode": "tokens",
                 "choices": [{"index": 0, "finish_reason": finish, "token_ids": ids}]}, **kw)


@pytest.mark.parametrize("change,why", [
    ({}, None), ({"sampling_params": {"n": 1, "seed": None, "logprobs": None, "presence_penalty": 0.0}}, None),
    ({"sampling_params": {"seed": 0}}, "seed"), ({"sampling_params": {"logprobs": 0}}, "logprobs"),
    ({"sampling_params": {"n": 2}}, "n"), ({"sampling_params": {"frequency_penalty": 0.2}}, "frequency_penalty"),
    ({"sampling_params": {"structured_outputs": {"regex": "a"}}}, "structured_outputs"),
    ({"output_mode": "text"}, "output_mode"), ({"features": {"mm_hashes": {}}}, "media"),
    ({"token_ids": []}, "token_ids"),
])
def test_what_generate_streams_may_be_continued(change, why):
    assert unsound(GENERATE, dict(GENERATE_BODY, **change)) == why


def test_a_generate_continuation_is_token_in():
    got = received(GENERATE, _sse(_gen([7, 8], return_token_ids=None), _gen([9]), {"error": {"message": "x"}},
                                  _gen([10])))
    assert (got.id, got.ids, got.tokens, got.finished) == ("generate-tokens-1", [7, 8, 9], 3, False)
    cont = got.body(GENERATE, GENERATE_BODY)
    assert cont["token_ids"] == [1, 2, 3, 7, 8, 9] and "token_offsets" not in cont
    assert cont["sampling_params"] == {"max_tokens": 7, "min_tokens": 1}
    assert GENERATE_BODY["sampling_params"] == {"max_tokens": 10, "min_tokens": 4}  # the client's untouched
    got.before = got.tokens
    out = got.own(dict(_gen([11], rid="generate-tokens-2"), prompt_token_ids=[1, 2, 3, 7, 8, 9]))
    assert msgspec.json.decode(out[6:]) == _gen([11])
    assert got.ids == [7, 8, 9, 11]
    usage = {"prompt_tokens": 6, "completion_tokens": 7, "total_tokens": 13}
    final = msgspec.json.decode(got.own({"request_id": "generate-tokens-2", "usage": usage, "choices": []})[6:])
    assert final["request_id"] == "generate-tokens-1"
    assert final["usage"] == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
