"""A committed generate or Messages stream whose decode breaks off is continued on another decode,
over real sockets (request/migration.py, request/continuation/): the client sees one stream in
its API's form, and what the continuation streamed is the stream's own."""

import msgspec
import pytest
from helpers import stack

from epd_proxy.sim import SimConfig
from epd_proxy.sim.tokens import VOCAB, expected_tokens

pytestmark = pytest.mark.asyncio

GENERATE = "/inference/v1/generate"
PROMPT = [3, 14, 15, 92, 65, 35]


def sim(**kw) -> SimConfig:
    return SimConfig(itl_ms=2, ttft_ms=0.5, enable_scale_out=True, **kw)


def _data(reply) -> list:
    out = []
    for raw in reply.events:
        assert raw.startswith(b"data: "), raw
        data = raw[len(b"data: "):]
        out.append("[DONE]" if data == b"[DONE]" else msgspec.json.decode(data))
    return out


def _generate(n: int, **kw) -> dict:
    body = {"model": "sim-model", "token_ids": PROMPT, "sampling_params": {"max_tokens": n}, "stream": True}
    body.update(kw)
    return body


def _vocab_ids(completion_body: dict) -> list[int]:
    """The simulator's answer to a completions body of token ids, as vocabulary indices."""
    return [VOCAB.index(t) for t in expected_tokens(completion_body)]


@pytest.mark.parametrize("fault,reason", [("reset-after=5", "reset"), ("error-after=5", "error")])
async def test_a_generate_stream_is_continued_token_in(fault, reason):
    async with stack(decode=2, sim=sim(), routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject(fault, times=1)
        body = _generate(20, stream_options={"include_usage": True})
        reply = await client.post(GENERATE, body)
        assert reply.status == 200, reply.body
        events = _data(reply)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        data = events[:-1]
        assert not [e for e in data if "error" in e], data
        assert len({e["request_id"] for e in data}) == 1
        ids = [t for e in data for c in e["choices"] for t in c["token_ids"]]
        assert len(ids) == 20
        assert [c["finish_reason"] for e in data for c in e["choices"] if c["finish_reason"]] == ["length"]
        assert data[-1]["choices"] == [] and data[-1]["usage"]["completion_tokens"] == 20
        assert data[-1]["usage"]["prompt_tokens"] == len(PROMPT)
        assert data[-1]["usage"]["total_tokens"] == len(PROMPT) + 20
        # The continuation: the prompt's ids and the five streamed, the rest of the budget.
        first, cont = (msgspec.json.decode(r.body) for r in cluster.records("decode"))
        assert cont["token_ids"] == PROMPT + ids[:5]
        assert cont["sampling_params"]["max_tokens"] == 15
        assert ids[:5] == _vocab_ids({"prompt": PROMPT, "max_tokens": 20})[:5]
        assert ids[5:] == _vocab_ids({"prompt": PROMPT + ids[:5], "max_tokens": 15})
        assert proxy.app.metrics.migrations == {(reason, "ok"): 1}
        assert proxy.app.metrics.stream_errors == 0


async def test_a_generate_stream_without_usage_and_with_prompt_ids_asked():
    """``return_token_ids`` puts the prompt's ids in the first event only: the continuation's
    (the prompt and the answer so far) are not repeated; no usage event the client did not ask."""
    async with stack(decode=2, sim=sim(), routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        reply = await client.post(GENERATE, _generate(12, return_token_ids=True))
        events = _data(reply)
        assert events[-1] == "[DONE]"
        ids = [t for e in events[:-1] for c in e["choices"] for t in c["token_ids"]]
        assert len(ids) == 12
        assert not [e for e in events[:-1] if not e["choices"]]
        assert len([e for e in events[:-1] if "prompt_token_ids" in e]) <= 1


@pytest.mark.parametrize("params", [{"seed": 3}, {"n": 2}, {"logprobs": 0}, {"presence_penalty": 0.5}])
async def test_an_unsound_generate_stream_ends_in_band(params):
    async with stack(decode=2, sim=sim(), routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        body = _generate(10)
        body["sampling_params"].update(params)
        reply = await client.post(GENERATE, body)
        events = _data(reply)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert len(cluster.records("decode")) == 1
        assert proxy.app.metrics.migrations == {}


MESSAGES = "/v1/messages"


def _named(reply) -> list[tuple[str, dict]]:
    out = []
    for raw in reply.events:
        name, data = raw.split(b"\n", 1)
        assert name.startswith(b"event: ") and data.startswith(b"data: "), raw
        out.append((name[7:].decode(), msgspec.json.decode(data[6:])))
    return out


def _messages(n: int, **kw) -> dict:
    more = [{"type": "text", "text": "more"}, {"type": "text", "text": "!"}]
    body = {"model": "sim-model", "max_tokens": n, "stream": True, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": "say something"}, {"role": "assistant", "content": "Well"},
                         {"role": "user", "content": more}]}
    body.update(kw)
    return body


@pytest.mark.parametrize("fault,reason", [("reset-after=5", "reset"), ("error-after=5", "error")])
async def test_a_messages_stream_is_continued_as_one_message(fault, reason):
    """The continuation is the conversation vLLM's Messages endpoint makes a chat of, on vLLM's
    chat endpoint with the answer so far continued; its chunks reach the client as the same
    message: one message_start, the text block's deltas at its index, one content_block_stop,
    one message_delta with the whole answer's usage, one message_stop."""
    async with stack(decode=2, sim=sim(), routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject(fault, times=1)
        reply = await client.post(MESSAGES, _messages(20))
        assert reply.status == 200, reply.body
        events = _named(reply)
        names = [n for n, _ in events]
        assert names[0] == "message_start" and names.count("message_start") == 1
        assert names[-2:] == ["message_delta", "message_stop"] and names.count("message_stop") == 1
        assert "error" not in names and names.count("content_block_start") == 1
        assert names.count("content_block_stop") == 1
        deltas = [d for n, d in events if n == "content_block_delta"]
        assert len(deltas) == 20 and {d["index"] for d in deltas} == {0}
        assert {d["delta"]["type"] for d in deltas} == {"text_delta"}
        start, delta = events[0][1], events[-2][1]
        assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert delta["usage"]["output_tokens"] == 20
        assert delta["usage"]["input_tokens"] == start["message"]["usage"]["input_tokens"]
        first, cont = cluster.records("decode")
        assert first.path == MESSAGES and cont.path == "/v1/chat/completions"
        body = msgspec.json.decode(cont.body)
        text = "".join(d["delta"]["text"] for d in deltas)
        assert body["messages"] == [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "say something"},
            {"role": "assistant", "content": "Well"},
            {"role": "user", "content": [{"type": "text", "text": "more"}, {"type": "text", "text": "!"}]},
            {"role": "assistant", "content": text[:len(body["messages"][-1]["content"])]}]
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
        assert body["max_tokens"] == body["max_completion_tokens"] == 15
        assert proxy.app.metrics.migrations == {(reason, "ok"): 1}
        assert proxy.app.metrics.stream_errors == 0


async def test_the_anthropic_sdk_reads_a_continued_message_whole():
    anthropic = pytest.importorskip("anthropic")
    async with stack(decode=2, sim=sim(), routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=4", times=1)
        sdk = anthropic.AsyncAnthropic(base_url=proxy.url, api_key="x", max_retries=0)
        body = _messages(12)
        body.pop("stream")
        async with sdk.messages.stream(**body) as stream:
            message = await stream.get_final_message()
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
        assert len(message.content) == 1 and message.content[0].type == "text" and message.content[0].text
        assert proxy.app.metrics.migrations == {("reset", "ok"): 1}


@pytest.mark.parametrize("extra", [{"tools": [{"name": "t", "input_schema": {"type": "object"}}]},
                                   {"thinking": {"type": "enabled", "budget_tokens": 8}},
                                   {"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "Once"}]}])
async def test_an_unsound_messages_stream_ends_in_band(extra):
    async with stack(decode=2, sim=sim(), routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        reply = await client.post(MESSAGES, _messages(10, **extra))
        name, data = _named(reply)[-1]
        assert name == "error" and data["error"]["type"] == "api_error"
        assert len(cluster.records("decode")) == 1
        assert proxy.app.metrics.migrations == {}


RESPONSES = "/v1/responses"


def _responses(n: int, **kw) -> dict:
    body = {"model": "sim-model", "max_output_tokens": n, "stream": True, "store": False,
            "instructions": "Be brief.", "input": [{"role": "user", "content": "say something"}]}
    body.update(kw)
    return body


@pytest.mark.parametrize("fault,reason", [("reset-after=5", "reset"), ("stall-after=5:5", "stall")])
async def test_a_responses_stream_is_continued_as_one_response(fault, reason):
    """The continuation is the request with the text so far as a partial (``incomplete``)
    assistant message, which vLLM continues; its events reach the client as the same response:
    one response.created, sequence numbers counting on, the item's id, the done events and
    response.completed with the whole text and the whole answer's usage."""
    async with stack(decode=2, sim=sim(), routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject(fault, times=1)
        reply = await client.post(RESPONSES, _responses(20))
        assert reply.status == 200, reply.body
        events = _named(reply)
        names = [n for n, _ in events]
        assert names.count("response.created") == 1 and names.count("response.output_item.added") == 1
        assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.completed"]
        assert "error" not in names and "response.failed" not in names
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        created, done = events[0][1]["response"], events[-1][1]["response"]
        item = events[names.index("response.output_item.added")][1]["item"]["id"]
        deltas = [d for n, d in events if n == "response.output_text.delta"]
        assert len(deltas) == 20 and {d["item_id"] for d in deltas} == {item}
        text = "".join(d["delta"] for d in deltas)
        assert events[-4][1]["text"] == text and events[-3][1]["part"]["text"] == text
        assert events[-2][1]["item"]["id"] == item and events[-2][1]["item"]["content"][0]["text"] == text
        assert done["id"] == created["id"] and done["created_at"] == created["created_at"]
        assert done["output"][0]["id"] == item and done["output"][0]["content"][0]["text"] == text
        assert done["usage"]["output_tokens"] == 20
        assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + 20
        other = [r for r in cluster.records("decode")[1:] if r.path != RESPONSES]
        # The answer so far counted in tokens by the other decode's /tokenize: the conversation
        # with the generation prompt, then with the text so far as the message to continue.
        assert [r.path for r in other] == ["/tokenize", "/tokenize"]
        asked = [msgspec.json.decode(r.body) for r in other]
        conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "say something"}]
        assert asked[0] == {"model": "sim-model", "messages": conversation, "add_generation_prompt": True}
        assert asked[1]["messages"][:2] == conversation and asked[1]["continue_final_message"] is True
        cont = msgspec.json.decode(next(r for r in cluster.records("decode")[1:] if r.path == RESPONSES).body)
        last = cont["input"][-1]
        assert last["role"] == "assistant" and last["status"] == "incomplete" and last["id"] == item
        assert last["content"][0]["text"] == text[:len(last["content"][0]["text"])] and last["content"][0]["text"]
        assert cont["max_output_tokens"] == 15
        assert proxy.app.metrics.migrations == {(reason, "ok"): 1}


async def test_the_openai_sdk_reads_a_continued_response_whole():
    openai = pytest.importorskip("openai")
    async with stack(decode=2, sim=sim(), routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=4", times=1)
        sdk = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        body = _responses(12)
        body.pop("stream")
        async with sdk.responses.stream(**body) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert final.output_text == "".join(deltas) and len(deltas) == 12
        assert final.usage.output_tokens == 12
        assert proxy.app.metrics.migrations == {("reset", "ok"): 1}


@pytest.mark.parametrize("extra", [{"store": True}, {"store": None},
                                   {"tools": [{"type": "function", "name": "f", "parameters": {}}]},
                                   {"text": {"format": {"type": "json_object"}}}])
async def test_an_unsound_responses_stream_ends_in_band(extra):
    async with stack(decode=2, sim=sim(), routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        body = _responses(10, **extra)
        if body["store"] is None:
            del body["store"]  # vLLM's default: stored
        reply = await client.post(RESPONSES, body)
        names = [n for n, _ in _named(reply)]
        assert names[-2:] == ["error", "response.failed"]
        assert len(cluster.records("decode")) == 1
        assert proxy.app.metrics.migrations == {}
