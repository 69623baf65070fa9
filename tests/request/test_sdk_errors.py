"""Every error the proxy makes, as each API's official SDK sees it: the SDK's own error class,
the envelope's type its clients decide by, and the SDK's retries (counted at the proxy).

Anthropic's clients (``/v1/messages``, ``/v1/messages/count_tokens``) get Anthropic's envelope
and types; the OpenAI SDK's (chat, completions, Responses) OpenAI's; generate and the routed
endpoints, which no SDK speaks, vLLM's (OpenAI's) envelope over a plain client."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from helpers import stack, wait_for

from epd_proxy.config import StageTimeouts
from epd_proxy.sim import SimConfig

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

SIM = SimConfig(itl_ms=0, ttft_ms=0.5, enable_scale_out=True)  # scale-out: generate's endpoint
PROMPT = "tell me about prefill and decode"
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
GENERATE, TOKENIZE = "/inference/v1/generate", "/tokenize"
OPENAI_SDK = (CHAT, COMPLETIONS, RESPONSES)
ANTHROPIC_SDK = (MESSAGES, COUNT_TOKENS)
PLAIN = (GENERATE, TOKENIZE)
GENERATION = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)

# Anthropic's types per status (docs/protocol.md, "Errors"), and the anthropic SDK's classes.
ANTHROPIC_TYPE = {404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                  502: "api_error", 503: "overloaded_error", 504: "api_error"}
ANTHROPIC_CLASS = {404: "NotFoundError", 413: "ContentTooLargeError", 429: "RateLimitError",
                   502: "InternalServerError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
OPENAI_CLASS = {404: "NotFoundError", 413: "APIStatusError", 429: "RateLimitError", 502: "InternalServerError",
                503: "InternalServerError", 504: "InternalServerError"}
OPENAI_TYPE = {404: "NotFoundError", 413: "RequestEntityTooLargeError", 429: "RateLimitError",
               502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def sdk_client(proxy, path: str, retries: int = 0):
    if path in ANTHROPIC_SDK:
        return anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=retries)
    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=retries)


async def call(client, path: str, model: str = "sim-model", stream: bool = False, text: str = PROMPT,
               extra: dict | None = None) -> list:
    """One request through the SDK; a stream's events (or chunks) read to the end."""
    messages = [{"role": "user", "content": text}]
    kw = {"extra_body": extra} if extra else {}
    if path == MESSAGES:
        out = await client.messages.create(model=model, max_tokens=4, messages=messages, stream=stream, **kw)
    elif path == COUNT_TOKENS:
        return [await client.messages.count_tokens(model=model, messages=messages, **kw)]
    elif path == CHAT:
        out = await client.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=stream,
                                                   **kw)
    elif path == COMPLETIONS:
        out = await client.completions.create(model=model, prompt=text, max_tokens=4, stream=stream, **kw)
    else:
        out = await client.responses.create(model=model, input=text, max_output_tokens=4, stream=stream, **kw)
    return [event async for event in out] if stream else [out]


def plain_body(path: str, model: str = "sim-model", text: str = PROMPT, stream: bool = False) -> dict:
    if path == GENERATE:
        return {"model": model, "token_ids": [1, 2, 3, 4] + [5] * (len(text) // 4),
                "sampling_params": {"max_tokens": 4}, "stream": stream}
    return {"model": model, "prompt": text}


def requests_at(proxy, path: str, status: int) -> int:
    """The requests the proxy answered on ``path`` with ``status``."""
    return proxy.app.metrics.requests.get((path, status), 0)


async def expect_error(proxy, client, path: str, status: int, retries_expected: bool, **kw) -> None:
    """The call fails with the SDK's class for ``status`` and its API's envelope and type; the
    SDK's own retry decision for the answer is ``retries_expected``."""
    if path in PLAIN:
        reply = await client.post(path, plain_body(path, **kw))
        assert reply.status == status, reply.body
        doc = reply.json()
        assert set(doc) == {"error"} and doc["error"]["type"] == OPENAI_TYPE[status]
        assert doc["error"]["code"] in (status, "model_not_found", "overloaded")
        return
    if path in ANTHROPIC_SDK:
        with pytest.raises(anthropic.APIStatusError) as info:
            await call(client, path, **kw)
        exc = info.value
        assert type(exc).__name__ == ANTHROPIC_CLASS[status] and exc.status_code == status
        assert exc.body["type"] == "error" and exc.body["error"]["type"] == ANTHROPIC_TYPE[status], exc.body
        assert set(exc.body["error"]) == {"type", "message"}
    else:
        with pytest.raises(openai.APIStatusError) as info:
            await call(client, path, **kw)
        exc = info.value
        assert type(exc).__name__ == OPENAI_CLASS[status] and exc.status_code == status
        assert exc.body["type"] == OPENAI_TYPE[status] and exc.body["code"] in (
            status, "model_not_found", "overloaded"), exc.body
    assert client._should_retry(exc.response) is retries_expected


async def clients_for(proxy, path: str):
    if path in PLAIN:
        from helpers import Client
        return Client(proxy.url)
    return sdk_client(proxy, path)


ALL = OPENAI_SDK + ANTHROPIC_SDK + PLAIN


@pytest.mark.parametrize("learned", [True, False])
@pytest.mark.parametrize("path", ALL)
async def test_an_unknown_model_is_404_in_the_apis_envelope_and_not_retried(path, learned):
    """``learned``: the proxy knows the cluster's models and answers itself; otherwise the
    instance's 404 is relayed (vLLM's own Messages 404, retyped for Anthropic's clients)."""
    if path == COUNT_TOKENS and not learned:
        pytest.skip("the simulator's count_tokens counts for any model")
    async with stack(sim=SIM) as (cluster, proxy, raw):
        if learned:
            for pool in proxy.app.pools.values():
                for inst in pool.instances:
                    await pool.checks.learn_models(inst, 5.0)
        client = await clients_for(proxy, path)
        try:
            await expect_error(proxy, client, path, 404, False, model="gpt-4o")
        finally:
            await client.close()
        assert requests_at(proxy, path, 404) == 1
        if learned:
            assert [r for r in cluster.records() if r.path != "/v1/models"] == []


@pytest.mark.parametrize("path", ALL)
async def test_a_body_too_large_is_413_in_the_apis_envelope(path):
    """The HTTP server's own answer (before any handler) is in the envelope of the path's API."""
    async with stack(sim=SIM, max_body_size=4096) as (cluster, proxy, _):
        client = await clients_for(proxy, path)
        try:
            await expect_error(proxy, client, path, 413, False, text="word " * 2000)
        finally:
            await client.close()
        assert cluster.records("decode") == [] and cluster.records("prefill") == []


@pytest.mark.parametrize("path", ALL)
async def test_admission_sheds_with_429_in_the_apis_envelope(path):
    async with stack(sim=SIM, max_inflight=1) as (cluster, proxy, raw):
        cluster.instances("prefill")[0].inject("hang")
        held = asyncio.ensure_future(raw.chat({"model": "sim-model", "max_tokens": 4,
                                               "messages": [{"role": "user", "content": PROMPT}]}))
        await wait_for(lambda: len(cluster.records("prefill")) == 1)
        client = await clients_for(proxy, path)
        try:
            await expect_error(proxy, client, path, 429, True)
        finally:
            await client.close()
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)


@pytest.mark.parametrize("path", ALL)
async def test_no_instance_reachable_is_503_overloaded_for_anthropic_clients(path):
    """Every instance refuses connections: 503 with Retry-After (Anthropic's clients read
    ``overloaded_error``; the anthropic SDK's ServiceUnavailableError, retried as a 529)."""
    async with stack(sim=SIM) as (cluster, proxy, _):
        for inst in cluster.instances("prefill") + cluster.instances("decode"):
            await inst.crash()
        client = await clients_for(proxy, path)
        try:
            await expect_error(proxy, client, path, 503, True)
        finally:
            await client.close()


@pytest.mark.parametrize("path", GENERATION + (GENERATE,))
async def test_a_failed_decode_is_502_in_the_apis_envelope(path):
    async with stack(sim=SIM, decode_retries=0) as (cluster, proxy, _):
        cluster.instances("decode")[0].inject("status=500", times=5)
        client = await clients_for(proxy, path)
        try:
            await expect_error(proxy, client, path, 502, True)
        finally:
            await client.close()


@pytest.mark.parametrize("path", GENERATION + (GENERATE,))
async def test_the_first_byte_deadline_is_504_in_the_apis_envelope(path):
    async with stack(sim=SIM, timeouts=StageTimeouts(first_byte=0.3)) as (cluster, proxy, _):
        cluster.instances("decode")[0].inject("hang", times=5)
        client = await clients_for(proxy, path)
        try:
            await expect_error(proxy, client, path, 504, True)
        finally:
            await client.close()


async def test_the_anthropic_sdk_retries_a_429_and_not_a_404():
    """max_retries=2: a shed request is sent three times (Retry-After: 1), an unknown model once."""
    async with stack(sim=SIM, max_inflight=1) as (cluster, proxy, raw):
        cluster.instances("prefill")[0].inject("hang")
        held = asyncio.ensure_future(raw.chat({"model": "sim-model", "max_tokens": 4,
                                               "messages": [{"role": "user", "content": PROMPT}]}))
        await wait_for(lambda: len(cluster.records("prefill")) == 1)
        client = sdk_client(proxy, MESSAGES, retries=2)
        try:
            with pytest.raises(anthropic.RateLimitError) as info:
                await call(client, MESSAGES)
            assert info.value.body["error"]["type"] == "rate_limit_error"
            assert requests_at(proxy, MESSAGES, 429) == 3
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
            await wait_for(lambda: proxy.app.pipeline.admission.active == 0)
            with pytest.raises(anthropic.NotFoundError):
                await call(client, MESSAGES, model="gpt-4o")
            assert requests_at(proxy, MESSAGES, 404) == 1
        finally:
            await client.close()
            held.cancel()


async def test_the_openai_sdk_retries_a_429():
    async with stack(sim=SIM, max_inflight=1) as (cluster, proxy, raw):
        cluster.instances("prefill")[0].inject("hang")
        held = asyncio.ensure_future(raw.chat({"model": "sim-model", "max_tokens": 4,
                                               "messages": [{"role": "user", "content": PROMPT}]}))
        await wait_for(lambda: len(cluster.records("prefill")) == 1)
        client = sdk_client(proxy, RESPONSES, retries=1)
        try:
            with pytest.raises(openai.RateLimitError):
                await call(client, RESPONSES)
            assert requests_at(proxy, RESPONSES, 429) == 2
        finally:
            await client.close()
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)


# -- after the commit point: the in-band error, in each stream's own form ---------------------

async def test_a_messages_stream_failing_mid_way_raises_the_anthropic_error_event():
    async with stack(sim=SIM, decode_retries=0) as (cluster, proxy, _):
        cluster.instances("decode")[0].inject("reset-after=2")
        client = sdk_client(proxy, MESSAGES)
        seen: list = []
        try:
            with pytest.raises(anthropic.APIStatusError) as info:
                async with client.messages.stream(model="sim-model", max_tokens=8,
                                                  messages=[{"role": "user", "content": PROMPT}]) as stream:
                    async for event in stream:
                        seen.append(event.type)
        finally:
            await client.close()
        assert "content_block_delta" in seen and "message_stop" not in seen
        assert info.value.body == {"type": "error", "error": {"type": "api_error",
                                                              "message": info.value.body["error"]["message"]}}
        assert "decode stream broke off" in info.value.body["error"]["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_chat_or_completions_stream_failing_mid_way_raises_the_openai_error(path):
    async with stack(sim=SIM, decode_retries=0) as (cluster, proxy, _):
        cluster.instances("decode")[0].inject("reset-after=2")
        client = sdk_client(proxy, path)
        try:
            with pytest.raises(openai.APIError) as info:
                await call(client, path, stream=True)
        finally:
            await client.close()
        assert info.value.body["type"] == "BadGatewayError" and info.value.body["code"] == 502


async def test_a_responses_stream_failing_mid_way_ends_with_error_and_response_failed():
    async with stack(sim=SIM, decode_retries=0) as (cluster, proxy, _):
        cluster.instances("decode")[0].inject("reset-after=2")
        client = sdk_client(proxy, RESPONSES)
        try:
            events = await call(client, RESPONSES, stream=True)
            # The SDK's stream helper: the lifecycle (same response id) accepted, no completion.
            cluster.instances("decode")[0].inject("reset-after=2")
            with pytest.raises(RuntimeError, match="response.completed"):
                async with client.responses.stream(model="sim-model", input=PROMPT, max_output_tokens=8) as s:
                    await s.get_final_response()
        finally:
            await client.close()
        types = [e.type for e in events]
        assert types[-2:] == ["error", "response.failed"] and "response.completed" not in types
        error, failed = events[-2:]
        assert isinstance(error, openai.types.responses.ResponseErrorEvent) and error.code == "server_error"
        assert failed.response.id == events[0].response.id and failed.response.status == "failed"
        assert failed.response.error.code == "server_error"
        assert failed.sequence_number == error.sequence_number + 1 == events[-3].sequence_number + 2


async def test_a_generate_stream_failing_mid_way_ends_with_the_envelope_and_done():
    async with stack(sim=SIM, decode_retries=0) as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=2")
        reply = await client.post(GENERATE, plain_body(GENERATE, stream=True))
        assert reply.status == 200
        events = reply.events
        assert events[-1] == b"data: [DONE]"
        assert msgspec.json.decode(events[-2][6:])["error"]["type"] == "BadGatewayError"


# -- relayed errors ----------------------------------------------------------------------------

async def test_vllms_openai_shaped_schema_error_reaches_anthropic_clients_in_anthropics_envelope():
    """vLLM answers a request-schema error on /v1/messages in OpenAI's envelope (its handler
    for every route): the proxy rewrites it to Anthropic's; vLLM's own Messages errors pass."""
    async with stack(sim=SIM) as (cluster, proxy, raw):
        client = sdk_client(proxy, MESSAGES)
        try:
            with pytest.raises(anthropic.BadRequestError) as info:
                await client.messages.create(model="sim-model", max_tokens="many",  # type: ignore[arg-type]
                                             messages=[{"role": "user", "content": PROMPT}], timeout=10.0)
        finally:
            await client.close()
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
        # The same error to an OpenAI client stays as vLLM sent it.
        reply = await raw.chat({"model": "sim-model", "max_tokens": "many",
                                "messages": [{"role": "user", "content": PROMPT}]})
        assert reply.status == 400 and set(reply.json()) == {"error"}


# -- errors made before any handler or route ---------------------------------------------------

async def test_a_refused_client_key_is_anthropics_401_on_messages_and_openais_elsewhere():
    async with stack(sim=SIM, api_keys=("k",)) as (cluster, proxy, _):
        ac = anthropic.AsyncAnthropic(base_url=proxy.url, auth_token="wrong", max_retries=2)
        oc = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="wrong", max_retries=2)
        try:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await call(ac, MESSAGES)
            assert info.value.body["error"]["type"] == "authentication_error"
            with pytest.raises(anthropic.AuthenticationError) as info:
                await call(ac, COUNT_TOKENS)
            assert info.value.body["error"]["type"] == "authentication_error"
            with pytest.raises(openai.AuthenticationError) as oinfo:
                await call(oc, CHAT)
            assert oinfo.value.body["code"] == "invalid_api_key"
        finally:
            await ac.close()
            await oc.close()
        assert cluster.records("decode") == []


async def test_bad_json_and_a_wrong_method_on_messages_are_anthropics():
    async with stack(sim=SIM) as (cluster, proxy, client):
        reply = await client.post(MESSAGES, b"{not json")
        assert reply.status == 400 and reply.json()["type"] == "error"
        assert reply.json()["error"]["type"] == "invalid_request_error"
        reply = await client.request("GET", MESSAGES)
        assert reply.status == 405 and reply.json()["error"]["type"] == "invalid_request_error"
        reply = await client.post("/v1/messages/batches", {})
        assert reply.status == 404 and reply.json()["error"]["type"] == "not_found_error"
        reply = await client.post(CHAT, b"{not json")
        assert reply.status == 400 and reply.json()["error"]["type"] == "BadRequestError"


async def test_a_proxy_shutting_down_is_503_overloaded_for_anthropic_clients():
    async with stack(sim=SIM) as (cluster, proxy, _):
        proxy.app.pipeline.close_admission()
        client = sdk_client(proxy, MESSAGES)
        try:
            await expect_error(proxy, client, MESSAGES, 503, True)
        finally:
            await client.close()
        assert cluster.records("prefill") == []


async def test_vllms_own_messages_stream_error_reaches_the_client_with_anthropics_type():
    """vLLM's in-stream failure on /v1/messages says ``internal_error``: relayed with its
    message, typed ``api_error`` (what Anthropic's clients know)."""
    async with stack(sim=SIM, decode_retries=0) as (cluster, proxy, _):
        cluster.instances("decode")[0].inject("error-after=2")
        client = sdk_client(proxy, MESSAGES)
        try:
            with pytest.raises(anthropic.APIStatusError) as info:
                await call(client, MESSAGES, stream=True)
        finally:
            await client.close()
        error = info.value.body["error"]
        assert error["type"] == "api_error" and "validation errors" in error["message"], info.value.body
