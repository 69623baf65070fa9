"""A media item that hangs every encoder (or fails on each with vLLM's 500), over real sockets
against the simulator: the client is answered once two encoders have failed it alike, not
after every encoder's timeout; no encoder's health hears of it; the access log and
``epd_proxy_encode_item_failures_total`` say why. One encoder hanging on an item another
encodes is still that encoder's fault, and the item goes to the other."""

from __future__ import annotations

import gc
import io
import time

import pytest
from helpers import StageTimeouts, chat_body, stack

from epd_proxy.observe.access_log import AccessLog
from epd_proxy.sim import SimConfig, expected_text
from epd_proxy.wire.errors import ProxyError

POISON = "https://example.com/poison.png"
# Every encoder hangs on an item whose URL holds "poison" (the proxy sends encoders only the
# media parts, so the fault is the encoders' own, drawn for every request).
HANGS_ON_POISON = SimConfig(itl_ms=0, ttft_ms=0.5,
                            roles={"encode": {"fault_rate": 1.0, "fault_kinds": ("hang-item=poison",)}})
TIMEOUT = 1.0  # --encode-timeout: every encoder's hang costs this much


def counter(text: str, name: str, reason: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'{name}{{reason="{reason}"}} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{reason={reason}}} in /metrics")


def untouched(pool) -> bool:
    return all(i.health.failures == 0 and not i.health.errors and i.health.state == "healthy"
               for i in pool.instances)


@pytest.mark.parametrize("encoders", [2, 3])
async def test_an_item_that_hangs_every_encoder_is_answered_after_two_timeouts(encoders):
    out = io.StringIO()
    async with stack(encode=encoders, sim=HANGS_ON_POISON, encoder_max_batch_size=1,
                     timeouts=StageTimeouts(encode=TIMEOUT)) as (cluster, proxy, client):
        proxy.app.pipeline.access_log = AccessLog("text", stream=out)
        pool = proxy.app.pools["encode"]
        for _ in range(4):  # past --fail-threshold (3): no encoder is ejected either
            t0 = time.monotonic()
            reply = await client.chat(chat_body(images=["https://example.com/fine.png", POISON]))
            elapsed = time.monotonic() - t0
            assert reply.status == 504, reply.body
            message = reply.json()["error"]["message"]
            assert "media item 1" in message and "encode" in message, message
            # Two timeouts, one after the other; three encoders' would be 3 s (and before,
            # every encoder's in turn until --first-byte-timeout).
            assert 2 * TIMEOUT - 0.05 <= elapsed < 2 * TIMEOUT + 0.7, elapsed
            assert untouched(pool)
        assert not cluster.records("prefill")  # nothing sent on
        # The instances are as good as before: a plain image is encoded at once.
        t0 = time.monotonic()
        body = chat_body(images=["https://example.com/after.png"])
        reply = await client.chat(body)
        assert reply.status == 200 and reply.text() == expected_text(body)
        assert time.monotonic() - t0 < TIMEOUT
        text = (await client.request("GET", "/metrics")).body.decode()
        assert counter(text, "epd_proxy_encode_item_failures_total", "item_timeout") == 4
        assert counter(text, "epd_proxy_encode_item_failures_total", "item_error") == 0
        assert proxy.app.metrics.retries == 0
    lines = [line for line in out.getvalue().splitlines() if " 504 " in line]
    assert len(lines) == 4 and all(line.endswith(" item_timeout") for line in lines), lines


async def test_with_the_local_fallback_the_item_goes_raw_to_the_consumer():
    async with stack(encode=2, sim=HANGS_ON_POISON, encoder_fallback="local",
                     timeouts=StageTimeouts(encode=TIMEOUT)) as (cluster, proxy, client):
        t0 = time.monotonic()
        body = chat_body(images=[POISON])
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        assert reply.text() == expected_text(body)
        assert time.monotonic() - t0 < 2 * TIMEOUT + 0.7
        parts = [p for m in cluster.records("prefill")[-1].json["messages"] if isinstance(m["content"], list)
                 for p in m["content"] if p["type"] != "text"]
        assert [p["type"] for p in parts] == ["image_url"]  # raw: the consumer encodes it
        assert untouched(proxy.app.pools["encode"])
        assert proxy.app.pipeline.fanout.fallbacks == 1
        assert proxy.app.pipeline.fanout.item_failures == {"item_timeout": 1}


async def test_an_item_every_encoder_fails_with_a_500_is_answered_at_once():
    async with stack(encode=3, encoder_max_batch_size=1) as (cluster, proxy, client):
        for inst in cluster.instances("encode"):
            inst.inject("status=500", times=1)
        gc.collect()
        gc.disable()  # the failures and the request's error leave no reference cycle behind
        try:
            reply = await client.chat(chat_body(images=[POISON]))
            left = [o for o in gc.get_objects() if isinstance(o, ProxyError)]
        finally:
            gc.enable()
        assert not left, left
        assert reply.status == 502, reply.body
        assert "media item 0" in reply.json()["error"]["message"]
        # Two encoders asked, not three; neither one's failure rate hears of it.
        assert sum(len(i.generation_records()) for i in cluster.instances("encode")) == 2
        assert untouched(proxy.app.pools["encode"])
        assert proxy.app.pipeline.fanout.item_failures == {"item_error": 1}


async def test_one_encoder_hanging_is_still_that_encoders_fault():
    async with stack(encode=2, encoder_max_batch_size=1,
                     timeouts=StageTimeouts(encode=TIMEOUT)) as (cluster, proxy, client):
        hung, good = cluster.instances("encode")
        hung.inject("hang", times=100)
        body = chat_body(images=[f"https://example.com/one-{k}.png" for k in range(2)])
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        assert reply.text() == expected_text(body)
        pool = proxy.app.pools["encode"]
        by_url = {i.url: i for i in pool.instances}
        assert by_url[hung.url].health.errors.get("timeout") == 1  # once per request
        assert by_url[hung.url].health.failures == 1
        assert by_url[good.url].health.failures == 0 and not by_url[good.url].health.errors
        assert proxy.app.pipeline.fanout.item_failures == {}


async def test_a_video_sub_request_is_given_four_times_an_images_timeout():
    async with stack(encode=1, timeouts=StageTimeouts(encode=0.4)) as (cluster, proxy, client):
        encoder = cluster.instances("encode")[0]
        video = chat_body()
        video["messages"][0]["content"] = [{"type": "text", "text": "What happens?"},
                                           {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}]
        encoder.inject("delay=0.8", times=1)
        reply = await client.chat(video)
        assert reply.status == 200, reply.body  # within 1.6 s
        encoder.inject("delay=0.8", times=1)
        reply = await client.chat(chat_body(images=["https://example.com/slow.png"]))
        assert reply.status == 504, reply.body  # past 0.4 s
