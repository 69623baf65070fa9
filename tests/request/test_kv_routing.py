"""Routing on the block index, end to end over real sockets: a proxy in front of simulated
P/D instances that publish vLLM's KV events. A prefix one prefill holds (placed there by
traffic that never passed the proxy) is routed there; a prefix a prefill evicted is not."""

from __future__ import annotations

import msgspec
from tests.helpers import Client, stack, wait_for

from epd_proxy.sim import SimConfig

PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


def _prompt(seed: int, n: int = 96) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


async def _direct(url: str, prompt: list[int]) -> None:
    """A request straight to a prefill (another client population, or another proxy)."""
    client = Client(url)
    try:
        reply = await client.post("/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 1,
                                                      "kv_transfer_params": PREFILL_KV})
        assert reply.status == 200, reply.body
    finally:
        await client.close()


def _served(cluster, prompt: list[int]) -> list[str]:
    """The prefills whose records include a request for ``prompt``."""
    out = []
    for inst in cluster.instances("prefill"):
        for rec in inst.records:
            if rec.json and rec.json.get("prompt") == prompt:
                out.append(inst.url)
    return out


async def _live(proxy, n: int) -> None:
    feed = proxy.app.kv_events
    await wait_for(lambda: len(feed.live()) == n, timeout=10)


async def test_a_prefix_one_prefill_holds_is_routed_there():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, kv_events=True)
    async with stack(prefill=3, decode=1, sim=sim) as (cluster, proxy, client):
        await _live(proxy, 4)
        urls = cluster.urls("prefill")
        feed = proxy.app.kv_events
        for seed in range(9):
            holder = urls[seed % 3]
            await _direct(holder, _prompt(seed))
            await wait_for(lambda s=seed, h=holder: feed.index.longest_prefix(_prompt(s)).get(h) == 96)
            follow = _prompt(seed) + [7, 8, 9, 10, 11]
            reply = await client.post("/v1/completions", {"model": "sim-model", "prompt": follow, "max_tokens": 2})
            assert reply.status == 200, reply.body
            assert _served(cluster, follow) == [holder], seed
        lookups = msgspec.json.decode((await client.request("GET", "/status")).body)["kv_events"]
        assert set(lookups["instances"]) == set(urls) | set(cluster.urls("decode"))


async def test_an_evicted_prefix_is_no_longer_preferred():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, kv_events=True, prefix_cache_blocks=12)
    async with stack(prefill=2, decode=1, sim=sim) as (cluster, proxy, client):
        await _live(proxy, 3)
        a, b = cluster.urls("prefill")
        feed = proxy.app.kv_events
        for seed in range(4):
            shared = _prompt(seed)
            await _direct(a, shared + [1] * 64)  # a holds the prefix and more
            await _direct(b, shared[:32])  # b holds its first two blocks
            await wait_for(lambda p=shared: feed.index.longest_prefix(p) == {a: 96, b: 32})
            await _direct(a, _prompt(100 + seed, 192))  # 12 new blocks: a evicts all it held of it
            await wait_for(lambda p=shared: feed.index.longest_prefix(p).get(a, 0) < 32)
            follow = shared + [5, 6, 7]
            reply = await client.post("/v1/completions", {"model": "sim-model", "prompt": follow, "max_tokens": 2})
            assert reply.status == 200, reply.body
            assert _served(cluster, follow) == [b], seed
        metrics = (await client.request("GET", "/metrics")).body
        assert b'epd_proxy_routing_exact_total{role="prefill"} 4.0' in metrics
        assert b'epd_proxy_kv_lookups_total{outcome="indexed"} 4.0' in metrics


async def test_a_decode_holding_nearly_all_of_the_prompt_computes_it_alone():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, kv_events=True)
    async with stack(prefill=1, decode=1, sim=sim) as (cluster, proxy, client):
        await _live(proxy, 2)
        (d,) = cluster.urls("decode")
        feed = proxy.app.kv_events
        prompt = _prompt(7)
        plain = Client(d)
        try:  # the decode computes a prompt of its own (no prefill involved)
            reply = await plain.post("/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 1})
            assert reply.status == 200, reply.body
        finally:
            await plain.close()
        await wait_for(lambda: feed.index.longest_prefix(prompt).get(d) == 96)
        prefill = cluster.instances("prefill")[0]
        before = len(prefill.records)
        for tail, alone in (([1, 2, 3], True), (list(range(200, 300)), False)):
            reply = await client.post("/v1/completions", {"model": "sim-model", "prompt": prompt + tail,
                                                          "max_tokens": 2})
            assert reply.status == 200, reply.body
            assert (len(prefill.records) == before) is alone, tail
        metrics = (await client.request("GET", "/metrics")).body
        assert b'epd_proxy_not_disaggregated_total{reason="cached"} 1.0' in metrics


async def test_the_decode_holding_the_prompt_computes_it_alone_whichever_the_policy_picks():
    """Two decodes, each holding prompts of its own (computed without the proxy): a follow-up
    of each goes to the decode that holds it, alone, though decode's policy (load-aware)
    knows nothing of them; a prompt no decode holds closely goes through the prefill."""
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, kv_events=True)
    async with stack(prefill=1, decode=2, sim=sim) as (cluster, proxy, client):
        await _live(proxy, 3)
        feed = proxy.app.kv_events
        decodes = cluster.instances("decode")
        prefill = cluster.instances("prefill")[0]
        for seed in range(6):
            holder = decodes[(seed // 2) % 2]  # not the alternation load-aware ties fall into
            prompt = _prompt(20 + seed)
            plain = Client(holder.url)
            try:
                reply = await plain.post("/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": 1})
                assert reply.status == 200, reply.body
            finally:
                await plain.close()
            await wait_for(lambda p=prompt, h=holder.url: feed.index.longest_prefix(p).get(h) == 96)
            before = len(prefill.records)
            follow = prompt + [1, 2, 3]
            reply = await client.post("/v1/completions", {"model": "sim-model", "prompt": follow, "max_tokens": 2})
            assert reply.status == 200, reply.body
            assert len(prefill.records) == before, seed  # no prefill hop
            served = [d.url for d in decodes for rec in d.records if rec.json and rec.json.get("prompt") == follow]
            assert served == [holder.url], seed
        before = len(prefill.records)
        reply = await client.post("/v1/completions", {"model": "sim-model", "prompt": _prompt(40), "max_tokens": 2})
        assert reply.status == 200, reply.body
        assert len(prefill.records) > before  # held nowhere: disaggregated
        metrics = (await client.request("GET", "/metrics")).body
        assert b'epd_proxy_not_disaggregated_total{reason="cached"} 6.0' in metrics


async def test_two_replicas_agree_without_talking():
    """Turns of chat conversations alternate between two proxies; each proxy's own index, read
    from the same events, sends every later turn where the other placed the earlier ones, and
    both decide on the index (chat prompts tokenized by the instances). At this low load the
    approximate policy keeps these turns together too (openings go to the rendezvous-top
    instance that both compute); the tests above place prefixes where it cannot know them."""
    from epd_proxy import ProxyConfig, start_proxy
    from epd_proxy.runtime.serve import config_for_cluster
    from epd_proxy.sim import SimCluster

    sim = SimConfig(itl_ms=0, ttft_ms=0.5, kv_events=True)
    async with SimCluster(prefill=3, decode=1, config=sim) as cluster:
        config = config_for_cluster(cluster, ProxyConfig(probe_interval=0, scrape_interval=0))
        async with await start_proxy(config) as one, await start_proxy(config) as two:
            await _live(one, 4)
            await _live(two, 4)
            proxies = (one, two)
            clients = [Client(one.url), Client(two.url)]
            try:
                for n in range(8):
                    words = " ".join(f"c{n}w{i}" for i in range(200))  # beyond the decode-alone bound
                    messages = [{"role": "user", "content": words}]
                    home = None
                    for turn in range(3):
                        k = (n + turn) % 2
                        reply = await clients[k].chat({"model": "sim-model", "messages": messages, "max_tokens": 4})
                        assert reply.status == 200, reply.body
                        served = [inst.url for inst in cluster.instances("prefill") for rec in inst.records
                                  if rec.json and rec.json.get("messages") == messages]
                        if home is None:
                            home = served
                        assert served == home, (n, turn)
                        messages = messages + [{"role": "assistant", "content": reply.text()},
                                               {"role": "user", "content": f"and then {turn} more words please"}]
                        # The other proxy learns from the events where this turn's blocks are.
                        other = proxies[1 - k].app.kv_events.index
                        await wait_for(lambda o=other, h=home[0]: o.blocks_of(h) > 0)
            finally:
                for c in clients:
                    await c.close()
        assert one.app.pools["prefill"].policy.exact and two.app.pools["prefill"].policy.exact
