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


def test_completions_with_a_text_prompt_and_not_other_paths():
    assert unsound("/v1/embeddings", {"input": "x"}) == "api"
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


MESSAGES_BODY = {"model": "m", "max_tokens": 10, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def _named(name, data) -> bytes:
    return b"event: " + name + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


@pytest.mark.parametrize("change,why", [
    ({}, None), ({"tools": [], "thinking": None, "system": [{"type": "text", "text": "s"}]}, None),
    ({"tools": [{"name": "t"}]}, "tools"), ({"thinking": {"type": "disabled"}}, "thinking"),
    ({"output_config": {"effort": "low"}}, "output_config"),
    ({"system": [{"type": "image"}]}, "system"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A"}]}, "prefill"),
])
def test_what_messages_streams_may_be_continued(change, why):
    assert unsound("/v1/messages", dict(MESSAGES_BODY, **change)) == why


def test_a_messages_continuation_is_the_chat_vllm_makes_of_it_continued():
    start = {"type": "message_start", "message": {"id": "msg-1", "model": "m", "usage": {
        "input_tokens": 7, "output_tokens": 0, "cache_read_input_tokens": 2}}}
    block = {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}
    data = (_named(b"message_start", start) + _named(b"content_block_start", block)
            + b"".join(_named(b"content_block_delta", {"type": "content_block_delta", "index": 0,
                                                         "delta": {"type": "text_delta", "text": t}})
                       for t in ("Hel", "lo")) + b"event: content_block_delta\ndata: {\"type\"")
    got = received("/v1/messages", data)
    assert (got.id, got.tokens, got.open, got.index, got.unsound) == ("msg-1", 2, True, 0, None)
    body = dict(MESSAGES_BODY, system=[{"type": "text", "text": "x-anthropic-billing-header: 1"},
                                       {"type": "text", "text": "Sys"}], stop_sequences=["END"], temperature=0)
    cont = got.body("/v1/messages", body)
    assert cont["messages"] == [{"role": "system", "content": "Sys"}, {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "Hello"}]
    assert cont["stop"] == ["END"] and cont["temperature"] == 0 and cont["max_tokens"] == 8
    got.before = got.tokens
    assert got.own({"id": "chatcmpl-9", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                     "finish_reason": None}]}) is None
    out = got.own({"id": "chatcmpl-9", "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop",
                                                    "stop_reason": "END"}]})
    assert out == _named(b"content_block_delta", {"type": "content_block_delta",
                                                  "delta": {"type": "text_delta", "text": "!"}, "index": 0})
    end = got.own({"id": "chatcmpl-9", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}})
    assert end == (_named(b"content_block_stop", {"type": "content_block_stop", "index": 0})
                   + _named(b"message_delta", {"type": "message_delta",
                                               "delta": {"stop_reason": "stop_sequence", "stop_sequence": "END"},
                                               "usage": {"input_tokens": 7, "output_tokens": 3,
                                                         "cache_read_input_tokens": 2}})
                   + _named(b"message_stop", {"type": "message_stop"}))
    assert got.done() == b""  # the closing events went out once


def test_a_messages_answer_with_a_thinking_block_is_not_continued():
    block = {"type": "content_block_start", "content_block": {"type": "thinking", "thinking": ""}, "index": 0}
    start = {"type": "message_start", "message": {"id": "msg-1", "model": "m", "usage": {}}}
    got = received("/v1/messages", _named(b"message_start", start) + _named(b"content_block_start", block))
    assert got.unsound == "thinking"


RESPONSES_BODY = {"model": "m", "max_output_tokens": 10, "stream": True, "store": False, "input": "hi"}


@pytest.mark.parametrize("change,why", [
    ({}, None), ({"tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled"}, None),
    ({"store": True}, "store"), ({"store": None}, "store"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"reasoning": {"effort": "low"}}, "reasoning"), ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"text": {"format": {"type": "json_schema"}}}, "text"), ({"truncation": "auto"}, "truncation"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "content"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A"}]}, "prefill"),
])
def test_what_responses_streams_may_be_continued(change, why):
    assert unsound("/v1/responses", dict(RESPONSES_BODY, **change)) == why


def test_a_responses_continuation_continues_a_partial_assistant_message():
    created = {"type": "response.created", "sequence_number": 0,
               "response": {"id": "resp_1", "created_at": 5, "status": "in_progress", "output": []}}
    added = {"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
             "item": {"id": "msg_1", "type": "message", "role": "assistant", "content": []}}
    deltas = [{"type": "response.output_text.delta", "sequence_number": 2 + i, "item_id": "msg_1", "output_index": 0,
               "content_index": 0, "delta": t} for i, t in enumerate(("Hel", "lo"))]
    data = b"".join(_named(e["type"].encode(), e) for e in (created, added, *deltas))
    got = received("/v1/responses", data)
    assert (got.id, got.item, got.tokens, got.seq, got.unsound) == ("resp_1", "msg_1", 2, 3, None)
    cont = got.body("/v1/responses", RESPONSES_BODY)
    assert cont["input"] == [{"type": "message", "role": "user", "content": "hi"},
                             {"id": "msg_1", "type": "message", "role": "assistant", "status": "incomplete",
                              "content": [{"type": "output_text", "text": "Hello", "annotations": []}]}]
    assert cont["max_output_tokens"] == 8 and RESPONSES_BODY["input"] == "hi"
    got.before = got.tokens
    assert got.own(dict(created, response={"id": "resp_2", "created_at": 9})) is None
    delta = got.own({"type": "response.output_text.delta", "sequence_number": 4, "item_id": "msg_2", "delta": "!"})
    assert msgspec.json.decode(delta.split(b"data: ", 1)[1]) == {
        "type": "response.output_text.delta", "sequence_number": 4, "item_id": "msg_1", "delta": "!"}
    done = {"type": "response.completed", "sequence_number": 9, "response": {
        "id": "resp_2", "created_at": 9, "output": [{"id": "msg_2", "type": "message", "content": [{"text": "!"}]}],
        "usage": {"input_tokens": 6, "output_tokens": 1, "total_tokens": 7}}}
    out = got.own(done)
    assert out.startswith(b"event: response.completed\ndata: ")
    response = msgspec.json.decode(out.split(b"data: ", 1)[1])["response"]
    assert (response["id"], response["created_at"], response["output"][0]["id"]) == ("resp_1", 5, "msg_1")
    assert response["output"][0]["content"][0]["text"] == "Hello!"
    assert response["usage"] == {"input_tokens": 4, "output_tokens": 3, "total_tokens": 7}
    assert got.seq == 5 and got.finished


def test_a_completions_event_with_empty_text_counts_its_token():
    """vLLM's completions stream sends one event per token, an incomplete character's text empty."""
    events = [{"id": "cmpl-1", "created": 1, "model": "m", "choices": [{"index": 0, "text": t}]}
              for t in ("a", "", "b")]
    got = received(COMPLETIONS, _sse(*events))
    assert got.tokens == 3 and "".join(got.text) == "ab"
    assert continuation_body(COMPLETIONS, {"prompt": "x", "max_tokens": 10}, got)["max_tokens"] == 7


def test_a_responses_answer_so_far_is_counted_by_what_its_text_renders_to():
    """vLLM merges outputs a slow stream has not sent into one delta (its Responses stream more
    often than chat's: 829-900 deltas for 1,000 tokens on the e2e's model): the count is the
    tokens the continued prompt holds after the original one, never fewer than the deltas."""
    deltas = [{"type": "response.output_text.delta", "sequence_number": i, "item_id": "msg_1", "delta": t}
              for i, t in enumerate(("Hel", "lo wor"))]
    added = {"type": "response.output_item.added", "sequence_number": 0,
             "item": {"id": "msg_1", "type": "message", "role": "assistant", "content": []}}
    data = b"".join(_named(e["type"].encode(), e) for e in (added, *deltas))
    body = {"model": "m", "instructions": "Be brief.", "chat_template_kwargs": {"x": 1}, "max_output_tokens": 10,
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
                      {"role": "user", "content": "more"}]}
    got = received("/v1/responses", data)
    prompt, continued = got.recount(body)
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                    {"role": "assistant", "content": "A"}, {"role": "user", "content": "more"}]
    assert prompt == {"model": "m", "chat_template_kwargs": {"x": 1}, "messages": conversation,
                      "add_generation_prompt": True}
    assert continued == {"model": "m", "chat_template_kwargs": {"x": 1},
                         "messages": conversation + [{"role": "assistant", "content": "Hello wor"}],
                         "add_generation_prompt": False, "continue_final_message": True}
    assert got.recount({"model": "m", "input": "hi"})[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert got.tokens == 2
    got.counted([1, 2, 3], [1, 2, 4, 5])  # the original prompt is no prefix: left as counted
    got.counted(None, [1, 2, 3, 4, 5, 6])
    got.counted([1, 2, 3], [1, 2, 3, 4])  # fewer than the deltas: the deltas
    assert got.tokens == 2
    got.counted([1, 2, 3], [1, 2, 3, 7, 8, 9])
    assert got.tokens == 3
    assert got.body("/v1/responses", body)["max_output_tokens"] == 7
