"""Load signals: parsing vLLM's /metrics, and the background scrape against simulated instances."""

import asyncio

import msgspec
from helpers import Client, chat_body, stack, wait_for

from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts
from epd_proxy.instances.load_signals import (
    QUIET_STRETCH,
    LoadSignals,
    gauge_samples,
    parse_block_size,
    parse_kv_blocks,
    parse_load,
    parse_waiting_for_capacity,
    wedged,
)
from epd_proxy.sim import SimConfig

VLLM_TEXT = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 4.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} NaN
vllm:num_requests_waiting_by_reason{engine="0",model_name="Qwen/Qwen3-0.6B",reason="capacity"} 99.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="27536",swap_space="4"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="27000",swap_space="4"} 1.0
"""


def test_parse_sums_queues_over_engines_and_averages_kv_usage():
    assert parse_load(VLLM_TEXT) == (5.0, 4.0, 0.375)


def test_the_kv_cache_s_size_is_read_from_cache_config_info():
    assert parse_kv_blocks(VLLM_TEXT) == 27536 + 27000  # over its engines
    assert parse_kv_blocks(b'vllm:cache_config_info{num_gpu_blocks="None"} 1.0\n') is None  # not known yet
    assert parse_kv_blocks(b"# vllm:cache_config_info{num_gpu_blocks=\"9\"} 1.0\n") is None
    assert parse_kv_blocks(b"") is None


def test_the_block_size_is_read_from_cache_config_info():
    assert parse_block_size(VLLM_TEXT) == 16
    assert parse_block_size(b"# vllm:cache_config_info{block_size=\"16\"} 1.0\n") is None
    assert parse_block_size(b'vllm:cache_config_info{block_size="None"} 1.0\n') is None
    assert parse_block_size(b"") is None


def test_a_queue_that_stands_still_past_the_hold_is_wedged_and_running_clears_it():
    s = LoadSignals()
    s.update(running=0, waiting=3, kv_usage=0.999, own_inflight=0, now=10.0)
    assert wedged(s, 10.0) is None  # not yet: a busy engine admits within a step
    s.update(running=0, waiting=4, kv_usage=0.999, own_inflight=0, now=11.0)
    assert wedged(s, 11.9) is None
    why = wedged(s, 12.0)
    assert why is not None and "4 requests waiting, none running" in why and "KV cache 99.9% full" in why
    s.update(running=1, waiting=4, kv_usage=0.999, own_inflight=0, now=13.0)
    assert wedged(s, 20.0) is None and s.stalled_since is None
    s.update(running=0, waiting=0, kv_usage=0.1, own_inflight=0, now=14.0)
    assert wedged(s, 20.0) is None  # idle is not wedged
    s.update(running=0, waiting=2, kv_usage=0.2, own_inflight=0, now=15.0)
    assert "none admitted" in (wedged(s, 18.0) or "")
    s.forget()
    assert wedged(s, 30.0) is None


def test_parse_ignores_comments_longer_names_and_bad_values():
    assert gauge_samples(VLLM_TEXT, b"vllm:num_requests_waiting") == [4.0]
    assert gauge_samples(b"vllm:num_requests_running 7\n", b"vllm:num_requests_running") == [7.0]
    assert gauge_samples(b"vllm:num_requests_running{a=\"} x\"} oops\n", b"vllm:num_requests_running") == []
    assert parse_load(b"# nothing here\nother_metric 1\n") is None
    assert parse_load(b"") is None


async def occupy(direct: ConnectionPool) -> None:
    """A long stream sent straight to an instance: load that did not come through the proxy."""
    t = TransportTimeouts(connect=5, headers=5, idle=5)
    resp = await direct.request("POST", "/v1/chat/completions", body=msgspec.json.encode(
        chat_body(max_tokens=200, stream=True)), headers=[(b"content-type", b"application/json")], timeouts=t)
    try:
        await resp.read()
    finally:
        resp.close()


async def test_the_scrape_reads_each_instances_own_queue():
    """A decode busy with requests that did not come through this proxy is seen as busy, and
    load-aware routing sends this proxy's requests to the idle one."""
    sim = SimConfig(itl_ms=20, ttft_ms=0.5)
    async with stack(prefill=0, decode=0, pd=2, sim=sim, decode_policy="load-aware",
                     scrape_interval=0.05) as (cluster, proxy, client):
        busy, idle = cluster.instances("pd")
        pools = proxy.app.pools["decode"]
        inst_busy = pools.find(busy.url)
        direct = ConnectionPool(busy.url)

        tasks = [asyncio.create_task(occupy(direct)) for _ in range(3)]
        try:
            await wait_for(lambda: inst_busy.signals.others >= 3, timeout=3)
            before = len(idle.generation_records())
            for k in range(4):
                assert (await client.chat(chat_body(f"question {k}"))).status == 200
            assert len(idle.generation_records()) - before == 4
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await direct.close()
        scraper = next(s for s in proxy.app.scrapers if s.pool.role == "decode")
        assert scraper.scrapes > 0 and scraper.failures == 0
        assert inst_busy.signals.kv_blocks == sim.num_gpu_blocks  # the simulator's cache_config_info


async def test_a_failed_scrape_forgets_the_signals_and_ejects_nothing():
    async with stack(prefill=0, decode=0, pd=2, decode_policy="load-aware",
                     scrape_interval=0.05) as (cluster, proxy, client):
        pool = proxy.app.pools["decode"]
        victim = pool.find(cluster.instances("pd")[0].url)
        await wait_for(lambda: victim.signals.scraped_at is not None, timeout=3)
        await cluster.instances("pd")[0].crash()
        try:
            await wait_for(lambda: victim.signals.scraped_at is None, timeout=3)
            assert victim.healthy and victim.failures == 0  # not a health signal
        finally:
            await cluster.instances("pd")[0].restart()


async def test_the_scrape_is_not_held_up_by_the_connection_cap():
    """At the cap (every connection to the instance busy with a stream) the instance's load is
    at its highest: the scrape passes the cap, as a health probe does, instead of queueing."""
    sim = SimConfig(itl_ms=20, ttft_ms=0.5)
    async with stack(prefill=0, decode=0, pd=1, sim=sim, scrape_interval=0.05, max_upstream_connections=1,
                     probe_timeout=5.0) as (cluster, proxy, client):
        inst = proxy.app.pools["decode"].instances[0]
        other = Client(proxy.url)
        stream = asyncio.ensure_future(other.chat(chat_body(max_tokens=200, stream=True), timeout=30))
        try:
            await wait_for(lambda: inst.inflight == 1, timeout=3)
            loop = asyncio.get_running_loop()
            since = loop.time()
            await wait_for(lambda: (inst.signals.scraped_at or 0) > since + 0.2, timeout=2)
            assert inst.signals.others == 0  # the running stream is this proxy's own
        finally:
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
            await other.close()


async def test_requests_that_end_during_a_scrape_are_not_counted_as_others():
    """The instance counts its requests somewhere between the scrape's request and its answer.
    Two requests of this proxy that end meanwhile are still in that count: they must not come
    back as two requests of someone else (which would steer traffic away for a whole interval)."""
    from epd_proxy.config import InstanceSpec
    from epd_proxy.instances.load_scraper import LoadScraper
    from epd_proxy.instances.pool import InstancePool

    asked, answer = asyncio.Event(), asyncio.Event()

    async def metrics(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        asked.set()
        await answer.wait()
        body = b"vllm:num_requests_running 2.0\nvllm:num_requests_waiting 0.0\nvllm:kv_cache_usage_perc 0.1\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(metrics, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = InstancePool("decode", [InstanceSpec(f"http://127.0.0.1:{port}", "decode")])
    inst = pool.instances[0]
    try:
        inst.inflight = 2  # this proxy's two requests, running on the instance
        scrape = asyncio.create_task(LoadScraper(pool, interval=1, timeout=5).scrape_once())
        await asyncio.wait_for(asked.wait(), 5)
        inst.inflight = 0  # both end before the instance's answer arrives
        answer.set()
        await asyncio.wait_for(scrape, 5)
        assert inst.signals.scraped_at is not None
        assert inst.signals.others == 0
        assert inst.signals.kv_usage == 0.1
    finally:
        inst.inflight = 0
        await pool.close()
        server.close()
        await server.wait_closed()


async def test_the_scrape_slows_while_only_this_proxys_load_shows_and_returns_at_others():
    """A proxy alone in front of its cluster learns nothing from most scrapes: the wait
    stretches to QUIET_STRETCH intervals, and the first round that shows another's requests
    brings back the full rate."""
    sim = SimConfig(itl_ms=20, ttft_ms=0.5)
    async with stack(prefill=0, decode=0, pd=2, sim=sim, decode_policy="load-aware",
                     scrape_interval=0.05) as (cluster, proxy, client):
        scraper = next(s for s in proxy.app.scrapers if s.pool.role == "decode")
        assert (await client.chat(chat_body("only mine"))).status == 200
        await wait_for(lambda: scraper.wait == 0.05 * QUIET_STRETCH, timeout=3)
        before = scraper.scrapes
        await asyncio.sleep(0.6)
        assert scraper.scrapes - before <= 2 * (0.6 / 0.2 + 1)  # 2 instances per round, every 0.2 s

        busy = cluster.instances("pd")[0]
        inst = proxy.app.pools["decode"].find(busy.url)
        direct = ConnectionPool(busy.url)

        task = asyncio.create_task(occupy(direct))
        try:
            # Seen within one stretched wait, and the rate is back at once.
            await wait_for(lambda: inst.signals.others >= 1 and scraper.wait == 0.05,
                           timeout=0.05 * QUIET_STRETCH + 0.5)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await direct.close()


def test_requests_deferred_for_their_kv_transfer_do_not_make_a_queue_that_stands_still():
    """vLLM's ``vllm:num_requests_waiting_by_reason``: a decode whose one waiting request waits
    for its pull from a prefill (``deferred``: a dead side channel's handshake, say) is not out of
    room; one whose requests wait for room (``capacity``: a KV cache full of pinned blocks) is."""
    text = (b'vllm:num_requests_running{engine="0"} 0.0\n'
            b'vllm:num_requests_waiting{engine="0"} 1.0\n'
            b'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 0.0\n'
            b'vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 1.0\n')
    assert parse_waiting_for_capacity(text) == 0.0
    s = LoadSignals()
    for now in (10.0, 11.0, 13.0):
        s.update(*parse_load(text), own_inflight=1, now=now, for_capacity=parse_waiting_for_capacity(text))
    assert wedged(s, 13.0) is None and s.stalled_since is None
    full = text.replace(b'reason="capacity"} 0.0', b'reason="capacity"} 3.0')
    assert parse_waiting_for_capacity(full) == 3.0
    for now in (20.0, 21.0, 23.0):
        s.update(*parse_load(full), own_inflight=1, now=now, for_capacity=parse_waiting_for_capacity(full))
    assert "3 requests waiting, none running" in (wedged(s, 23.0) or "")
    # Without the gauge (an older vLLM, the simulator) every waiting request counts.
    assert parse_waiting_for_capacity(b'vllm:num_requests_waiting{engine="0"} 1.0\n') is None
    assert parse_waiting_for_capacity(VLLM_TEXT) == 99.0
    assert parse_waiting_for_capacity(b'# vllm:num_requests_waiting_by_reason{reason="capacity"} 5\n') is None
