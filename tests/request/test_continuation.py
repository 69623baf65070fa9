"""The pure parts of a stream's continuation (request/continuation.py): which requests may be
continued, what the client received, the continuation's body and its events made the stream's."""

import msgspec
import pytest

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
    got = received(data)
    assert (got.id, got.created, got.model) == ("chatcmpl-1", 5, "m")
    assert "".join(got.text) == "Hello" and got.tokens == 2 and not got.finished and got.unsound is None
    got = received(_sse(_chunk("a"), {"error": {"message": "x"}}, _chunk("b")))
    assert got.text == ["a"]
    assert received(_sse(_chunk("a"), _chunk(None, finish="stop"))).finished
    tool = _chunk()
    tool["choices"][0]["delta"]["tool_calls"] = [{"index": 0}]
    assert received(_sse(tool)).unsound == "tool_calls"


def test_the_chat_continuation_continues_the_final_message_with_the_rest_of_the_budget():
    got = received(_sse(_chunk("", role="assistant"), _chunk("Hel"), _chunk("lo")))
    body = continuation_body(CHAT, dict(CHAT_BODY, min_tokens=5, max_completion_tokens=8), got)
    assert body["messages"] == CHAT_BODY["messages"] + [{"role": "assistant", "content": "Hello"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["max_completion_tokens"], body["min_tokens"]) == (8, 6, 3)
    assert CHAT_BODY["messages"] == [{"role": "user", "content": "hi"}]  # the client's body untouched


def test_the_completions_continuation_appends_the_text_to_the_prompt():
    got = received(_sse({"id": "cmpl-1", "created": 1, "model": "m", "choices": [{"index": 0, "text": " there"}]}))
    body = continuation_body(COMPLETIONS, {"prompt": ["Hi"], "max_tokens": 4}, got)
    assert body["prompt"] == "Hi there" and body["max_tokens"] == 3


def test_a_continuation_event_is_the_streams_own():
    got = received(_sse(_chunk("", role="assistant"), _chunk("a")))
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
