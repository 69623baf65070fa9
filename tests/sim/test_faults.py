"""Every fault kind does what it says."""

from __future__ import annotations

import asyncio
import time

import pytest
from simhelpers import (
    GENERIC_EVENT,
    chat_body,
    failure,
    fast_config,
    prefill_body,
    push_decode_params,
    sse_events,
    stream_pieces,
    stream_text,
)

from epd_proxy.http.transport import TransportTimeouts, UpstreamError, UpstreamTimeout
from epd_proxy.sim import SimCluster, SimConfig, expected_text, parse_faults
from epd_proxy.sim.faults import FaultSource, FaultSyntaxError, media_matches


def test_fault_syntax():
    fs = parse_faults("decode:reset-after=3, prefill:status=503,encode:hang,stall-after=2:0.5,slow-body=0.1")
    assert [(f.role, f.name, f.arg) for f in fs] == [
        ("decode", "reset-after", 3), ("prefill", "status", 503), ("encode", "hang", None),
        (None, "stall-after", 2), (None, "slow-body", 0.1)]
    assert fs[3].arg2 == 0.5
    for bad in ("bogus", "status=abc", "worker:hang", "hang=3"):
        with pytest.raises(FaultSyntaxError):
            parse_faults(bad)


async def test_status_fault_and_role_scope(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        d, p = c.urls("decode")[0], c.urls("prefill")[0]
        r = await http.chat(d, chat_body(max_tokens=2), fault="status=503")
        assert r.status == 503
        assert r.json["error"] == {"message": r.json["error"]["message"], "type": "ServiceUnavailableError",
                                   "param": None, "code": 503}
        # Scoped to prefill: a decoder ignores it.
        r = await http.chat(d, chat_body(max_tokens=2), fault="prefill:status=503")
        assert r.status == 200
        r = await http.chat(p, prefill_body(chat_body()), fault="prefill:status=429,decode:status=500")
        assert r.status == 429
        # The body field works as well (it survives a proxy that drops unknown headers).
        r = await http.chat(d, chat_body(max_tokens=2, sim_fault="decode:status=502"))
        assert r.status == 502
        r = await http.chat(d, chat_body(), fault="nonsense")
        assert r.status == 400 and r.json["error"]["param"] == "x-sim-fault"
        rec = c.instances("decode")[0].records[0]
        assert rec.fault == "status=503" and rec.status == 503


async def test_error_after(http):
    async with SimCluster(decode=1, config=fast_config()) as c:
        d = c.urls("decode")[0]
        body = chat_body("err", max_tokens=8, stream=True)
        r = await http.chat(d, body, fault="error-after=3")
        assert r.status == 200
        evs = r.events
        assert evs[-1] == "[DONE]"
        assert set(evs[-2]) == {"error"} and evs[-2]["error"]["type"] == "InternalServerError"
        assert stream_text(evs) == expected_text(dict(body, max_tokens=3))
        r = await http.chat(d, dict(body, stream=False), fault="error-after=3")
        assert r.status == 500 and r.json["error"]["code"] == 500
        assert failure(r, c.instances("decode")[0]) == "injected fault: error after 3 tokens"
        # Before any token: the role chunk still goes first (chat), as vLLM sends it.
        r = await http.chat(d, body, fault="error-after=0")
        evs = r.events
        assert len(evs) == 3 and evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert evs[1].keys() == {"error"} and evs[2] == "[DONE]"
        assert failure(r, c.instances("decode")[0]) == "injected fault: error after 0 tokens"
        # Completions: no role chunk, the error event is first.
        r = await http.completion(d, {"prompt": "err", "max_tokens": 4, "stream": True, "sim_fault": "error-after=0"})
        assert r.data == GENERIC_EVENT + b"data: [DONE]\n\n"


async def test_reset_after(http):
    async with SimCluster(decode=1, config=fast_config()) as c:
        d = c.urls("decode")[0]
        body = chat_body("reset", max_tokens=8, stream=True)
        sink, err = await stream_pieces(d, body, "decode:reset-after=3")
        assert isinstance(err, UpstreamError)
        evs = sse_events(sink.data)
        assert "[DONE]" not in evs
        assert stream_text(evs) == expected_text(dict(body, max_tokens=3))
        with pytest.raises(UpstreamError):
            await http.chat(d, dict(body, stream=False), fault="reset-after=2")
        inst = c.instances("decode")[0]
        recs = inst.generation_records()
        assert not recs[0].aborted and "reset" in recs[0].error and recs[0].status == 200
        assert recs[1].status is None and recs[1].t_headers is None
        assert inst.stats.aborted == 0


async def test_hang_never_sends_headers(http):
    async with SimCluster(decode=1, config=fast_config()) as c:
        d = c.urls("decode")[0]
        t0 = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await http.chat(d, chat_body(stream=True), fault="hang",
                            timeouts=TransportTimeouts(connect=1, headers=0.1, idle=1))
        assert time.monotonic() - t0 < 1
        await asyncio.sleep(0.02)
        rec = c.instances("decode")[0].records[-1]
        assert rec.t_headers is None and rec.aborted and rec.fault == "hang"


def test_hang_item_matches_a_media_items_url_or_uuid():
    fs = parse_faults("encode:hang-item=poison")
    assert [(f.role, f.name, f.arg) for f in fs] == [("encode", "hang-item", "poison")]
    with pytest.raises(FaultSyntaxError):
        parse_faults("hang-item=")

    def body(*parts: dict) -> dict:
        return chat_body([{"type": "text", "text": "look"}, *parts])
    assert media_matches(body({"type": "image_url", "image_url": {"url": "https://x/poison.png"}}), "poison")
    assert media_matches(body({"type": "image_url", "image_url": "https://x/poison.png"}), "poison")
    assert media_matches(body({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}, "uuid": "poison-1"}),
                         "poison")
    assert not media_matches(body({"type": "image_url", "image_url": {"url": "https://x/fine.png"}}), "poison")
    assert not media_matches(chat_body("a poison text is no item"), "poison")


async def test_hang_item_hangs_only_on_a_matching_item(http):
    config = SimConfig(itl_ms=0, roles={"encode": {"fault_rate": 1.0, "fault_kinds": ("hang-item=poison",)}})
    async with SimCluster(encode=1, config=config) as c:
        e = c.urls("encode")[0]

        def image(url: str) -> dict:
            return chat_body([{"type": "image_url", "image_url": {"url": url}}], max_tokens=1)
        r = await http.chat(e, image("https://example.com/fine.png"))
        assert r.status == 200
        with pytest.raises(UpstreamTimeout):
            await http.chat(e, image("https://example.com/poison.png"),
                            timeouts=TransportTimeouts(connect=1, headers=0.1, idle=1))


async def test_delay_before_headers(http):
    async with SimCluster(decode=1, config=fast_config()) as c:
        t0 = time.monotonic()
        r = await http.chat(c.urls("decode")[0], chat_body(max_tokens=2), fault="delay=0.15")
        assert r.status == 200 and time.monotonic() - t0 >= 0.15


async def test_stall_mid_stream(http):
    async with SimCluster(decode=1, config=fast_config()) as c:
        body = chat_body("stall", max_tokens=6, stream=True)
        sink, err = await stream_pieces(c.urls("decode")[0], body, "stall-after=2:0.2")
        assert err is None
        assert stream_text(sse_events(sink.data)) == expected_text(body)
        gaps = [b[0] - a[0] for a, b in zip(sink.pieces, sink.pieces[1:])]
        assert max(gaps) >= 0.18
        assert sum(g >= 0.18 for g in gaps) == 1


async def test_slow_body(http):
    async with SimCluster(decode=1, config=fast_config()) as c:
        body = chat_body("slow", max_tokens=4, stream=True)
        t0 = time.monotonic()
        sink, err = await stream_pieces(c.urls("decode")[0], body, "slow-body=0.05")
        assert err is None and stream_text(sse_events(sink.data)) == expected_text(body)
        assert time.monotonic() - t0 >= 0.15


async def test_health(http):
    async with SimCluster(decode=1, config=fast_config()) as c:
        inst = c.instances("decode")[0]
        r = await http.get(inst.url, "/health")
        assert r.status == 200 and r.data == b""
        inst.set_health(False)
        assert (await http.get(inst.url, "/health")).status == 503
        inst.set_health(True)
        assert (await http.get(inst.url, "/health")).status == 200
        # Timed, from a request's fault.
        r = await http.chat(inst.url, chat_body(max_tokens=1), fault="unhealthy=0.1")
        assert r.status == 200
        assert (await http.get(inst.url, "/health")).status == 503
        await asyncio.sleep(0.12)
        assert (await http.get(inst.url, "/health")).status == 200
        # Over the control route, as a simulator in another process is driven.
        await http.post(inst.url, "/sim/health", {"ok": False})
        assert (await http.get(inst.url, "/health")).status == 503


async def test_crash_and_restart(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(itl_ms=5)) as c:
        d = c.instances("decode")[0]
        port = d.port
        p = c.instances("prefill")[0]
        await http.chat(p.url, prefill_body(chat_body()))
        assert p.held_kv_blocks == 1
        inflight = asyncio.create_task(http.chat(d.url, chat_body(max_tokens=200)))
        await asyncio.sleep(0.03)
        await d.crash()
        await p.crash()
        with pytest.raises(UpstreamError):
            await inflight
        assert p.held_kv_blocks == 0  # a crash loses the held KV
        with pytest.raises(UpstreamError) as ei:
            await http.get(d.url, "/health")
        assert ei.value.kind == "connect"
        await d.restart()
        assert d.port == port
        assert (await http.get(d.url, "/health")).status == 200
        assert (await http.chat(d.url, chat_body(max_tokens=2))).status == 200
        rec = d.generation_records()[0]
        assert not rec.aborted and "crashed" in rec.error


async def test_crash_fault_with_restart(http):
    async with SimCluster(decode=1, config=fast_config()) as c:
        d = c.instances("decode")[0]
        with pytest.raises(UpstreamError):
            await http.chat(d.url, chat_body(), fault="crash=0.1")
        await asyncio.sleep(0.02)
        assert not d.running
        await asyncio.sleep(0.15)
        assert d.running and (await http.get(d.url, "/health")).status == 200


async def test_injected_fault_queue(http):
    async with SimCluster(decode=1, config=fast_config()) as c:
        d = c.instances("decode")[0]
        d.inject("status=500", times=2)
        assert (await http.get(d.url, "/health")).status == 200  # only generation requests count
        statuses = [(await http.chat(d.url, chat_body(max_tokens=1))).status for _ in range(3)]
        assert statuses == [500, 500, 200]
        d.inject("prefill:status=500")  # not this role: consumed, no effect
        assert (await http.chat(d.url, chat_body(max_tokens=1))).status == 200
        await http.post(d.url, "/sim/fault", {"spec": "status=418", "times": 1})
        assert (await http.chat(d.url, chat_body(max_tokens=1))).status == 418


async def test_fault_rate_is_seeded():
    async def run(seed: int) -> list[int]:
        from simhelpers import Http

        h = Http()
        cfg = fast_config(fault_rate=0.5, fault_seed=seed, fault_kinds=("status=503",))
        async with SimCluster(decode=1, config=cfg) as c:
            out = [(await h.chat(c.urls("decode")[0], chat_body(max_tokens=1))).status for _ in range(30)]
        await h.close()
        return out

    a, b, other = await run(7), await run(7), await run(8)
    assert a == b and a != other
    assert 5 < a.count(503) < 25 and set(a) == {200, 503}


def test_bad_fault_kinds_rejected():
    with pytest.raises(FaultSyntaxError):
        SimCluster(decode=1, config=SimConfig(fault_rate=0.1, fault_kinds=("explode",)))


async def test_prefill_pushes_before_its_response_fails(http):
    """KV exists once the prefill is computed: response faults leave it pushed/held."""
    cfg = fast_config(kv_connector="nixl-push")
    async with SimCluster(prefill=1, decode=1, config=cfg) as c:
        body = chat_body("push then fail", max_tokens=3)
        ident = c.prefill_identity(0)
        d_task = asyncio.create_task(http.chat(c.urls("decode")[0],
                                               dict(body, kv_transfer_params=push_decode_params(ident, "t-f"))))
        t0 = time.monotonic()
        pr = await http.chat(c.urls("prefill")[0], prefill_body(body, "t-f"), fault="stall-after=0:0.15,error-after=0")
        assert pr.status == 500 and time.monotonic() - t0 >= 0.15
        dr = await d_task
        assert dr.status == 200 and dr.json["choices"][0]["message"]["content"] == expected_text(body)
        assert c.records("decode")[-1].t_end < c.records("prefill")[-1].t_end
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        r = await http.chat(c.urls("prefill")[0], prefill_body(chat_body()), fault="error-after=0")
        assert r.status == 500 and c.held_kv_blocks == 1  # stranded until kv_abort_timeout
        r = await http.chat(c.urls("prefill")[0], prefill_body(chat_body()), fault="status=503")
        assert r.status == 503 and c.held_kv_blocks == 1  # refused before any work


def test_injected_faults_apply_to_the_next_n_requests_of_their_role():
    src = FaultSource("decode", 0.0, (), "0/decode-0")
    src.inject("decode:status=503,prefill:hang", times=2)
    plans = [src.plan(None, {}) for _ in range(3)]
    assert [p.status if p else None for p in plans] == [503, 503, None]
    assert not plans[0].hang
