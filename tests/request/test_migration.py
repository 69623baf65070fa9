"""A committed stream whose decode breaks off is continued on another decode, over real sockets
(request/migration.py): the client sees one stream (one id, one terminator, the whole answer's
tokens and usage), the broken decode's request is aborted, and what cannot or may not be
continued ends as before: an in-band error and the terminator."""

import asyncio
import io
import time

import msgspec
import pytest
from helpers import chat_body, stack, wait_for

from epd_proxy.instances.health import EJECTED, HEALTHY
from epd_proxy.observe.access_log import AccessLog
from epd_proxy.request.migration import STALL_CEILING, STALL_FLOOR, stall_after
from epd_proxy.sim import SimConfig

pytestmark = pytest.mark.asyncio

SIM = SimConfig(itl_ms=2, ttft_ms=0.5)


def _events(reply) -> list:
    """The stream's events: parsed JSON, or the terminator as the string."""
    out = []
    for raw in reply.events:
        assert raw.startswith(b"data: "), raw
        data = raw[len(b"data: "):]
        out.append("[DONE]" if data == b"[DONE]" else msgspec.json.decode(data))
    return out


def _check_one_stream(reply, tokens: int, field: str = "content") -> list:
    """One whole stream: one id and created, one terminator at the end, no error, ``tokens``
    text events; returns the events."""
    assert reply.status == 200, reply.body
    events = _events(reply)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    data = events[:-1]
    assert not [e for e in data if "error" in e], data
    assert len({e["id"] for e in data}) == 1 and len({e["created"] for e in data}) == 1
    assert {e["model"] for e in data} == {"sim-model"}
    texts = [c.get("delta", c).get(field) if "delta" in c else c.get("text") for e in data for c in e["choices"]]
    assert len([t for t in texts if t]) == tokens
    roles = [c["delta"]["role"] for e in data for c in e["choices"] if "delta" in c and "role" in c["delta"]]
    assert len(roles) <= 1  # the role announced once
    finishes = [c["finish_reason"] for e in data for c in e["choices"] if c.get("finish_reason")]
    assert finishes == ["length"]
    return data


@pytest.mark.parametrize("fault,reason", [("reset-after=5", "reset"), ("error-after=5", "error")])
async def test_a_chat_stream_whose_decode_breaks_off_is_continued_on_the_other(fault, reason):
    async with stack(decode=2, sim=SIM, routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject(fault, times=1)  # round-robin starts there
        body = chat_body(stream=True, max_tokens=40, stream_options={"include_usage": True})
        reply = await client.chat(body)
        data = _check_one_stream(reply, 40)
        usage = data[-1]["usage"]
        assert usage["completion_tokens"] == 40
        assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]
        decodes = cluster.records("decode")
        assert len(decodes) == 2 and decodes[0].instance != decodes[1].instance
        assert proxy.app.metrics.migrations == {(reason, "ok"): 1}
        assert proxy.app.metrics.stream_errors == 0
        # The continuation's prompt is the conversation with the answer so far, continued.
        cont = msgspec.json.decode(decodes[1].body)
        assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
        assert cont["messages"][-1]["role"] == "assistant" and cont["messages"][-1]["content"]
        assert cont["max_tokens"] == 35


async def test_a_stream_without_usage_asked_gets_none_after_a_move():
    async with stack(decode=2, sim=SIM, routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        reply = await client.chat(chat_body(stream=True, max_tokens=12))
        data = _check_one_stream(reply, 12)
        assert not [e for e in data if e.get("usage")]


async def test_a_completions_stream_is_continued_with_its_prompt_and_the_text_so_far():
    async with stack(decode=2, sim=SIM, routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=4", times=1)
        body = {"model": "sim-model", "prompt": "Once upon a time", "max_tokens": 20, "stream": True}
        reply = await client.post("/v1/completions", body)
        _check_one_stream(reply, 20)
        cont = msgspec.json.decode(cluster.records("decode")[1].body)
        assert cont["prompt"].startswith("Once upon a time") and len(cont["prompt"]) > len("Once upon a time")
        assert cont["max_tokens"] == 16


async def test_a_stalled_decode_is_left_within_the_stall_rule():
    async with stack(decode=2, sim=SIM, routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("stall-after=5:20", times=1)
        t0 = time.monotonic()
        reply = await client.chat(chat_body(stream=True, max_tokens=30))
        _check_one_stream(reply, 30)
        assert time.monotonic() - t0 < 4  # the 1.5 s floor, not the 20 s stall
        assert proxy.app.metrics.migrations == {("stall", "ok"): 1}
        # The stalled decode's request was aborted (its connection closed).
        stalled = cluster.records("decode")[0]
        await wait_for(lambda: stalled.aborted, timeout=5)
        # A stall is an instance signal (``stalled``); one alone does not take the decode out.
        decode = proxy.app.pools["decode"].instances[0]
        assert decode.health.errors.get("stalled") == 1 and decode.health.state is HEALTHY


async def test_streams_stalling_together_take_their_decode_out_of_rotation():
    """A wedged decode (SIGSTOPped, hung: connections open, no bytes) stalls every stream on it
    at once: their stalls, instance signals, eject it without waiting for the probes, and new
    requests go to the other decode."""
    async with stack(decode=2, sim=SIM, routing="round-robin") as (cluster, proxy, client):
        wedged = cluster.instances("decode")[0]
        wedged.inject("stall-after=5:20", times=3)
        replies = await asyncio.gather(*(client.chat(chat_body(f"stream {i}", stream=True, max_tokens=30))
                                         for i in range(6)))
        for reply in replies:
            _check_one_stream(reply, 30)
        assert proxy.app.metrics.migrations == {("stall", "ok"): 3}
        decode = proxy.app.pools["decode"].instances[0]
        assert decode.url == wedged.url and decode.health.state is EJECTED
        assert decode.health.errors.get("stalled") == 3
        before = len(wedged.records)
        for _ in range(4):
            _check_one_stream(await client.chat(chat_body(stream=True, max_tokens=4)), 4)
        assert len(wedged.records) == before  # every new request on the other decode


async def test_past_the_migration_limit_the_stream_ends_in_band():
    async with stack(decode=2, sim=SIM, migration_limit=1, routing="round-robin") as (cluster, proxy, client):
        for inst in cluster.instances("decode"):
            inst.inject("reset-after=3", times=2)
        reply = await client.chat(chat_body(stream=True, max_tokens=20))
        events = _events(reply)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert "migration limit (1)" in events[-2]["error"]["message"]
        assert len({e["id"] for e in events[:-2]}) == 1
        assert proxy.app.metrics.migrations == {("reset", "moved"): 1, ("reset", "limit"): 1}


@pytest.mark.parametrize("extra", [{"n": 2}, {"logprobs": True}, {"seed": 7}])
async def test_an_unsound_continuation_ends_in_band_as_before(extra):
    async with stack(decode=2, sim=SIM, routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        reply = await client.chat(chat_body(stream=True, max_tokens=10, **extra))
        events = _events(reply)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert len(cluster.records("decode")) == 1
        assert proxy.app.metrics.migrations == {}


async def test_no_stream_migration_ends_in_band_as_before():
    async with stack(decode=2, sim=SIM, stream_migration=False, routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        reply = await client.chat(chat_body(stream=True, max_tokens=10))
        events = _events(reply)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert len(cluster.records("decode")) == 1


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_the_move_is_in_the_metrics_and_the_access_log(fmt):
    out = io.StringIO()
    async with stack(decode=2, sim=SIM, routing="round-robin") as (cluster, proxy, client):
        proxy.app.pipeline.access_log = AccessLog(fmt, stream=out)
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        _check_one_stream(await client.chat(chat_body(stream=True, max_tokens=10)), 10)
        text = (await client.request("GET", "/metrics")).body.decode()
        assert 'epd_proxy_stream_migrations_total{reason="reset",result="ok"} 1.0' in text
    line, = [line for line in out.getvalue().splitlines() if "/v1/chat/completions" in line]
    if fmt == "text":
        assert " moved=reset:ok ok" in line
    else:
        moves = msgspec.json.decode(line)["moves"]
        assert [(m["reason"], m["result"]) for m in moves] == [("reset", "ok")] and moves[0]["from"] != moves[0]["to"]


async def test_a_whole_answer_whose_decode_dies_before_answering_is_retried_on_the_other():
    async with stack(decode=2, sim=SIM, routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        reply = await client.chat(chat_body(max_tokens=10))
        assert reply.status == 200, reply.body
        assert reply.json()["usage"]["completion_tokens"] == 10
        decodes = cluster.records("decode")
        assert [r.instance for r in decodes] == ["decode-0", "decode-1"]


async def test_the_console_shows_the_move_in_the_requests_waterfall():
    async with stack(decode=2, sim=SIM, routing="round-robin") as (cluster, proxy, client):
        await client.request("GET", "/console/api/state")  # a console looks: requests are recorded
        cluster.instances("decode")[0].inject("reset-after=3", times=1)
        _check_one_stream(await client.chat(chat_body(stream=True, max_tokens=10)), 10)
        one, = (await client.request("GET", "/console/api/state")).json()["recent"]
        d0, d1 = cluster.urls("decode")
        assert one["moves"] and one["moves"][0]["from"] == d0 and one["moves"][0]["to"] == d1
        move, = [w for w in one["waterfall"] if w["stage"] == "move"]
        assert move["failed"] == [d0] and move["instances"] == [d1] and move["result"] == "ok"
        assert "decode broke off (reset)" in move["label"]
        assert move["start_ms"] >= one["first_byte_ms"]
        assert [leg[1:] for leg in one["legs"] if leg[0] == "decode"] == [[d0, True], [d1, False]]


@pytest.mark.parametrize("connector", ["nixl-push", "mooncake"])
async def test_a_stream_is_continued_with_a_push_connector_too(connector):
    sim = SimConfig(itl_ms=2, ttft_ms=0.5, kv_connector=connector)
    async with stack(decode=2, sim=sim, routing="round-robin") as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=4", times=1)
        reply = await client.chat(chat_body(stream=True, max_tokens=16, stream_options={"include_usage": True}))
        data = _check_one_stream(reply, 16)
        assert data[-1]["usage"]["completion_tokens"] == 16
        prefills = [r for r in cluster.records("prefill") if r.path == "/v1/chat/completions"]
        assert len(prefills) == 2  # the continuation's prompt prefilled too, then handed over
        assert proxy.app.metrics.migrations == {("reset", "ok"): 1}


async def test_the_stall_rule_follows_the_streams_pace_within_its_bounds():
    assert stall_after(0, 0.0) == STALL_FLOOR  # no pace yet: the floor
    assert stall_after(100, 1.0) == STALL_FLOOR  # 10 ms a read: 0.1 s, raised to the floor
    assert stall_after(10, 2.0) == pytest.approx(2.0)  # 200 ms a read: ten of them
    assert stall_after(2, 20.0) == STALL_CEILING  # 10 s a read: bounded
