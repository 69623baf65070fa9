"""vLLM's HTTP surface: stream format, validation, determinism, models, metrics."""

from __future__ import annotations

import asyncio

import msgspec

from epd_proxy.sim import SimCluster, VOCAB, expected_text, prompt_tokens
from simhelpers import chat_body, fast_config, metric, sse_events, stream_pieces, stream_text


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
        assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]
        assert len(toks) == 5
        for ev in toks[:-1]:
            (ch,) = ev["choices"]
            assert set(ch["delta"]) == {"content"} and ch["finish_reason"] is None
            assert "usage" not in ev
        assert toks[-1]["choices"][0]["finish_reason"] == "length"
        assert toks[-1]["choices"][0]["stop_reason"] is None
        assert usage["choices"] == [] and usage["usage"] == {
            "prompt_tokens": prompt_tokens(body), "total_tokens": prompt_tokens(body) + 5, "completion_tokens": 5}
        assert stream_text(evs) == expected_text(body)


async def test_stream_without_usage_and_continuous_usage(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        body = chat_body("no usage", max_tokens=3, stream=True)
        evs = (await http.chat(c.urls("pd")[0], body)).events
        assert len(evs) == 1 + 3 + 1 and all("usage" not in e for e in evs[:-1])
        body = dict(body, stream_options={"include_usage": True, "continuous_usage_stats": True})
        evs = (await http.chat(c.urls("pd")[0], body)).events
        assert [e["usage"]["completion_tokens"] for e in evs[1:-2]] == [1, 2, 3]
        assert evs[-2]["usage"]["completion_tokens"] == 3


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
                              "prompt_tokens_details": None}
        r = await http.completion(url, dict(body, stream=True, stream_options={"include_usage": True}))
        evs = r.events
        assert all(e["object"] == "text_completion" for e in evs[:-1])
        assert stream_text(evs) == expected_text(body)
        assert evs[-2]["choices"] == [] and evs[-2]["usage"]["completion_tokens"] == 6
        assert evs[0]["choices"][0].keys() >= {"index", "text", "logprobs", "finish_reason"}
        # Default length: 16 tokens, finish_reason "stop".
        j = (await http.completion(url, {"prompt": "no max"})).json
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


async def test_validation_errors(http):
    async with SimCluster(pd=1, prefill=1, config=fast_config()) as c:
        url = c.urls("pd")[0]
        r = await http.chat(url, chat_body(stream_options={"include_usage": True}))
        assert r.status == 400
        e = r.json["error"]
        assert e["type"] == "BadRequestError" and e["code"] == 400 and "stream=True" in e["message"]
        r = await http.chat(url, chat_body(stream=False, stream_options={"include_usage": True}))
        assert r.status == 400
        r = await http.chat(url, chat_body(max_tokens=1, min_tokens=5))
        assert r.status == 400 and "min_tokens" in r.json["error"]["message"]
        # max_completion_tokens is the cap on chat.
        r = await http.chat(url, chat_body(max_tokens=10, max_completion_tokens=1, min_tokens=5))
        assert r.status == 400
        assert (await http.chat(url, chat_body(max_tokens=10, min_tokens=5))).status == 200
        r = await http.chat(url, chat_body(model="gpt-4"))
        assert r.status == 404 and r.json["error"]["type"] == "NotFoundError"
        r = await http.post(url, "/v1/chat/completions", None, raw=b"{not json",
                            headers=[(b"content-type", b"application/json")])
        assert r.status == 400
        r = await http.post(url, "/v1/chat/completions", None, raw=msgspec.json.encode(chat_body()),
                            headers=[(b"content-type", b"text/plain")])
        assert r.status == 400 and "application/json" in r.json["error"]["message"]
        r = await http.chat(url, {"model": "sim-model", "messages": []})
        assert r.status == 400
        r = await http.chat(url, chat_body(max_tokens=0))
        assert r.status == 400
        r = await http.chat(url, chat_body(max_tokens=40000))
        assert r.status == 400 and "maximum context length" in r.json["error"]["message"]
        r = await http.get(url, "/v1/chat/completions")
        assert r.status == 405
        r = await http.get(url, "/nope")
        assert r.status == 404
        # A stream that fails validation is refused with a status, before any event (as vLLM).
        r = await http.chat(url, chat_body(stream=True, max_tokens=1, min_tokens=2))
        assert r.status == 400 and r.headers[b"content-type"] == b"application/json"


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
