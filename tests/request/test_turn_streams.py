"""turn_streams.py: decode's parameters out of the one event that carries them; a stream's
answer read back."""

from __future__ import annotations

import json

from epd_proxy.request.multiturn import NO_IDS, REASONING
from epd_proxy.request.turn_streams import params_of, read_stream, strip_stream_params

PARAMS = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[1, 2, 3]],
          "remote_engine_id": "e-1", "remote_num_tokens": 120, "remote_host": "h{x}\"y"}


def _data(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def test_only_the_event_that_carries_them_changes():
    head = _data({"choices": [{"index": 0, "delta": {"content": 'he said "kv_transfer_params":{} once'}}]})
    event = _data({"id": "x", "choices": [], "kv_transfer_params": PARAMS})
    out, found = strip_stream_params(head + event + b"data: [DONE]\n\n")
    assert out == head + _data({"id": "x", "choices": [], "kv_transfer_params": None}) + b"data: [DONE]\n\n"
    assert params_of(found) == PARAMS
    plain = head + b"data: [DONE]\n\n"
    assert strip_stream_params(plain)[0] is plain


def test_a_responses_event_nests_them():
    completed = {"type": "response.completed", "sequence_number": 9,
                 "response": {"id": "resp_1", "output": [], "kv_transfer_params": PARAMS, "status": "completed"}}
    event = b"event: response.completed\n" + _data(completed)
    out, found = strip_stream_params(event)
    doc = json.loads(out.split(b"data: ", 1)[1])
    assert doc["response"]["kv_transfer_params"] is None and doc["response"]["status"] == "completed"
    assert out.startswith(b"event: response.completed\ndata: ") and params_of(found) == PARAMS


def test_an_unclosed_object_is_left_alone():
    partial = b'data: {"kv_transfer_params":{"do_remote_decode":true'
    assert strip_stream_params(partial) == (partial, [])


def test_read_stream_with_token_ids():
    events = (_data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}],
                     "prompt_token_ids": [1, 2, 3]})
              + _data({"choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [7]}]})
              + _data({"choices": [{"index": 0, "delta": {"content": "lo"}, "token_ids": [8, 9]}]})
              + b"data: [DONE]\n\n")
    got = read_stream(events)
    assert (got.text, got.prompt_ids, got.output, got.reason) == ("Hello", [1, 2, 3], [7, 8, 9], "")
    completions = _data({"choices": [{"index": 0, "text": "ab", "token_ids": [4], "prompt_token_ids": [1]}]})
    got = read_stream(completions)
    assert (got.text, got.prompt_ids, got.output) == ("ab", [1], [4])


def test_read_stream_without_ids_or_with_reasoning():
    assert read_stream(_data({"choices": [{"index": 0, "delta": {"content": "x"}}]})).reason == NO_IDS
    got = read_stream(_data({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}, "token_ids": [1]}]}))
    assert got.reason == REASONING


# -- through the proxy, over the simulator ---------------------------------------------------------

from helpers import stack, wait_for  # noqa: E402

from epd_proxy.sim import SimConfig, expected_text  # noqa: E402

SYSTEM = " ".join(f"w{i}" for i in range(300))


def _sim(**kw) -> SimConfig:
    return SimConfig(**{"itl_ms": 0, "ttft_ms": 0.5, "bidirectional": True, "record_responses": True, **kw})


def _chat(user: str, prev: dict | None = None, answer: str = "", **kw) -> dict:
    msgs = [{"role": "system", "content": SYSTEM}] if prev is None else \
        prev["messages"] + [{"role": "assistant", "content": answer}]
    return {"model": "sim-model", "max_tokens": 100, "messages": msgs + [{"role": "user", "content": user}], **kw}


def _reads(cluster) -> int:
    n = 0
    for rec in cluster.records("prefill"):
        body = json.loads(rec.body) if isinstance(rec.body, bytes) and rec.body else {}
        kv = body.get("kv_transfer_params") or {}
        n += bool(kv.get("do_remote_decode") and kv.get("remote_num_tokens"))
    return n


def _stream_text(data: bytes) -> str:
    out = []
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for c in json.loads(event[6:])["choices"]:
                out.append(c["delta"].get("content") or "")
    return "".join(out)


async def _warm(client) -> None:
    r = await client.chat(_chat("warm up"))  # a non-stream answer: the proxy learns decode keeps blocks
    assert r.status == 200 and r.json()["kv_transfer_params"] is None


async def test_a_streams_last_event_parameters_are_kept_when_it_carries_the_token_ids():
    async with stack(sim=_sim(bidirectional_stream_params=True), local_prefill_max_tokens=0) as (
            cluster, proxy, client):
        await _warm(client)
        b1 = _chat("first question", stream=True, return_token_ids=True)
        r = await client.chat(b1)
        assert r.status == 200 and b"remote_block_ids" not in r.body
        # every event as decode sent it (the usage event it was asked for taken out), but
        # for the parameters of its last one
        sent = cluster.records("decode")[-1].response_body.split(b"\n\n")
        got = r.body.split(b"\n\n")
        params = [e for e in sent if b"remote_block_ids" in e]
        assert len(params) == 1 and strip_stream_params(params[0])[0] in got
        # (the finishing event is hidden_usage.py's to change)
        changed = [e for e in got if e not in sent and b'"kv_transfer_params"' not in e]
        assert [e for e in changed if b'"finish_reason":null' in e] == []
        text = _stream_text(r.body)
        assert text == expected_text(b1)
        b2 = _chat(" ".join(f"u{i}" for i in range(100)), b1, text)
        r = await client.chat(b2)
        assert r.status == 200 and r.json()["choices"][0]["message"]["content"] == expected_text(b2)
        assert _reads(cluster) == 1 and proxy.app.pipeline.turns.used == 1
        assert sum(i.stats.wrong_answers for i in cluster.instances("prefill")) == 0


async def test_a_streams_parameters_without_token_ids_are_stripped_and_freed():
    async with stack(sim=_sim(bidirectional_stream_params=True), local_prefill_max_tokens=0) as (
            cluster, proxy, client):
        await _warm(client)
        d = cluster.instances("decode")[0]
        kept = d.kv_reuse.kept_requests
        turns = proxy.app.pipeline.turns
        before = turns.fallbacks.get(NO_IDS, 0)
        b1 = _chat("first question", stream=True)
        r = await client.chat(b1)
        assert r.status == 200 and b"remote_block_ids" not in r.body and _stream_text(r.body) == expected_text(b1)
        assert turns.fallbacks[NO_IDS] == before + 1
        await wait_for(lambda: turns.freed == 1)
        assert d.kv_reuse.kept_requests == kept


async def test_a_responses_stream_never_shows_the_parameters_and_frees_the_blocks():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        d = cluster.instances("decode")[0]
        body = {"model": "sim-model", "input": SYSTEM, "max_output_tokens": 8, "stream": True, "store": False}
        r = await client.post("/v1/responses", body)
        assert r.status == 200 and b"response.completed" in r.body
        assert b"remote_block_ids" not in r.body and b'"kv_transfer_params":null' in r.body
        sent = cluster.records("decode")[-1].response_body
        assert b"remote_block_ids" in sent and strip_stream_params(sent)[0] == r.body
        turns = proxy.app.pipeline.turns
        assert turns.active and turns.fallbacks[NO_IDS] == 1
        await wait_for(lambda: turns.freed == 1)
        assert d.kv_reuse.kept_requests == 0
