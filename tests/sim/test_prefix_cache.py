"""The prefix cache of prefill / pd instances: vLLM's chained block hashes, LRU eviction,
its token counters, and what instances report (cached_tokens, /metrics)."""

from __future__ import annotations

import asyncio
import time

from simhelpers import chat_body, fast_config, metric, prefill_body

from epd_proxy.sim import SimCluster, SimConfig, prompt_tokens
from epd_proxy.sim.prefix_cache import PrefixCache, block_hashes

# -- the pure cache ----------------------------------------------------------------------

def test_block_hashes_chain_each_block_to_its_parent():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert len(a) == 2  # the last, partial block is not hashed
    assert a[0] == b[0] and a[1] != b[1]
    # The same tokens after a different prefix are a different block.
    assert block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)[1] != a[1]


def test_lookup_stops_at_the_first_miss_and_leaves_one_token_to_compute():
    cache = PrefixCache(block_size=4, capacity=100)
    first = block_hashes(list(range(12)), 4)
    assert cache.lookup(first, 12) == 0
    cache.store(first)
    # The whole prompt is cached: vLLM still computes the last block.
    assert cache.lookup(first, 12) == 8
    longer = block_hashes(list(range(12)) + [50, 51, 52, 53, 54], 4)
    assert cache.lookup(longer, 17) == 12
    diverging = block_hashes([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12], 4)
    assert cache.lookup(diverging, 13) == 4
    assert (cache.queries, cache.hits) == (12 + 12 + 17 + 13, 8 + 12 + 4)


def test_least_recently_used_blocks_go_first_and_a_chain_ends_before_its_start():
    cache = PrefixCache(block_size=2, capacity=3)
    a = block_hashes([1, 1, 2, 2], 2)
    b = block_hashes([7, 7, 8, 8], 2)
    cache.store(a)
    _, removed = cache.store(b)
    assert removed == [a[1]]  # a's tail goes before a's head
    assert a[0] in cache and a[1] not in cache
    cache.store(a[:1])  # a's head is used again: b's tail is now the oldest
    _, removed = cache.store(block_hashes([5, 5], 2))
    assert removed == [b[1]]
    assert len(cache) == 3


# -- instances -----------------------------------------------------------------------------

def _conversation(turns: int) -> dict:
    messages = [{"role": "system", "content": " ".join(["shared"] * 40)}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} " + " ".join(["w"] * 20)})
        messages.append({"role": "assistant", "content": f"answer {t} " + " ".join(["x"] * 20)})
    messages.append({"role": "user", "content": "and now?"})
    return {"model": "sim-model", "messages": messages, "max_tokens": 2}


async def test_a_second_turn_hits_the_first_turns_prefix(http):
    async with SimCluster(pd=1, config=fast_config(prompt_tokens_details=True)) as c:
        pd = c.instances("pd")[0]
        first, second = _conversation(1), _conversation(2)
        r1 = await http.chat(pd.url, first)
        assert r1.json["usage"]["prompt_tokens_details"] is None
        r2 = await http.chat(pd.url, second)
        cached = r2.json["usage"]["prompt_tokens_details"]["cached_tokens"]
        # Everything up to the last full block the turns share: the system prompt and turn 0
        # (the first turn's final "and now?" message differs from the second turn's).
        shared = prompt_tokens(first) - 3
        assert cached == shared // 16 * 16 and cached > 0
        m = (await http.get(pd.url, "/metrics")).data.decode()
        assert metric(m, "vllm:prefix_cache_queries_total") == prompt_tokens(first) + prompt_tokens(second)
        assert metric(m, "vllm:prefix_cache_hits_total") == cached
        src = 'vllm:prompt_tokens_by_source_total{model_name="sim-model",engine="0",source="%s"}'
        assert metric(m, src % "local_cache_hit") == cached
        assert metric(m, src % "local_compute") == prompt_tokens(first) + prompt_tokens(second) - cached
        assert pd.state()["prefix_cache"]["hits"] == cached


async def test_cached_tokens_are_reported_only_with_the_switch_like_vllm(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        url = c.urls("pd")[0]
        await http.chat(url, _conversation(1))
        r = await http.chat(url, dict(_conversation(1), stream=True, stream_options={"include_usage": True}))
        assert "prompt_tokens_details" not in r.events[-2]["usage"]
        r = await http.chat(url, _conversation(1))
        assert r.json["usage"]["prompt_tokens_details"] is None
        m = (await http.get(url, "/metrics")).data.decode()
        assert metric(m, "vllm:prefix_cache_hits_total") > 0  # the counters count regardless


async def test_streamed_usage_reports_cached_tokens(http):
    async with SimCluster(pd=1, config=fast_config(prompt_tokens_details=True)) as c:
        url = c.urls("pd")[0]
        await http.chat(url, _conversation(1))
        r = await http.chat(url, dict(_conversation(1), stream=True, stream_options={"include_usage": True}))
        n = prompt_tokens(_conversation(1))
        assert r.events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 16 * 16}


async def test_cached_prefix_shortens_the_prefill(http):
    # 0.5 ms per uncached token: about 0.2 s for the cold prompt, a few ms once it is cached.
    body = {"model": "sim-model", "max_tokens": 1,
            "messages": [{"role": "user", "content": " ".join(["long"] * 400)}]}
    async with SimCluster(pd=1, config=fast_config(ttft_per_token_ms=0.5)) as c:
        url = c.urls("pd")[0]
        t0 = time.monotonic()
        await http.chat(url, body)
        cold = time.monotonic() - t0
        t0 = time.monotonic()
        await http.chat(url, body)
        warm = time.monotonic() - t0
    assert warm < cold / 2


async def test_capacity_evicts_and_a_restart_forgets(http):
    cfg = fast_config(block_size=4, prefix_cache_blocks=3, prompt_tokens_details=True)
    async with SimCluster(pd=1, config=cfg) as c:
        pd = c.instances("pd")[0]
        a = chat_body(" ".join(["a"] * 11), max_tokens=1)  # 12 tokens: 3 blocks
        b = chat_body(" ".join(["b"] * 11), max_tokens=1)
        await http.chat(pd.url, a)
        assert (await http.chat(pd.url, a)).json["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
        await http.chat(pd.url, b)  # evicts a's blocks
        assert (await http.chat(pd.url, a)).json["usage"]["prompt_tokens_details"] is None
        await pd.crash()
        await pd.restart()
        assert pd.state()["prefix_cache"]["blocks"] == 0
        m = (await http.get(pd.url, "/metrics")).data.decode()
        assert metric(m, "sim:prefix_cache_blocks") == 0


async def test_decode_reports_the_prefills_hits_not_the_transferred_blocks(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(prompt_tokens_details=True)) as c:
        p, d = c.urls("prefill")[0], c.instances("decode")[0]
        cached = []
        for turn, rid in ((1, "t1"), (2, "t2")):
            body = _conversation(turn)
            kv = (await http.chat(p, prefill_body(body), rid=rid)).json["kv_transfer_params"]
            r = await http.chat(d.url, dict(body, kv_transfer_params=kv), rid=rid)
            assert r.status == 200
            details = r.json["usage"]["prompt_tokens_details"]
            cached.append((kv["remote_prefill_cached_tokens"], details and details["cached_tokens"]))
        assert cached[0] == (0, None)
        assert cached[1][0] > 0 and cached[1][1] == cached[1][0]
        m = (await http.get(d.url, "/metrics")).data.decode()
        # D loaded every prompt token over the transfer; none of them is a prefix-cache hit.
        assert metric(m, "vllm:prefix_cache_hits_total") == 0
        assert metric(m, "vllm:external_prefix_cache_hits_total") == (
            prompt_tokens(_conversation(1)) + prompt_tokens(_conversation(2)))
        pm = (await http.get(p, "/metrics")).data.decode()
        assert metric(pm, "vllm:prefix_cache_hits_total") == cached[1][0]


async def test_decode_reports_loaded_tokens_when_the_prefill_sends_no_count(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(prompt_tokens_details=True)) as c:
        body = chat_body("an older producer", max_tokens=2)
        kv = (await http.chat(c.urls("prefill")[0], prefill_body(body), rid="o1")).json["kv_transfer_params"]
        del kv["remote_prefill_cached_tokens"]
        r = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=kv), rid="o1")
        assert r.json["usage"]["prompt_tokens_details"] == {"cached_tokens": kv["remote_num_tokens"]}


async def test_push_prefill_reports_its_hits_too(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(kv_connector="nixl-push")) as c:
        p = c.urls("prefill")[0]
        body = _conversation(1)
        kv1 = (await http.chat(p, prefill_body(body, transfer_id="x1"), rid="x1")).json["kv_transfer_params"]
        kv2 = (await http.chat(p, prefill_body(body, transfer_id="x2"), rid="x2")).json["kv_transfer_params"]
        assert kv1["remote_prefill_cached_tokens"] == 0 and kv2["remote_prefill_cached_tokens"] > 0


async def test_load_gauges_report_a_running_stream(http):
    async with SimCluster(pd=1, config=fast_config(itl_ms=20)) as c:
        url = c.urls("pd")[0]
        task = asyncio.ensure_future(http.chat(url, chat_body(max_tokens=40, stream=True)))
        try:
            for _ in range(200):  # wait for the stream to be running (bounded)
                m = (await http.get(url, "/metrics")).data.decode()
                if metric(m, "vllm:num_requests_running") == 1:
                    break
                await asyncio.sleep(0.005)
            assert metric(m, "vllm:num_requests_running") == 1
            assert metric(m, "vllm:num_requests_waiting") == 0
            assert metric(m, "vllm:kv_cache_usage_perc") > 0
        finally:
            await task
        m = (await http.get(url, "/metrics")).data.decode()
        assert metric(m, "vllm:num_requests_running") == 0 and metric(m, "vllm:kv_cache_usage_perc") == 0


def test_cache_settings_in_the_topology_spec():
    c = SimCluster.from_spec("pd=1,prefill=1,block_size=8,prefix_cache_blocks=64,prefill.enable_prefix_caching=0")
    pd, p = c.instances("pd")[0], c.instances("prefill")[0]
    assert pd.prefix_cache.block_size == 8 and pd.prefix_cache.capacity == 64
    assert p.prefix_cache is None
    assert SimCluster(pd=1, config=SimConfig(num_gpu_blocks=123)).instances("pd")[0].prefix_cache.capacity == 123


def test_pinned_blocks_stay_findable_past_the_lru_until_unpinned():
    from epd_proxy.sim.prefix_cache import PrefixCache, block_hashes

    cache = PrefixCache(block_size=4, capacity=1)
    a = block_hashes(list(range(12)), 4)
    cache.store(a)  # the LRU keeps one block: the first
    assert cache.peek(a, 13) == 4
    cache.pin(a)
    cache.pin(a[:1])
    assert cache.peek(a, 13) == 12 and cache.pinned_blocks == 3
    cache.unpin(a)
    assert cache.peek(a, 13) == 4 and cache.pinned_blocks == 1
    cache.unpin(a[:1])
    assert cache.pinned_blocks == 0
