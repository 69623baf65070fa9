"""vLLM's HTTP surface: stream format, validation, determinism, models, metrics."""

from __future__ import annotations

import asyncio

import msgspec
from simhelpers import chat_body, fast_config, metric, sse_events, stream_pieces, stream_text

from epd_proxy.sim import VOCAB, SimCluster, expected_text, prompt_tokens
from epd_proxy.sim.tokens import expected_tokens


async def test_chat_stream_format(http):
    async with SimCluster(pd=1, config=fast_config(created=1700000000)) as c:
        body = chat_body("format check", max_tokens=5, stream=True, stream_options={"include_usage": True})
        r = await http.chat(c.urls("pd")[0], body, rid="fmt-1")
        assert r.status == 200
        assert r.headers[b"content-type"].startswith(b"text/event-stream")
        assert r.headers[b"x-request-id"] == b"fmt-1"
        assert r.data.endswith(b"data: [DONE]\n\n")
        evs = r.events
        first, toks, usage, done = evs[0], evs[1:-2], evs[-2], evs[-1]
        assert done == "[DONE]"
        for ev in evs[:-1]:
            assert ev["id"] == "chatcmpl-fmt-1" and ev["object"] == "chat.completion.chunk"
            assert ev["created"] == 1700000000 and ev["model"] == "sim-model"
        # vLLM 0.32's chunks, with exactly the fields it sets.
        assert first == {"id": "chatcmpl-fmt-1", "object": "chat.completion.chunk", "created": 1700000000,
                         "model": "sim-model",
                         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None}
        assert len(toks) == 5
        for ev in toks[:-1]:
            (ch,) = ev["choices"]
            assert set(ev) == {"id", "object", "created", "model", "choices"}
            assert set(ch["delta"]) == {"content"} and ch["finish_reason"] is None
            assert set(ch) == {"index", "delta", "logprobs", "finish_reason", "token_ids"} and ch["token_ids"] is None
        (last,) = toks[-1]["choices"]
        assert last["finish_reason"] == "length" and last["stop_reason"] is None and last["token_ids"] is None
        # The usage chunk follows, so the fingerprint rides on it, not on the finish chunk.
        assert "system_fingerprint" not in toks[-1]
        fp = c.instances("pd")[0].system_fingerprint
        assert usage == {"id": "chatcmpl-fmt-1", "object": "chat.completion.chunk", "created": 1700000000,
                         "model": "sim-model", "choices": [],
                         "usage": {"prompt_tokens": prompt_tokens(body), "total_tokens": prompt_tokens(body) + 5,
                                   "completion_tokens": 5}, "system_fingerprint": fp}
        assert stream_text(evs) == expected_text(body)
        # Without a usage chunk, the chunk that carries finish_reason has the fingerprint.
        evs = (await http.chat(c.urls("pd")[0], dict(body, stream_options=None), rid="fmt-2")).events
        assert evs[-2]["system_fingerprint"] == fp and evs[-2]["choices"][0]["finish_reason"] == "length"
        assert all("system_fingerprint" not in e for e in evs[:-2])


async def test_stream_without_usage_and_continuous_usage(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        body = chat_body("no usage", max_tokens=3, stream=True)
        evs = (await http.chat(c.urls("pd")[0], body)).events
        assert len(evs) == 1 + 3 + 1 and all("usage" not in e for e in evs[:-1])
        body = dict(body, stream_options={"include_usage": True, "continuous_usage_stats": True})
        evs = (await http.chat(c.urls("pd")[0], body)).events
        assert [e["usage"]["completion_tokens"] for e in evs[:-2]] == [0, 1, 2, 3]  # the role chunk too
        p = prompt_tokens(body)
        assert evs[1]["usage"] == {"prompt_tokens": p, "total_tokens": p + 1, "completion_tokens": 1,
                                   "completion_tokens_details": None}
        assert list(evs[0]) == ["id", "object", "created", "model", "choices", "usage", "prompt_token_ids",
                                "prompt_text"]
        assert evs[-2]["usage"]["completion_tokens"] == 3 and "completion_tokens_details" not in evs[-2]["usage"]
        # Per choice, as vLLM counts it.
        evs = (await http.chat(c.urls("pd")[0], dict(body, n=2))).events
        assert [e["usage"]["completion_tokens"] for e in evs[:-2] if e["choices"][0]["index"] == 1] == [0, 1, 2, 3]
        assert evs[-2]["usage"]["completion_tokens"] == 6


async def test_completions_stream_and_non_stream(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        url = c.urls("pd")[0]
        body = {"model": "sim-model", "prompt": "Red Hat is", "max_tokens": 6}
        r = await http.completion(url, body, rid="c-1")
        j = r.json
        assert j["id"] == "cmpl-c-1" and j["object"] == "text_completion"
        assert j["choices"][0]["text"] == expected_text(body) and j["choices"][0]["finish_reason"] == "length"
        assert j["kv_transfer_params"] is None and j["ec_transfer_params"] is None
        assert j["usage"] == {"prompt_tokens": 3, "total_tokens": 9, "completion_tokens": 6,
                              "prompt_tokens_details": None, "completion_tokens_details": None}
        assert list(j) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                           "usage", "kv_transfer_params", "ec_transfer_params", "metrics"]
        assert list(j["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                                         "prompt_logprobs", "prompt_token_ids", "routed_experts"]
        assert j["metrics"] is None
        r = await http.completion(url, dict(body, stream=True, stream_options={"include_usage": True}))
        evs = r.events
        assert all(e["object"] == "text_completion" for e in evs[:-1])
        assert stream_text(evs) == expected_text(body)
        assert evs[-2]["choices"] == [] and evs[-2]["usage"]["completion_tokens"] == 6
        assert evs[-2]["system_fingerprint"] == j["system_fingerprint"]
        for ev in evs[:-2]:
            # No "usage" key at all unless usage was asked per chunk.
            assert list(ev) == ["id", "object", "created", "model", "choices"]
            assert list(ev["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason",
                                              "prompt_token_ids", "token_ids"]
        assert b'"usage":null' not in r.data
        r = await http.completion(url, dict(body, stream=True))
        evs = r.events
        assert all("usage" not in e for e in evs[:-1])
        assert evs[-2]["system_fingerprint"] == j["system_fingerprint"]
        assert all("system_fingerprint" not in e for e in evs[:-2])
        # No max_tokens: vLLM's completions default of 16 is a cap, so finish_reason "length" ...
        j = (await http.completion(url, {"prompt": "no max"})).json
        assert j["usage"]["completion_tokens"] == 16 and j["choices"][0]["finish_reason"] == "length"
        # ... while an explicit null means no cap: the simulated model stops by itself.
        j = (await http.completion(url, {"prompt": "no max", "max_tokens": None})).json
        assert j["usage"]["completion_tokens"] == 16 and j["choices"][0]["finish_reason"] == "stop"
        j = (await http.chat(url, chat_body("no max"))).json
        assert j["usage"]["completion_tokens"] == 16 and j["choices"][0]["finish_reason"] == "stop"


async def test_determinism_stream_equals_non_stream_equals_expected(http):
    async with SimCluster(pd=2, config=fast_config()) as c:
        a, b = c.urls("pd")
        body = chat_body("determinism", max_tokens=40, seed=3)
        j = (await http.chat(a, body, rid="same")).json
        s = (await http.chat(b, dict(body, stream=True), rid="same")).events
        assert j["choices"][0]["message"]["content"] == stream_text(s) == expected_text(body)
        j2 = (await http.chat(b, body, rid="same")).json
        assert j2 == j  # the same request to another instance of the cluster: identical bytes
        assert expected_text(dict(body, seed=4)) != expected_text(body)
        assert expected_text(dict(body, max_tokens=10)) == expected_text(body)[:len(expected_text(dict(body,
                                                                                                   max_tokens=10)))]
        # max_completion_tokens wins over max_tokens on chat.
        j = (await http.chat(a, dict(body, max_completion_tokens=4))).json
        assert j["usage"]["completion_tokens"] == 4
        assert j["choices"][0]["message"]["content"] == expected_text(dict(body, max_completion_tokens=4))


async def test_output_mixes_multibyte_utf8(http):
    assert any(len(t.encode()) - len(t) >= 3 for t in VOCAB)  # CJK
    assert any(any(len(ch.encode()) == 4 for ch in t) for t in VOCAB)  # emoji
    text = expected_text(chat_body("utf8 please", max_tokens=200))
    assert any(ord(ch) > 0xFFFF for ch in text) and any(0x4E00 <= ord(ch) <= 0x9FFF for ch in text)
    assert '"' in "".join(VOCAB) and "\\" in "".join(VOCAB)


async def test_some_event_is_split_inside_a_character(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        body = chat_body("split", max_tokens=30, stream=True)
        sink, err = await stream_pieces(c.urls("pd")[0], body)
        assert err is None
        undecodable = 0
        for _, piece in sink.pieces:
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError:
                undecodable += 1
        assert undecodable >= 1
        assert stream_text(sse_events(sink.data)) == expected_text(body)
    async with SimCluster(pd=1, config=fast_config(split_utf8=False)) as c:
        sink, err = await stream_pieces(c.urls("pd")[0], body)
        for _, piece in sink.pieces:
            piece.decode("utf-8")


async def test_n_choices(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        body = chat_body("two answers", max_tokens=4, n=2)
        j = (await http.chat(c.urls("pd")[0], body)).json
        assert [ch["index"] for ch in j["choices"]] == [0, 1]
        assert j["choices"][0]["message"]["content"] == expected_text(body)
        assert j["choices"][1]["message"]["content"] == expected_text(body, choice=1)
        assert j["usage"]["completion_tokens"] == 8
        evs = (await http.chat(c.urls("pd")[0], dict(body, stream=True))).events
        assert stream_text(evs, 1) == expected_text(body, choice=1)


def err(r) -> dict:
    assert r.headers[b"content-type"] == b"application/json"
    (e,) = r.json.values()
    assert list(e) == ["message", "type", "param", "code"] and e["code"] == r.status
    return e


async def test_validation_errors(http):
    """vLLM's own checks: BadRequestError, `` (parameter=X[, value=Y])`` appended, ``param`` X."""
    async with SimCluster(pd=1, prefill=1, config=fast_config()) as c:
        url = c.urls("pd")[0]
        r = await http.chat(url, chat_body(stream_options={"include_usage": True}))
        assert r.status == 400 and err(r) == {
            "message": "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            "type": "BadRequestError", "param": "stream_options", "code": 400}
        r = await http.chat(url, chat_body(stream=False, stream_options={"include_usage": True}))
        assert r.status == 400
        # An empty stream_options is falsy for vLLM's check.
        assert (await http.chat(url, chat_body(max_tokens=1, stream_options={}))).status == 200
        r = await http.chat(url, chat_body(max_tokens=1, min_tokens=5))
        assert r.status == 400 and err(r) == {
            "message": "min_tokens must be less than or equal to max_tokens=1, got 5.", "type": "BadRequestError",
            "param": None, "code": 400}
        # max_completion_tokens is the cap on chat.
        r = await http.chat(url, chat_body(max_tokens=10, max_completion_tokens=1, min_tokens=5))
        assert r.status == 400 and "max_tokens=1," in err(r)["message"]
        assert (await http.chat(url, chat_body(max_tokens=10, min_tokens=5))).status == 200
        r = await http.chat(url, chat_body(min_tokens=-1))
        assert r.status == 400 and err(r) == {
            "message": "min_tokens must be greater than or equal to 0, got -1.", "type": "BadRequestError",
            "param": None, "code": 400}
        r = await http.chat(url, chat_body(model="gpt-4"))
        assert r.status == 404 and err(r) == {
            "message": "The model `gpt-4` does not exist. Valid aliases: sim-model.", "type": "NotFoundError",
            "param": "model", "code": 404}
        assert (await http.chat(url, chat_body(model="", max_tokens=1))).status == 200  # empty: the default
        r = await http.chat(url, {"model": "sim-model", "messages": []})
        assert r.status == 400
        for cap in (0, -3):
            r = await http.chat(url, chat_body(max_tokens=cap))
            assert r.status == 400 and err(r) == {
                "message": f"max_tokens must be at least 1, got {cap}. (parameter=max_tokens, value={cap})",
                "type": "BadRequestError", "param": "max_tokens", "code": 400}
        r = await http.chat(url, chat_body(n=0))
        assert r.status == 400 and err(r) == {"message": "n must be at least 1, got 0.", "type": "BadRequestError",
                                              "param": None, "code": 400}
        r = await http.get(url, "/v1/chat/completions")
        assert r.status == 405
        r = await http.get(url, "/nope")
        assert r.status == 404
        # A stream that fails validation is refused with a status, before any event (as vLLM).
        r = await http.chat(url, chat_body(stream=True, max_tokens=1, min_tokens=2))
        assert r.status == 400 and r.headers[b"content-type"] == b"application/json"
        r = await http.completion(url, {"model": "sim-model"})
        assert r.status == 400 and err(r) == {
            "message": "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            "type": "BadRequestError", "param": "prompt", "code": 400}
        # The reason is in the record too.
        assert c.instances("pd")[0].generation_records()[-1].error.startswith("Either prompt")


async def test_schema_errors_look_like_pydantic(http):
    """Wrongly typed fields: FastAPI/pydantic's 400, "type": "Bad Request", param the location."""
    async with SimCluster(pd=1, config=fast_config()) as c:
        url = c.urls("pd")[0]
        r = await http.chat(url, chat_body(stream=True, stream_options={"include_usage": "yes!"}))
        assert r.status == 400 and err(r) == {
            "message": "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'body.stream_options.include_usage', "
                       "'msg': 'Input should be a valid boolean, unable to interpret input', 'input': 'yes!'}",
            "type": "Bad Request", "param": "body.stream_options.include_usage", "code": 400}
        r = await http.chat(url, chat_body(stream=True, stream_options="x"))
        assert err(r)["message"] == (
            "1 validation error:\n  {'type': 'model_type', 'loc': 'body.stream_options', 'msg': 'Input should be a "
            "valid dictionary or instance of StreamOptions', 'input': 'x', 'ctx': {'class_name': 'StreamOptions'}}")
        r = await http.chat(url, chat_body(max_tokens="ten", n=[1], model=5))
        e = err(r)
        assert e["type"] == "Bad Request" and e["param"] == "body.model"
        assert e["message"] == (
            "3 validation errors:\n"
            "  {'type': 'string_type', 'loc': 'body.model', 'msg': 'Input should be a valid string', 'input': '5'}\n"
            "  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should be a valid integer, unable "
            "to parse string as an integer', 'input': 'ten'}\n"
            "  {'type': 'int_type', 'loc': 'body.n', 'msg': 'Input should be a valid integer', "
            "'input': '<list of 1 items>'}")
        r = await http.chat(url, chat_body(max_tokens=1.5))
        assert "'int_from_float'" in err(r)["message"] and err(r)["param"] == "body.max_tokens"
        r = await http.chat(url, chat_body(min_tokens=None))
        assert err(r)["param"] == "body.min_tokens" and "'input': 'None'" in err(r)["message"]
        r = await http.chat(url, chat_body(stream=2))
        assert err(r)["param"] == "body.stream" and "'bool_parsing'" in err(r)["message"]
        r = await http.chat(url, chat_body(kv_transfer_params=[]))
        assert err(r)["message"] == (
            "1 validation error:\n  {'type': 'dict_type', 'loc': 'body.kv_transfer_params', 'msg': 'Input should "
            "be a valid dictionary', 'input': '<list of 0 items>'}")
        r = await http.chat(url, {"model": "sim-model", "messages": "hi"})
        assert err(r)["param"] == "body.messages" and "'list_type'" in err(r)["message"]
        r = await http.chat(url, {"model": "sim-model"})
        assert err(r)["message"] == ("1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', "
                                     "'msg': 'Field required', 'input': '<dict of 1 items>'}")
        r = await http.completion(url, {"prompt": 5})
        assert err(r)["message"].startswith("4 validation errors:\n  {'type': 'list_type', 'loc': 'body.prompt'")
        r = await http.post(url, "/v1/chat/completions", None, raw=b"[1, 2]",
                            headers=[(b"content-type", b"application/json")])
        assert err(r) == {"message": "1 validation error:\n  {'type': 'model_type', 'loc': 'body', 'msg': 'Input "
                                     "should be a valid dictionary or instance of ChatCompletionRequest', 'input': "
                                     "'<list of 2 items>', 'ctx': {'class_name': 'ChatCompletionRequest'}}",
                          "type": "Bad Request", "param": "body", "code": 400}
        r = await http.post(url, "/v1/chat/completions", None, raw=b"{not json",
                            headers=[(b"content-type", b"application/json")])
        assert r.status == 400 and err(r) == {
            "message": "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.1', 'msg': 'JSON decode error', "
                       "'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting property name enclosed in double "
                       "quotes'}}", "type": "Bad Request", "param": "body.1", "code": 400}
        r = await http.post(url, "/v1/chat/completions", None, raw=msgspec.json.encode(chat_body()),
                            headers=[(b"content-type", b"text/plain")])
        assert r.status == 400 and err(r) == {
            "message": "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            "type": "Bad Request", "param": None, "code": 400}
        # Lax conversions vLLM accepts are accepted: "yes" is true, "3" is 3, true is 1.
        r = await http.chat(url, chat_body(stream="yes", max_tokens="3"))
        assert r.status == 200 and stream_text(r.events) == expected_text(chat_body(max_tokens=3))
        j = (await http.chat(url, chat_body(max_tokens=True, n=2.0))).json
        assert j["usage"]["completion_tokens"] == 2 and len(j["choices"]) == 2


async def test_context_length(http):
    """A prompt that fits with a max_tokens that does not: 200, output capped, "length"."""
    async with SimCluster(pd=1, config=fast_config(max_model_len=64)) as c:
        url = c.urls("pd")[0]
        body = chat_body(" ".join(["w"] * 49), max_tokens=60)  # 50 prompt tokens
        assert prompt_tokens(body) == 50
        j = (await http.chat(url, body)).json
        assert j["usage"]["completion_tokens"] == 14 and j["choices"][0]["finish_reason"] == "length"
        assert j["choices"][0]["message"]["content"] == expected_text(body, max_model_len=64)
        assert expected_text(body, max_model_len=64) == expected_text(dict(body, max_tokens=14))
        evs = (await http.chat(url, dict(body, stream=True))).events
        assert stream_text(evs) == expected_text(body, max_model_len=64)
        assert evs[-2]["choices"][0]["finish_reason"] == "length"
        # No cap: the model's own length, unless the context ends first.
        j = (await http.chat(url, chat_body(" ".join(["w"] * 59)))).json
        assert j["usage"]["completion_tokens"] == 4 and j["choices"][0]["finish_reason"] == "length"
        # min_tokens is checked against the capped budget.
        r = await http.chat(url, dict(body, min_tokens=20))
        assert err(r)["message"] == "min_tokens must be less than or equal to max_tokens=14, got 20."
        # max_tokens beyond the context itself is a 400 ...
        r = await http.chat(url, chat_body(max_tokens=65))
        assert r.status == 400 and err(r) == {
            "message": "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer output tokens. "
                       "(parameter=max_tokens, value=65)", "type": "BadRequestError", "param": "max_tokens",
            "code": 400}
        r = await http.chat(url, chat_body(max_completion_tokens=65))
        assert err(r)["param"] == "max_completion_tokens"
        # ... and so is a prompt longer than the context, whatever max_tokens is.
        long = chat_body(" ".join(["w"] * 99), max_tokens=1)
        r = await http.chat(url, long)
        assert r.status == 400 and err(r) == {
            "message": "This model's maximum context length is 64 tokens. However, your prompt contains at least 65 "
                       "input tokens, which exceeds this limit even without any output tokens. Please reduce the "
                       "length of the input prompt. (parameter=input_tokens, value=65)",
            "type": "BadRequestError", "param": "input_tokens", "code": 400}
        # Token ids are counted exactly.
        r = await http.completion(url, {"prompt": list(range(70)), "max_tokens": 1})
        assert "contains 70 input tokens" in err(r)["message"] and err(r)["message"].endswith("value=70)")
        # A prompt that fills the context leaves no room: vLLM's max_tokens check.
        r = await http.completion(url, {"prompt": list(range(64))})
        assert err(r)["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"


async def test_models_health_version_metrics(http):
    async with SimCluster(pd=1, config=fast_config(model="my/model", max_model_len=4096, max_num_seqs=7)) as c:
        url = c.urls("pd")[0]
        j = (await http.get(url, "/v1/models")).json
        assert j["object"] == "list"
        (m,) = j["data"]
        assert m["id"] == "my/model" and m["object"] == "model" and m["root"] == "my/model"
        assert m["max_model_len"] == 4096 and m["owned_by"] == "vllm"
        assert (await http.get(url, "/version")).json["version"].startswith("0.32")
        await http.chat(url, chat_body(model="my/model", max_tokens=3))
        await http.chat(url, chat_body(model="my/model", max_tokens=3, stream=True))
        r = await http.get(url, "/metrics")
        assert r.status == 200 and r.headers[b"content-type"].startswith(b"text/plain")
        text = r.data.decode()
        assert metric(text, "vllm:num_requests_running") == 0
        assert metric(text, "vllm:num_requests_waiting") == 0
        assert metric(text, "vllm:kv_cache_usage_perc") == 0
        # vLLM's CacheConfig as an info gauge: what the usage is a fraction of.
        info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
        assert len(info) == 1 and info[0].endswith("} 1.0")
        assert 'num_gpu_blocks="65536"' in info[0] and 'block_size="16"' in info[0] and 'engine="0"' in info[0]
        assert metric(text, "vllm:request_success_total") == 2
        assert 'model_name="my/model"' in text
        assert metric(text, "vllm:generation_tokens_total") == 6
        assert metric(text, "sim:requests_total") == 2


async def test_running_waiting_and_max_num_seqs(http):
    cfg = fast_config(max_num_seqs=2, itl_ms=5)
    async with SimCluster(pd=1, config=cfg) as c:
        url = c.urls("pd")[0]
        inst = c.instances("pd")[0]
        tasks = [asyncio.create_task(http.chat(url, chat_body(f"q{i}", max_tokens=40))) for i in range(5)]
        for _ in range(200):  # until all five have arrived (a loaded machine may be slow)
            if len(inst.records) == 5:
                break
            await asyncio.sleep(0.005)
        text = (await http.get(url, "/metrics")).data.decode()
        assert metric(text, "vllm:num_requests_running") == 2
        assert metric(text, "vllm:num_requests_waiting") == 3
        assert metric(text, "vllm:kv_cache_usage_perc") > 0
        rs = await asyncio.gather(*tasks)
        assert all(r.status == 200 for r in rs)
        recs = inst.generation_records()
        # Five requests of >= 200 ms each, two at a time: the last ends after three rounds.
        assert max(r.t_end for r in recs) - min(r.t_received for r in recs) >= 0.55
        starts = sorted(r.t_end for r in recs)
        assert starts[2] - starts[0] >= 0.15  # the third waited for a slot


async def test_latency_model(http):
    cfg = fast_config(ttft_ms=30, ttft_per_token_ms=1.0, itl_ms=10)
    async with SimCluster(pd=1, config=cfg) as c:
        body = chat_body("one two three four five six seven eight nine", max_tokens=6, stream=True)
        sink, _ = await stream_pieces(c.urls("pd")[0], body)
        rec = c.instances("pd")[0].records[-1]
        first_token = sink.pieces[0][0] - rec.t_received
        assert first_token >= 0.030 + 0.010  # 30 ms + 10 prompt tokens x 1 ms
        total = rec.t_end - rec.t_received
        assert total >= 0.040 + 5 * 0.010 * 0.9


async def test_an_idle_engine_steps_as_soon_as_a_prefill_is_ready(http):
    # The engine ticks at most once per itl while sequences are producing tokens; an
    # engine whose last step finished its work starts the next one when a request is
    # ready, as vLLM does, instead of waiting out the rest of an itl.
    cfg = fast_config(ttft_ms=2.0, itl_ms=400)
    async with SimCluster(pd=1, config=cfg) as c:
        url = c.urls("pd")[0]
        assert (await http.chat(url, chat_body("warm", max_tokens=1))).status == 200
        sink, err = await stream_pieces(url, chat_body("next", max_tokens=2, stream=True))
        assert err is None
        rec = c.instances("pd")[0].records[-1]
        assert sink.pieces[0][0] - rec.t_received < 0.2  # not held to the previous request's tick
        assert rec.t_end - rec.t_received >= 0.4 * 0.9  # the second token is a full itl later


async def test_several_served_names_each_a_card_and_others_404(http):
    cluster = SimCluster.from_spec("pd=1,models=a|b", config=fast_config())
    async with cluster as c:
        url = c.urls("pd")[0]
        cards = (await http.get(url, "/v1/models")).json["data"]
        assert [m["id"] for m in cards] == ["a", "b"] and {m["root"] for m in cards} == {"a"}
        assert all(m["parent"] is None and m["object"] == "model" for m in cards)
        r = await http.chat(url, chat_body(model="b", max_tokens=2))
        assert r.status == 200 and r.json["model"] == "b"  # vLLM echoes the served name asked for
        r = await http.chat(url, chat_body(model="c", max_tokens=2))
        assert r.status == 404
        assert r.json["error"]["type"] == "NotFoundError" and r.json["error"]["code"] == 404



async def test_a_stream_merges_tokens_into_events_as_vllm_behind_its_engine(http):
    """``stream_merge``: every N tokens (and the last ones) in one event, their text joined, the
    role chunk with the first; the answer and its usage are the same."""
    async with SimCluster(pd=1, config=fast_config(stream_merge=3)) as c:
        url = c.urls("pd")[0]
        body = chat_body("merged", max_tokens=8, stream=True, stream_options={"include_usage": True})
        events = (await http.chat(url, body)).events
        tokens = expected_tokens(body)
        assert [ch["delta"].get("content") for e in events[:-2] for ch in e["choices"]] == [
            "", "".join(tokens[0:3]), "".join(tokens[3:6]), "".join(tokens[6:8])]
        assert events[-2]["usage"]["completion_tokens"] == 8 and events[-1] == "[DONE]"
        prompt = {"model": "sim-model", "prompt": "merged text", "max_tokens": 7, "stream": True}
        events = (await http.post(url, "/v1/completions", prompt)).events
        tokens = expected_tokens(prompt)
        assert [ch["text"] for e in events[:-1] for ch in e["choices"]] == [
            "".join(tokens[0:3]), "".join(tokens[3:6]), tokens[6]]
