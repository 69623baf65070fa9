"""turns/streams.py: decode's parameters out of the one event that carries them; a stream's
answer read back."""

from __future__ import annotations

import json
import re

from epd_proxy.request.relay import IdStrippingRelay, kept_bytes
from epd_proxy.request.turns.multiturn import NO_IDS, REASONING
from epd_proxy.request.turns.streams import params_of, read_stream, strip_stream_params

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
        # (the finishing event is usage/hidden.py's to change)
        changed = [e for e in got if e not in sent and b'"kv_transfer_params"' not in e]
        assert [e for e in changed if b'"finish_reason":null' in e] == []
        text = _stream_text(r.body)
        assert text == expected_text(b1)
        b2 = _chat(" ".join(f"u{i}" for i in range(100)), b1, text)
        r = await client.chat(b2)
        assert r.status == 200 and r.json()["choices"][0]["message"]["content"] == expected_text(b2)
        assert _reads(cluster) == 1 and proxy.app.pipeline.reuse.counts.turns["reused"] == 1
        assert sum(i.stats.wrong_answers for i in cluster.instances("prefill")) == 0


async def test_a_streams_parameters_without_token_ids_are_stripped_and_freed():
    async with stack(sim=_sim(bidirectional_stream_params=True), local_prefill_max_tokens=0) as (
            cluster, proxy, client):
        await _warm(client)
        d = cluster.instances("decode")[0]
        kept = d.kv_reuse.kept_requests
        counts = proxy.app.pipeline.reuse.counts
        before = counts.answers.get(NO_IDS, 0)
        # Learnt already (as after a first stream) that this decode's streams end without
        # parameters, so this one is not asked for its token ids; it ends with parameters.
        proxy.app.pipeline.reuse.stream_plain.add(d.url)
        b1 = _chat("first question", stream=True)
        r = await client.chat(b1)
        assert r.status == 200 and b"remote_block_ids" not in r.body and _stream_text(r.body) == expected_text(b1)
        assert counts.answers[NO_IDS] == before + 1
        await wait_for(lambda: counts.freed == 1)
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
        counts = proxy.app.pipeline.reuse.counts
        assert proxy.app.pipeline.turns.active and counts.answers[NO_IDS] == 1
        await wait_for(lambda: counts.freed == 1)
        assert d.kv_reuse.kept_requests == 0


# -- a decode that sends its parameters in a stream is asked for the stream's token ids ----------

_NORMAL = re.compile(rb'"id":"[^"]*"|"created":\d+')


def _normal(data: bytes) -> bytes:
    """A stream with what differs between two requests (their ids and times) blanked."""
    return _NORMAL.sub(b"", data)


def _asked(cluster) -> list[bool]:
    """Per decode request: whether it asked for token ids."""
    return [_body(rec).get("return_token_ids") is True for rec in cluster.records("decode")]


def _body(rec) -> dict:
    return json.loads(rec.body) if isinstance(rec.body, bytes) and rec.body else {}


def _clean(data: bytes) -> None:
    """Nothing of decode's parameters or of the token ids the proxy asked for reaches the client."""
    assert b"remote_block_ids" not in data and b'"kv_transfer_params":{' not in data
    assert b'"token_ids":[' not in data and b'"prompt_token_ids":[' not in data


async def _conversation(client) -> list[bytes]:
    """Three streamed turns, each answer as the client got it."""
    got: list[bytes] = []
    prev, text = None, ""
    for user in ("first question", " ".join(f"u{i}" for i in range(100)), " ".join(f"v{i}" for i in range(100))):
        body = _chat(user, prev, text, stream=True)
        r = await client.chat(body)
        assert r.status == 200
        _clean(r.body)
        text = _stream_text(r.body)
        assert text == expected_text(body)
        got.append(r.body)
        prev = body
    return got


async def test_streamed_turns_read_from_decode_once_it_sent_stream_parameters():
    async with stack(sim=_sim(bidirectional_stream_params=True), local_prefill_max_tokens=0) as (
            cluster, proxy, client):
        await _warm(client)
        probe = _chat("warm up", stream=True)
        first = await client.chat(probe)  # a decode not seen to end a stream yet: asked, to learn it
        assert first.status == 200 and _asked(cluster)[-1] is True
        _clean(first.body)
        assert proxy.app.pipeline.reuse.stream_decodes == {cluster.instances("decode")[0].url}
        again = await client.chat(probe)  # asked again (it sends parameters), the client gets the same bytes
        assert again.status == 200 and _asked(cluster)[-1] is True
        sent = cluster.records("decode")[-1].response_body
        assert b'"token_ids":[' in sent and b'"prompt_token_ids":[' in sent
        assert _normal(again.body) == _normal(first.body)
        reused = await _conversation(client)
        assert _asked(cluster)[-3:] == [True, True, True]
        assert _reads(cluster) == 2 and proxy.app.pipeline.reuse.counts.turns["reused"] == 2
        assert sum(i.stats.wrong_answers for i in cluster.instances("prefill")) == 0
        # a client that asked for the ids itself gets them
        mine = await client.chat(_chat("mine", stream=True, return_token_ids=True))
        assert b'"token_ids":[' in mine.body and b"remote_block_ids" not in mine.body
    # the answers are those of the path that reads nothing and asks for nothing, byte for byte
    async with stack(sim=_sim(bidirectional_stream_params=True), kv_reuse=False) as (cluster, proxy, client):
        plain_turns = await _conversation(client)
        assert not any(_asked(cluster)) and _reads(cluster) == 0
    assert [_normal(b) for b in reused] == [_normal(b) for b in plain_turns]


async def test_a_decode_that_never_sent_stream_parameters_is_never_asked():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        await _warm(client)
        b1 = _chat("first question", stream=True)
        for _ in range(2):
            r = await client.chat(b1)
            assert r.status == 200 and _stream_text(r.body) == expected_text(b1)
        # the warm-up, non-stream, was asked for token ids (its decode had not answered yet), and
        # the first stream, to learn whether the decode sends parameters in streams: it does not,
        # so the second is not asked
        assert proxy.app.pipeline.turns.active and _asked(cluster) == [True, True, False]
        assert proxy.app.pipeline.reuse.stream_decodes == set()
        assert proxy.app.pipeline.reuse.stream_plain == {cluster.instances("decode")[0].url}


class _Writer:
    """What a relay writes to, as bytes (the pure part of IdStrippingRelay)."""

    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        self.out += data

    def end(self, data: bytes = b"") -> None:
        self.out += data


class _Ctx:
    prefill_report = None


def test_ids_taken_out_of_events_cut_anywhere():
    events = (b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
              b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,2,3],"prompt_text":null}\n\n'
              + b''.join(b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"t%d"},"logprobs":null,'
                         b'"finish_reason":null,"token_ids":[%d]}]}\n\n' % (i, 100 + i) for i in range(5))
              + b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,'
              b'"finish_reason":"stop","stop_reason":null,"token_ids":[7,8]}]}\n\n'
              b'data: {"id":"c","choices":[],"kv_transfer_params":null}\n\ndata: [DONE]\n\n')
    want = events.replace(b'"prompt_token_ids":[1,2,3]', b'"prompt_token_ids":null')
    want = re.sub(rb'"token_ids":\[[0-9,]*\]', b'"token_ids":null', want)
    for size in (1, 7, 64, len(events)):
        w = _Writer()
        relay = IdStrippingRelay(w, None, _Ctx(), None, True)
        for i in range(0, len(events), size):
            relay.on_data(events[i:i + size])
        relay.on_end()
        assert bytes(w.out) == want, size
        assert kept_bytes(relay) == events
