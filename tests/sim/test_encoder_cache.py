"""An encoder's own cache of its outputs, keyed by the item's hash."""

from __future__ import annotations

import time

from simhelpers import fast_config, metric
from test_ec import URL_A, URL_B, encode, image

from epd_proxy.sim import SimCluster, media_metadata
from epd_proxy.sim.encoder_cache import EncoderCache
from epd_proxy.sim.tokens import media_tokens


def test_lru_by_tokens_and_items_larger_than_the_cache_are_not_kept():
    cache = EncoderCache(capacity_tokens=10)
    assert not cache.lookup("a", 4)
    assert not cache.lookup("b", 4)
    assert cache.lookup("a", 4)  # a is now the most recent
    assert not cache.lookup("c", 4)  # b goes
    assert "a" in cache and "b" not in cache and cache.tokens == 8
    assert not cache.lookup("huge", 11) and "huge" not in cache
    assert (cache.queries, cache.hits) == (5, 1)


async def test_the_same_item_again_is_a_hit_and_answers_the_same(http):
    async with SimCluster(encode=1, config=fast_config()) as c:
        e = c.instances("encode")[0]
        first = await encode(http, c, [image(URL_A), image(URL_B)])
        again = await encode(http, c, [image(URL_A)])
        assert again == {k: v for k, v in first.items() if k in again}
        m = (await http.get(e.url, "/metrics")).data.decode()
        assert metric(m, "sim:encoder_cache_queries_total") == 3
        assert metric(m, "sim:encoder_cache_hits_total") == 1
        assert metric(m, "sim:encoded_items_total") == 3  # every item is still answered
        assert e.state()["encoder_cache"]["items"] == 2


async def test_a_hit_costs_nothing_and_a_miss_costs_by_size(http):
    tokens = media_tokens("image", media_metadata(image(URL_A)))
    # A miss costs about 0.1 s, all of it per placeholder token; a hit costs none of it.
    cfg = fast_config(encode_ms_per_item=0.0, encode_ms_per_mm_token=100.0 / tokens)
    async with SimCluster(encode=1, config=cfg) as c:
        t0 = time.monotonic()
        await encode(http, c, [image(URL_A)])
        miss = time.monotonic() - t0
        t0 = time.monotonic()
        await encode(http, c, [image(URL_A)])
        hit = time.monotonic() - t0
    assert hit < miss / 2


async def test_no_cache_encodes_every_time_and_a_restart_forgets(http):
    async with SimCluster(encode=1, config=fast_config(encoder_cache_tokens=0)) as c:
        await encode(http, c, [image(URL_A)])
        await encode(http, c, [image(URL_A)])
        m = (await http.get(c.urls("encode")[0], "/metrics")).data.decode()
        assert metric(m, "sim:encoder_cache_hits_total") == 0
    async with SimCluster(encode=1, config=fast_config()) as c:
        e = c.instances("encode")[0]
        await encode(http, c, [image(URL_A)])
        await e.crash()
        await e.restart()
        await encode(http, c, [image(URL_A)])
        assert e.state()["encoder_cache"]["hits"] == 0


def test_encoder_cache_settings_in_the_topology_spec():
    c = SimCluster.from_spec("encode=1,encoder_cache_tokens=0,encode_ms_per_mm_token=0.5")
    assert c.config.encoder_cache_tokens == 0 and c.config.encode_ms_per_mm_token == 0.5
    assert c.instances("encode")[0].encoder_cache.capacity == 0
    assert c.instances("encode")[0].prefix_cache is None
