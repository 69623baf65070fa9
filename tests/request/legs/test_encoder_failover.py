"""The encode stage over real sockets against the simulator: an item is failed over to another
encoder, not the request (the items that succeeded are not sent again); a saturated pool makes
items wait, then answers 429 with Retry-After; ``--encoder-fallback local`` sends raw media to
the consumer when no encoder can take it; the per-encoder metrics."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter

import pytest
from helpers import Client, StageTimeouts, chat_body, stack

from epd_proxy.sim import SimConfig, expected_text


def images_sent(inst) -> list[str]:
    """The image URLs in every sub-request the simulated encoder received, in order."""
    return [p["image_url"]["url"] for r in inst.generation_records()
            for msg in r.json.get("messages") or [] for p in msg.get("content") or []
            if isinstance(p, dict) and p.get("type") == "image_url"]


async def metrics(client: Client) -> str:
    reply = await client.request("GET", "/metrics")
    assert reply.status == 200
    return reply.body.decode()


def sample(text: str, name: str, url: str | None = None) -> float:
    label = r"\{[^}]*url=\"%s\"[^}]*\}" % re.escape(url) if url else r"(?:\{\})?"
    m = re.search(r"^%s%s (\S+)$" % (re.escape(name), label), text, re.M)
    return float(m.group(1)) if m else 0.0


def consumer_parts(cluster, role: str = "prefill") -> list[dict]:
    last = cluster.records(role)[-1]
    return [p for m in last.json["messages"] if isinstance(m["content"], list)
            for p in m["content"] if p["type"] != "text"]


async def test_items_fail_over_one_by_one_and_the_good_ones_are_not_sent_again():
    """Three encoders: one refuses connections, one answers 500 to every item. The request
    succeeds; each image reached the healthy encoder once, the failing ones once each."""
    async with stack(encode=3) as (cluster, proxy, client):
        down, bad, good = cluster.instances("encode")
        await down.crash()
        bad.inject("status=500", times=100)
        urls = [f"https://example.com/fo-{k}.png" for k in range(12)]
        body = chat_body("What are these?", images=urls)
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        assert reply.text() == expected_text(body)
        on_good, on_bad = images_sent(good), images_sent(bad)
        assert sorted(on_good) == sorted(urls)  # every image once, none twice
        # No image reached the failing encoder twice (items failed over from the one that
        # refused connections may have gone to it before it failed its own).
        assert len(on_bad) == len(set(on_bad)) and 0 < len(on_bad) < len(urls)
        # The consumer got all twelve from the encoders: nothing encoded locally.
        assert cluster.instances("prefill")[0].stats.local_encodes == 0
        text = await metrics(client)
        assert sample(text, "epd_proxy_retries_total") == 0  # no whole-request retry
        assert sample(text, "epd_proxy_encoder_failovers_total", bad.url) == len(on_bad)
        failed_down = sample(text, "epd_proxy_encoder_failovers_total", down.url)
        assert failed_down + len(on_bad) + (len(urls) - len(on_bad) - failed_down) == len(urls)
        assert failed_down > 0
        assert sample(text, "epd_proxy_encoder_outstanding", good.url) == 0


async def test_twenty_images_are_not_failed_for_one_bad_encoder():
    async with stack(encode=2, encoder_max_batch_size=1) as (cluster, proxy, client):
        bad, good = cluster.instances("encode")
        bad.inject("status=500", times=100)
        urls = [f"https://example.com/tw-{k}.png" for k in range(20)]
        reply = await client.chat(chat_body("Describe.", images=urls))
        assert reply.status == 200, reply.body
        assert sorted(images_sent(good)) == sorted(urls)
        assert Counter(images_sent(bad)).most_common(1)[0][1] == 1


@pytest.mark.parametrize("fallback", ["none", "local"])
async def test_items_of_an_encoder_that_times_out_go_to_another(fallback):
    """One encoder hangs: its items time out (the encode timeout) and go to the other. With
    both hanging there is none left: 504 (not retried: no instance left that has not timed
    out), or with the fallback the raw images go to the consumer."""
    async with stack(encode=2, encoder_max_batch_size=1, encoder_fallback=fallback,
                     timeouts=StageTimeouts(encode=0.3)) as (cluster, proxy, client):
        slow, ok = cluster.instances("encode")
        slow.inject("hang", times=100)
        urls = [f"https://example.com/to-{k}.png" for k in range(4)]
        reply = await client.chat(chat_body(images=urls))
        assert reply.status == 200, reply.body
        assert sorted(images_sent(ok)) == sorted(urls)
        ok.inject("hang", times=100)
        reply = await client.chat(chat_body(images=["https://example.com/to-x.png"]))
        if fallback == "none":
            assert reply.status == 504, reply.body
            assert "encode" in reply.json()["error"]["message"]
        else:
            assert reply.status == 200, reply.body
            assert [p["type"] for p in consumer_parts(cluster)] == ["image_url"]


async def test_a_client_error_from_an_encoder_still_fails_the_request_with_its_status():
    async with stack(encode=2) as (cluster, proxy, client):
        for inst in cluster.instances("encode"):
            inst.inject("status=400", times=10)
        reply = await client.chat(chat_body(images=[f"https://example.com/c4-{k}.png" for k in range(4)]))
        assert reply.status == 400
        assert sum(len(i.generation_records()) for i in cluster.instances("encode")) <= 2  # not failed over


async def test_every_encoder_down_is_a_503_naming_the_encode_role():
    async with stack(encode=2) as (cluster, proxy, client):
        for inst in cluster.instances("encode"):
            await inst.crash()
        reply = await client.chat(chat_body(images=["https://example.com/d.png", "https://example.com/e.png"]))
        assert reply.status == 503, reply.body
        assert "encode" in reply.json()["error"]["message"]
        assert reply.headers.get(b"retry-after")
        assert not cluster.records("prefill")


@pytest.mark.parametrize("topology", ["E+P+D", "E+PD"])
async def test_local_fallback_sends_raw_media_to_the_consumer(topology):
    roles = dict(prefill=1, decode=1) if topology == "E+P+D" else dict(prefill=0, decode=0, pd=1)
    consumer = "prefill" if topology == "E+P+D" else "pd"
    async with stack(encode=2, encoder_fallback="local", **roles) as (cluster, proxy, client):
        for inst in cluster.instances("encode"):
            await inst.crash()
        urls = ["https://example.com/lf-1.png", "https://example.com/lf-2.png"]
        body = chat_body("And these?", images=urls)
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        assert reply.text() == expected_text(body)
        parts = consumer_parts(cluster, consumer)
        assert [p["type"] for p in parts] == ["image_url", "image_url"]
        assert [p["image_url"]["url"] for p in parts] == urls
        assert "ec_transfer_params" not in cluster.records(consumer)[-1].json
        assert cluster.instances(consumer)[0].stats.local_encodes == 2
        assert sample(await metrics(client), "epd_proxy_encoder_fallbacks_total") == 2


async def test_a_partial_fallback_keeps_the_modality_raw():
    """One image encoded, one not: the consumer gets both raw (vLLM refuses a mix), finds
    the encoded one in the encoder cache and encodes the other itself."""
    async with stack(encode=1, encoder_fallback="local", encoder_max_batch_size=1) as (cluster, proxy, client):
        (enc,) = cluster.instances("encode")
        enc.inject("status=500,crash", times=1)  # the second sub-request finds it gone
        body = chat_body(images=["https://example.com/pa-1.png", "https://example.com/pa-2.png"])
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        parts = consumer_parts(cluster)
        assert [p["type"] for p in parts] == ["image_url", "image_url"]
        assert all(p.get("uuid") for p in parts)
        p = cluster.instances("prefill")[0]
        assert p.stats.local_encodes + p.stats.ec_hits == 2 and p.stats.local_encodes >= 1


@pytest.mark.parametrize("fallback", ["none", "local"])
async def test_saturated_encoders_make_items_wait_then_429(fallback):
    """One encoder, one item in flight at a time, each taking 0.5 s, the encode timeout 0.8 s:
    of three requests at once the first is served, the second waits its turn, the third
    waits past the timeout and gets 429 with Retry-After (or, with the fallback, the raw
    image goes to the consumer)."""
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"encode": {"encode_ms_per_item": 500}})
    async with stack(encode=1, sim=sim, encoder_max_outstanding=1, encoder_fallback=fallback,
                     timeouts=StageTimeouts(encode=0.8)) as (cluster, proxy, client):
        clients = [Client(proxy.url) for _ in range(3)]
        t0 = time.perf_counter()

        async def one(k: int, c: Client):
            r = await c.chat(chat_body(images=[f"https://example.com/sat-{k}.png"]))
            return r, time.perf_counter() - t0

        try:
            done = await asyncio.gather(*(one(k, c) for k, c in enumerate(clients)))
        finally:
            for c in clients:
                await c.close()
        statuses = sorted(r.status for r, _ in done)
        encoded = images_sent(cluster.instances("encode")[0])
        text = await metrics(client)
        assert sample(text, "epd_proxy_encoder_outstanding", cluster.urls("encode")[0]) == 0
        if fallback == "none":
            assert statuses == [200, 200, 429], [(r.body, t) for r, t in done]
            refused, after = next((r, t) for r, t in done if r.status == 429)
            assert refused.headers.get(b"retry-after") == b"1"
            assert refused.json()["error"]["message"] == "every encode instance is at capacity; retry later"
            assert refused.json()["error"]["code"] == "overloaded"
            assert after >= 0.75
            assert len(encoded) == 2
        else:
            assert statuses == [200, 200, 200]
            assert len(encoded) == 2 and sample(text, "epd_proxy_encoder_fallbacks_total") == 1
            assert cluster.instances("prefill")[0].stats.local_encodes == 1


async def test_placement_counters_per_encoder():
    async with stack(encode=2) as (cluster, proxy, client):
        text = await metrics(client)
        for u in cluster.urls("encode"):  # every series from the start, at 0
            for name in ("items_total", "work_tokens_total", "affinity_hits_total", "failovers_total",
                         "outstanding"):
                assert re.search(r'^epd_proxy_encoder_%s\{url="%s"\} 0\.0$' % (name, re.escape(u)), text, re.M)
        assert "epd_proxy_encoder_fallbacks_total 0.0" in text
        for k in range(4):
            assert (await client.chat(chat_body(images=[f"https://example.com/m-{k}.png"]))).status == 200
        assert (await client.chat(chat_body(images=["https://example.com/m-0.png"]))).status == 200
        text = await metrics(client)
        urls = cluster.urls("encode")
        assert sum(sample(text, "epd_proxy_encoder_items_total", u) for u in urls) == 5
        assert sum(sample(text, "epd_proxy_encoder_affinity_hits_total", u) for u in urls) == 1
        assert sum(sample(text, "epd_proxy_encoder_work_tokens_total", u) for u in urls) == 4 * 1024
        assert sample(text, "epd_proxy_encoder_fallbacks_total") == 0
