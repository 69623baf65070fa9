"""The pre-commit deadline (--first-byte-timeout): the sweep itself, then over real sockets
504 with the envelope and every upstream leg closed."""

import asyncio

import pytest
from helpers import chat_body, stack, wait_for

from epd_proxy.config import StageTimeouts
from epd_proxy.request.deadline import Deadlines
from epd_proxy.sim import SimConfig


async def test_the_sweep_cancels_only_requests_past_their_deadline():
    d = Deadlines(0.05)
    late = asyncio.ensure_future(asyncio.sleep(30))
    prompt = asyncio.ensure_future(asyncio.sleep(30))
    d.enter(late)
    d.enter(prompt)
    d.leave(prompt)  # committed in time
    with pytest.raises(asyncio.CancelledError):
        await late
    assert d.expired(late) and not d.expired(prompt) and not prompt.done()
    d.leave(late)
    assert not d.expired(late)
    prompt.cancel()
    await d.close()


def _legs_closed(cluster) -> bool:
    return all(inst._in_flight == 0 for inst in cluster.all_instances())


def _assert_504(reply):
    assert reply.status == 504, reply.body
    err = reply.json()["error"]
    assert err["code"] == 504 and err["type"] == "GatewayTimeoutError"
    assert "first-byte timeout" in err["message"] and "127.0.0.1" not in err["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kv", ["nixl", "nixl-push"])
async def test_hung_prefill_gets_504_and_every_leg_is_closed(kv, stream):
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, kv_connector=kv)
    async with stack(sim=sim, timeouts=StageTimeouts(first_byte=0.3)) as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("hang")
        reply = await client.chat(chat_body(stream=stream))
        _assert_504(reply)
        await wait_for(lambda: _legs_closed(cluster), timeout=2)
        assert cluster.records("prefill")[-1].aborted
        if kv == "nixl-push":  # decode ran beside the prefill: closed too
            assert cluster.records("decode")[-1].aborted
        else:
            assert cluster.records("decode") == []
        assert proxy.app.pools["prefill"].instances[0].inflight == 0
        assert proxy.app.pools["decode"].instances[0].inflight == 0
        # The next request is unaffected.
        assert (await client.chat(chat_body(stream=stream))).status == 200


async def test_hung_encoder_gets_504_and_every_encoder_call_is_closed():
    # round-robin: the two images go to both encoders, one of which hangs (by uuid affinity
    # both could land on the other one).
    async with stack(encode=2, encode_policy="round-robin",
                     timeouts=StageTimeouts(first_byte=0.3)) as (cluster, proxy, client):
        cluster.instances("encode")[0].inject("hang")
        reply = await client.chat(chat_body(images=["https://x/a.png", "https://x/b.png"]))
        _assert_504(reply)
        await wait_for(lambda: _legs_closed(cluster), timeout=2)
        assert any(r.aborted for r in cluster.records("encode"))
        assert cluster.records("prefill") == []


async def test_the_deadline_spans_retries():
    # Each attempt's stage timeout alone would let the retries run past the deadline (a
    # retry never goes back to an instance that timed out: three of them, 0.2 s each).
    sim = SimConfig(itl_ms=0, ttft_ms=0.5)
    async with stack(prefill=3, sim=sim, decode_retries=3,
                     timeouts=StageTimeouts(prefill=0.2, first_byte=0.5)) as (cluster, proxy, client):
        for inst in cluster.instances("prefill"):
            inst.inject("hang", times=10)
        reply = await client.chat(chat_body())
        _assert_504(reply)
        await wait_for(lambda: _legs_closed(cluster), timeout=2)


async def test_a_stream_longer_than_the_deadline_is_not_cut():
    # The deadline ends at the commit point: decode's stream may run on.
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"decode": {"itl_ms": 20}})
    async with stack(sim=sim, timeouts=StageTimeouts(first_byte=0.2)) as (cluster, proxy, client):
        reply = await client.chat(chat_body(stream=True, max_tokens=20))
        assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
        assert b'"error"' not in reply.body
