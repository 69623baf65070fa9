"""Multi-turn reuse consults the KV block index: a turn whose decode's own events say it no
longer holds the previous turn's blocks (restarted, evicted) is not sent to read them
(outcome ``decode_dropped``), and what that decode still holds of them is let go."""

from __future__ import annotations

from helpers import Client, stack, wait_for
from test_multiturn import _ask, _counts, _next, _reads, _sim, _t1, _wrong

from epd_proxy.observe.traffic import KV_OUTCOME_TEXT
from epd_proxy.placement.kv_lookup import holds_turn
from epd_proxy.request.turns.outcomes import DECODE_DROPPED, OUTCOMES


def test_a_turn_is_held_while_every_full_block_but_the_last_tokens_is():
    def held(tokens: int, ids: int, age: float = 10.0) -> bool:
        return holds_turn(tokens, ids, 16, age, settle=3.0)

    assert held(96, 100)  # 6 full blocks of 99 computed tokens
    assert held(96, 97)  # the 97th token (sampled last) never computed: 6 blocks
    assert not held(80, 100)  # the tail block evicted
    assert not held(0, 100)  # restarted, cleared
    assert held(0, 16) and held(0, 1)  # no full block: nothing to tell
    # A turn kept a moment ago: its blocks' events may not have arrived yet.
    assert held(0, 100, age=2.9) and not held(0, 100, age=3.0)


def _kept_ids(decode) -> list[int]:
    return decode.kv_reuse.kept()[-1].ids  # the latest turn the decode keeps blocks for


def _held(proxy, url: str, ids: list[int]) -> int:
    return proxy.app.kv_events.index.longest_prefix(ids).get(url, 0)


async def _first_turn_held(cluster, proxy, client):
    """Events live on both instances, judged at once (the turns below wait for the events
    themselves); a first turn answered and its blocks seen held by the decode: (decode, the
    turn's body, its token ids)."""
    proxy.app.pipeline.kv.settle = 0.0
    await wait_for(lambda: len(proxy.app.kv_events.live()) == 2, timeout=10)
    d = cluster.instances("decode")[0]
    b1 = _t1()
    await _ask(client, b1)
    ids = _kept_ids(d)
    await wait_for(lambda: _held(proxy, d.url, ids) >= len(ids) - 16)
    return d, b1, ids


async def test_a_restarted_decode_is_not_read_from_when_its_events_say_so():
    async with stack(sim=_sim(kv_events=True), local_prefill_max_tokens=0) as (cluster, proxy, client):
        feed = proxy.app.kv_events
        d, b1, ids = await _first_turn_held(cluster, proxy, client)
        await d.crash()
        await d.restart()  # a new engine: its sequence from 0, its cache empty
        await wait_for(lambda: d.url in feed.live() and feed.index.blocks_of(d.url) == 0, timeout=15)
        prefill = cluster.instances("prefill")[0]
        before = len(prefill.records)
        b2 = _next(b1)
        await _ask(client, b2)
        # Not sent to read (no 500 on the prefill, no second prefill run), nothing to release.
        assert _counts(proxy) == {"decode_dropped": 1}
        assert not _reads(cluster) and len(prefill.records) == before + 1
        assert proxy.app.pipeline.reuse.counts.freed == 0
        # The fallback turn's answer is kept as usual: the next turn reads it.
        await wait_for(lambda: _held(proxy, d.url, _kept_ids(d)) >= len(_kept_ids(d)) - 16)
        await _ask(client, _next(b2))
        assert _counts(proxy)["reused"] == 1 and len(_reads(cluster)) == 1 and _wrong(cluster) == 0
        metrics = (await client.request("GET", "/metrics")).body
        assert b'epd_proxy_kv_reuse_turns_total{outcome="decode_dropped"} 1.0' in metrics


async def test_blocks_a_decode_evicted_are_not_read_and_the_rest_is_let_go():
    # The simulator's decode evicts its least recently used blocks past 48 (pinned or not: a
    # real decode keeps them; the rule trusts its events either way).
    async with stack(sim=_sim(kv_events=True, prefix_cache_blocks=48), local_prefill_max_tokens=0) as (
            cluster, proxy, client):
        d, b1, ids = await _first_turn_held(cluster, proxy, client)
        assert len(ids) > 20 * 16
        plain = Client(d.url)
        try:  # other traffic on the decode (not through this proxy): the turn's last blocks go
            reply = await plain.post("/v1/completions", {"model": "sim-model", "prompt": list(range(40 * 16)),
                                                         "max_tokens": 1})
            assert reply.status == 200, reply.body
        finally:
            await plain.close()
        await wait_for(lambda: 0 < _held(proxy, d.url, ids) < len(ids) - 16)
        kept = d.kv_reuse.kept_requests
        await _ask(client, _next(b1))
        assert _counts(proxy) == {"decode_dropped": 1} and not _reads(cluster)
        counts = proxy.app.pipeline.reuse.counts
        await wait_for(lambda: counts.freed == 1)  # the turn's blocks freed on decode at once
        assert d.kv_reuse.kept_requests == kept  # turn 1's let go, the new turn's kept
        assert _wrong(cluster) == 0


async def test_without_live_events_the_turn_is_sent_to_read_as_before():
    async with stack(sim=_sim(kv_events=True), local_prefill_max_tokens=0) as (
            cluster, proxy, client):
        feed = proxy.app.kv_events
        await wait_for(lambda: len(feed.live()) == 2, timeout=10)
        d = cluster.instances("decode")[0]
        for r in feed.readers[d.url]:
            await r.close()  # the decode's events stop: the index no longer speaks for it
        await wait_for(lambda: d.url not in feed.live())
        b1 = _t1()
        await _ask(client, b1)
        await _ask(client, _next(b1))
        assert _counts(proxy)["reused"] == 1 and len(_reads(cluster)) == 1


def test_the_outcome_is_one_of_the_labels_and_the_console_says_it_in_words():
    assert DECODE_DROPPED in OUTCOMES and set(OUTCOMES) == set(KV_OUTCOME_TEXT)
