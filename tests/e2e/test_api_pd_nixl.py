"""/v1/messages, /v1/responses and /inference/v1/generate through P/D over NIXL, against real
vLLM: 1 prefill + 1 decode, and one plain instance of the same weights as the reference a client
of a single vLLM would see (``api`` cluster: every instance with ``--enable-scale-out`` and the
Responses store, as an operator serving these APIs starts them).

Each request goes through the proxy and, unchanged, to the single instance: the greedy text (or
token ids) and the usage are the same, decode received the prompt's KV over NIXL, and the client
sees no ``kv_transfer_params`` of the proxy's. The Responses store: a response made through the
proxy is retrieved through it, and a follow-up naming it continues it as on one instance.
Prompts are unique and shorter than one CPU KV block, so no prefix cache hides a transfer.
"""

from __future__ import annotations

import pytest
import vllm_e2e as E

CLUSTER = "api"
ORDER = 10
pytestmark = pytest.mark.vllm

MESSAGES, RESPONSES, GENERATE = E.MESSAGES, E.RESPONSES, E.GENERATE
STREAMS = [False, True]


@pytest.fixture(scope="module")
def proxy(api, start_proxy):
    return start_proxy("api-pd", prefill=[api.prefill.url], decode=[api.decode.url])


def body_for(path: str, prompt: str, *, stream: bool, n: int = 12, **extra) -> dict:
    if path == MESSAGES:
        body = {"model": E.MODEL_NAME, "max_tokens": n, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}
    else:
        body = {"model": E.MODEL_NAME, "input": prompt, "max_output_tokens": n, "temperature": 0}
    body["stream"] = stream
    body.update(extra)
    return body


named_events, text_of, ok = E.named_events, E.api_text, E.assert_api_ok


def final_usage(path: str, resp: E.Response) -> dict:
    if not resp.content_type.startswith("text/event-stream"):
        return resp.json()["usage"]
    events = named_events(resp)
    if path == MESSAGES:
        start = next(d for n, d in events if n == "message_start")["message"]["usage"]
        end = [d["usage"] for n, d in events if n == "message_delta"][-1]
        return {"start": start, **end}
    return next(d for n, d in events if n == "response.completed")["response"]["usage"]


def no_transfer_params(resp: E.Response) -> None:
    """No kv/ec_transfer_params with a value reach the client (vLLM's own ``null`` may)."""
    assert b"do_remote" not in resp.body and b"remote_block_ids" not in resp.body, E.describe(resp, 4000)
    payloads = ([d for _, d in named_events(resp)] if resp.content_type.startswith("text/event-stream")
                else [resp.json()])

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("kv_transfer_params", "ec_transfer_params"):
                    assert v is None, (k, v)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(payloads)


def one_transfer(api, d0) -> None:
    """Exactly one NIXL transfer into decode, and none failed."""
    assert E.delta(api.decode, E.NIXL_XFERS, d0, 1) == 1
    assert api.decode.metrics().get(E.NIXL_FAILED) == d0.get(E.NIXL_FAILED)


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
@pytest.mark.parametrize("path", [MESSAGES, RESPONSES], ids=["messages", "responses"])
def test_text_and_usage_equal_a_single_instance(api, proxy, path, stream):
    body = body_for(path, E.unique_prompt(), stream=stream)
    alone = E.post(api.single.url, path, body)
    ok(alone, stream)
    d0, p0 = api.decode.metrics(), api.prefill.metrics()

    resp = E.post(proxy.url, path, body)

    ok(resp, stream)
    assert text_of(path, resp) == text_of(path, alone) != ""
    one_transfer(api, d0)
    # The prefill leg generated one token, decode the rest.
    assert E.delta(api.prefill, "vllm:generation_tokens_total", p0, 1) == 1
    no_transfer_params(resp)
    # The client's usage is a single instance's: prompt from prefill, completion from decode,
    # cached tokens from prefill's prefix hits (none: the prompt is new).
    usage, single = final_usage(path, resp), final_usage(path, alone)
    assert usage == single, (usage, single)


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
def test_generate_token_ids_equal_a_single_instance(api, proxy, stream):
    tok = E.post(api.single.url, "/tokenize", {"model": E.MODEL_NAME, "prompt": E.unique_prompt()})
    assert tok.status == 200, E.describe(tok)
    body = {"model": E.MODEL_NAME, "token_ids": tok.json()["tokens"], "stream": stream,
            "sampling_params": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}}
    alone = E.post(api.single.url, GENERATE, body)
    assert alone.status == 200, E.describe(alone)
    d0 = api.decode.metrics()

    resp = E.post(proxy.url, GENERATE, body)

    E.assert_ok(resp, stream)

    def ids(r: E.Response) -> list[int]:
        if not stream:
            return r.json()["choices"][0]["token_ids"]
        return [t for ev in r.events() if isinstance(ev, dict) for c in ev.get("choices") or []
                for t in c.get("token_ids") or []]
    assert ids(resp) == ids(alone) and len(ids(resp)) == 12, (E.describe(resp), E.describe(alone))
    one_transfer(api, d0)
    assert b"do_remote" not in resp.body and b"remote_block_ids" not in resp.body, E.describe(resp)


def _id_of(resp: E.Response, stream: bool) -> str:
    if not stream:
        return resp.json()["id"]
    return next(d for n, d in named_events(resp) if n == "response.created")["response"]["id"]


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
def test_stored_response_retrieve_and_follow_up_as_a_single_instance(api, proxy, stream):
    """GET /v1/responses/{id} and a follow-up naming previous_response_id through the proxy give
    what the single instance gives for its own response."""
    body = body_for(RESPONSES, E.unique_prompt(), stream=stream, n=8)
    mine = E.post(proxy.url, RESPONSES, body)
    ok(mine, stream)
    theirs = E.post(api.single.url, RESPONSES, body)
    ok(theirs, stream)
    mine_id, their_id = _id_of(mine, stream), _id_of(theirs, stream)

    got = E.request(proxy.url, "GET", f"{RESPONSES}/{mine_id}")
    ref = E.request(api.single.url, "GET", f"{RESPONSES}/{their_id}")
    assert got.status == ref.status == 200, (E.describe(got), E.describe(ref))
    assert got.json()["id"] == mine_id and got.json()["status"] == ref.json()["status"] == "incomplete"
    assert text_of(RESPONSES, got) == text_of(RESPONSES, ref) == text_of(RESPONSES, mine) != ""
    assert got.json()["usage"] == ref.json()["usage"]
    no_transfer_params(got)

    follow = {"model": E.MODEL_NAME, "input": "And then?", "max_output_tokens": 8, "temperature": 0,
              "stream": stream}
    d0 = api.decode.metrics()
    nxt = E.post(proxy.url, RESPONSES, dict(follow, previous_response_id=mine_id))
    ok(nxt, stream)
    ref_next = E.post(api.single.url, RESPONSES, dict(follow, previous_response_id=their_id))
    ok(ref_next, stream)
    assert text_of(RESPONSES, nxt) == text_of(RESPONSES, ref_next) != ""
    assert final_usage(RESPONSES, nxt) == final_usage(RESPONSES, ref_next)
    # Served whole by the decode holding the history: no transfer for it.
    assert api.decode.metrics().get(E.NIXL_XFERS) == d0.get(E.NIXL_XFERS)
    no_transfer_params(nxt)
    # An id the cluster never made is vLLM's own 404.
    missing = E.request(proxy.url, "GET", f"{RESPONSES}/resp_0000000000000000")
    assert missing.status == 404, E.describe(missing)


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
@pytest.mark.parametrize("path", [MESSAGES, RESPONSES], ids=["messages", "responses"])
def test_cached_tokens_are_the_prefills_prefix_hits_as_on_a_single_instance(api, proxy, path, stream):
    """Two requests sharing a long prefix: the second hits the prefill's prefix cache (and the
    single instance's alike, same block size). The client's cached tokens are those hits, not
    the tokens decode received over NIXL, in each API's own fields."""
    prefix = E.unique_prompt(words=400)  # several 128-token blocks, shared by no earlier request
    first = body_for(path, prefix + " First question.", stream=stream, n=6)
    second = body_for(path, prefix + " Another question.", stream=stream, n=6)
    ok(E.post(api.single.url, path, first), stream)
    alone = E.post(api.single.url, path, second)  # what a single instance reports for it
    ok(alone, stream)
    ok(E.post(proxy.url, path, first), stream)
    p0 = api.prefill.metrics()
    resp = E.post(proxy.url, path, second)
    ok(resp, stream)
    hits = E.delta(api.prefill, "vllm:prefix_cache_hits_total", p0, 128)
    assert hits >= 128, f"the prefill found {hits} cached tokens"
    usage = final_usage(path, resp)
    if path == MESSAGES:
        assert usage["cache_read_input_tokens"] == hits, usage
    else:
        assert usage["input_tokens_details"]["cached_tokens"] == hits, usage
    assert usage == final_usage(path, alone), (usage, final_usage(path, alone))
    assert text_of(path, resp) == text_of(path, alone)
    no_transfer_params(resp)


ANTHROPIC_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                   "request_too_large", "rate_limit_error", "api_error", "overloaded_error"}


def test_messages_errors_reach_anthropic_clients_in_anthropics_envelope(api, proxy):
    """vLLM 0.32's own /v1/messages errors: request-schema errors in OpenAI's envelope, its
    handler's in Anthropic's with vLLM's type names. Through the proxy both are Anthropic's
    envelope with Anthropic's type for the status, the message kept; the proxy's own 404 too.
    What OpenAI's clients get stays as vLLM sent it."""
    anthropic = pytest.importorskip("anthropic")
    no_max_tokens = {"model": E.MODEL_NAME, "messages": [{"role": "user", "content": E.unique_prompt()}]}
    too_long = body_for(MESSAGES, E.unique_prompt(words=3000), stream=False, n=4)
    for body, status in ((no_max_tokens, 400), (too_long, 400)):
        alone = E.post(api.single.url, MESSAGES, body)
        resp = E.post(proxy.url, MESSAGES, body)
        assert alone.status == resp.status == status, (E.describe(alone), E.describe(resp))
        doc, own = resp.json(), alone.json()
        assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", E.describe(resp)
        # vLLM's message (the proxy's leg, e.g. with kv_transfer_params, may differ in details).
        assert doc["error"]["message"][:30] == own["error"]["message"][:30], (doc, own)
        # What vLLM itself answers: not what an Anthropic client recognises.
        assert own.get("type") != "error" or own["error"]["type"] not in ANTHROPIC_TYPES, own
    for path in (MESSAGES, "/v1/messages/count_tokens"):
        resp = E.post(proxy.url, path, dict(no_max_tokens, model="gpt-4o", max_tokens=4))
        assert resp.status == 404 and resp.json()["error"]["type"] == "not_found_error", E.describe(resp)
    chat = E.post(proxy.url, "/v1/chat/completions", {"model": E.MODEL_NAME, "messages": "not a list"})
    assert chat.status == 400 and set(chat.json()) == {"error"}, E.describe(chat)
    client = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=2)
    try:
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model=E.MODEL_NAME, max_tokens=4, messages=too_long["messages"])
        assert info.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.NotFoundError) as info:
            client.messages.create(model="gpt-4o", max_tokens=4, messages=too_long["messages"])
        assert info.value.body["error"]["type"] == "not_found_error"
    finally:
        client.close()
