"""Encoder spread over real sockets, through a proxy in front of the simulator: thirty new images
come out level on three encoders (sent one after another and all at once; inline images of one
size exactly level in every topology), one image sent ten times stays on one encoder, and
``round-robin`` keeps the reference's rotation."""

import asyncio
import base64
from collections import Counter

import pytest
from helpers import Client, chat_body, stack
from image_files import data_url, jpeg, png

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig


def items_per_encoder(cluster) -> Counter:
    """Media items each simulated encoder was asked to encode, from its records."""
    out: Counter = Counter()
    for inst in cluster.instances("encode"):
        for r in inst.generation_records():
            for msg in r.json.get("messages") or []:
                content = msg.get("content")
                if isinstance(content, list):
                    out[inst.url] += sum(1 for p in content if p.get("type") == "image_url")
    return out


def spread(counts: Counter, n: int = 3) -> float:
    values = [counts.get(u, 0) for u in counts] + [0] * (n - len(counts))
    return max(values) / max(min(values), 1e-9)


async def test_thirty_new_images_one_after_another_spread_level():
    async with stack(encode=3, prefill=1, decode=1) as (cluster, proxy, client):
        for k in range(30):
            reply = await client.chat(chat_body("What is it?", images=[f"https://example.com/seq-{k}.png"]))
            assert reply.status == 200, reply.body
        counts = items_per_encoder(cluster)
        assert sum(counts.values()) == 30 and spread(counts) <= 1.2, counts


@pytest.mark.parametrize("topology", [dict(prefill=1, decode=1), dict(prefill=0, decode=1),
                                      dict(prefill=0, decode=0, pd=1)], ids=["E+P+D", "E+PD", "E+PD-plain"])
async def test_thirty_new_inline_images_of_one_size_spread_exactly_level(topology):
    """One new image per request, one after another, each of one pixel size but its own file
    size (a photo's bytes depend on its content): 10/10/10, whatever the P/D side is."""
    async with stack(encode=3, **topology) as (cluster, proxy, client):
        for k in range(30):
            image = data_url(png(160, 160, seed=k)) if k % 2 else data_url(
                jpeg(160, 160, exif=97 * k, payload=5000 + 3001 * k), "image/jpeg")
            reply = await client.chat(chat_body("What is it?", images=[image]))
            assert reply.status == 200, reply.body
        counts = items_per_encoder(cluster)
        assert sorted(counts.values()) == [10, 10, 10], counts


async def test_thirty_new_images_in_messages_blocks_spread_exactly_level():
    """The same through /v1/messages (base64 image blocks, E+PD): its items are the chat
    parts vLLM makes of them, read alike."""
    async with stack(encode=3, prefill=0, decode=1) as (cluster, proxy, client):
        for k in range(30):
            data = png(160, 160, seed=k) if k % 2 else jpeg(160, 160, exif=97 * k, payload=5000 + 3001 * k)
            source = {"type": "base64", "media_type": "image/png" if k % 2 else "image/jpeg",
                      "data": base64.b64encode(data).decode()}
            body = {"model": "sim-model", "max_tokens": 4, "messages": [
                {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "What?"}]}]}
            reply = await client.post("/v1/messages", body)
            assert reply.status == 200, reply.body
        counts = items_per_encoder(cluster)
        assert sorted(counts.values()) == [10, 10, 10], counts


async def test_thirty_new_images_at_once_spread_level():
    async with stack(encode=3, prefill=1, decode=1) as (cluster, proxy, client):
        clients = [Client(proxy.url) for _ in range(30)]
        try:
            replies = await asyncio.gather(*(
                c.chat(chat_body("What is it?", images=[f"https://example.com/par-{k}.png"]))
                for k, c in enumerate(clients)))
        finally:
            for c in clients:
                await c.close()
        assert all(r.status == 200 for r in replies)
        counts = items_per_encoder(cluster)
        assert sum(counts.values()) == 30 and spread(counts) <= 1.2, counts


async def test_one_image_sent_ten_times_stays_on_one_encoder():
    async with stack(encode=3, prefill=1, decode=1) as (cluster, proxy, client):
        for k in range(7):  # some new images first: the shares are not all zero
            assert (await client.chat(chat_body("Hm?", images=[f"https://example.com/o-{k}.png"]))).status == 200
        before = items_per_encoder(cluster)
        for k in range(10):
            reply = await client.chat(chat_body(f"Question {k}", images=["https://example.com/same.png"]))
            assert reply.status == 200, reply.body
        counts = items_per_encoder(cluster)
        counts.subtract(before)
        assert max(counts.values()) >= 9, counts


async def test_a_replica_that_never_saw_an_image_finds_the_encoder_that_holds_it():
    """Two fresh replicas place new content alike (the rendezvous-top encoder while the
    shares are level), so repeats sent to the other replica hit the encoder's cache."""
    async with SimCluster(encode=3, prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        cfg = config_for_cluster(cluster, ProxyConfig(probe_interval=0, scrape_interval=0))
        async with await start_proxy(cfg) as a, await start_proxy(cfg) as b:
            ca, cb = Client(a.url), Client(b.url)
            try:
                for c in (ca, cb):
                    for k in range(12):
                        body = chat_body("What is it?", images=[f"https://example.com/r-{k}.png"])
                        assert (await c.chat(body)).status == 200
            finally:
                await ca.close()
                await cb.close()
        counts = items_per_encoder(cluster)
        assert sorted(counts.values()) == [8, 8, 8]  # each image twice, on one encoder


async def test_round_robin_keeps_the_reference_rotation():
    async with stack(encode=3, prefill=1, decode=1, encode_policy="round-robin") as (cluster, proxy, client):
        order = []
        for _ in range(9):
            assert (await client.chat(chat_body("Hm?", images=["https://example.com/same.png"]))).status == 200
            order.append(next(i.url for i in cluster.instances("encode")
                              if len(i.generation_records()) > order.count(i.url)))
        urls = [i.url for i in cluster.instances("encode")]
        assert order == urls * 3  # one item per request, the cursor shared across requests
