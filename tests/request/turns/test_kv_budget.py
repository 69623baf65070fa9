"""kv_budget.py and kv_guard.py: what the proxy's kept turns may pin of a decode's KV cache, and
a decode starved by pinned KV (vLLM 0.32's bidirectional transfer) taken out of routing."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import Client, stack, wait_for
from redis_server import redis_server  # noqa: F401  (the fixture)

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.instances.health import DRAINING, HEALTHY
from epd_proxy.request.turns.kv_budget import (
    KEEP,
    PRESSURE,
    RELEASE,
    SHARE,
    SHARE_REASON,
    STOP,
    DecodeKV,
    KeptRate,
    budget,
    decide,
)
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig, expected_text

CAP = 100_000  # tokens


def _d(**kw) -> DecodeKV:
    base = dict(capacity=CAP, usage=0.1, waiting=0, running=4, held=1000, life=60.0, rate=10.0)
    base.update(kw)
    return DecodeKV(**base)  # type: ignore[arg-type]


def test_capacity_unknown_keeps():
    assert decide(_d(capacity=None, usage=1.0, waiting=9, running=0)) == (KEEP, 0, "", None)


def test_quiet_decode_keeps_within_its_share():
    assert decide(_d()).action == KEEP
    assert budget(_d()) == int(SHARE * CAP)


def test_past_the_share_the_oldest_go():
    v = decide(_d(held=60_000, usage=0.6))
    assert v.action == RELEASE and v.reason == SHARE_REASON and v.tokens == 60_000 - 50_000


def test_what_the_proxy_cannot_release_shrinks_the_budget():
    # 70 % used, the proxy holds 10 %: 60 % is streams' and others', so 15 % is left below 75 %
    assert budget(_d(usage=0.7, held=10_000)) == 15_000
    assert decide(_d(usage=0.7, held=10_000)).action == KEEP
    # at 80 % (70 % not the proxy's) it holds 5,000 tokens too many: usage back to 75 %
    assert decide(_d(usage=0.8, held=10_000)) == (RELEASE, 5_000, SHARE_REASON, 5_000)


def test_under_pressure_the_oldest_go_back_to_the_target():
    v = decide(_d(usage=0.95, held=30_000))
    assert v.action in (RELEASE, STOP) and v.reason == PRESSURE and v.tokens >= 20_000


def test_a_decode_that_stands_still_gets_everything_back():
    v = decide(_d(usage=0.99, held=30_000, waiting=12, running=0, stalled=True))
    assert v.reason == PRESSURE and v.tokens == 30_000
    # one scrape with none running is a P/D decode loading its requests' KV, not pressure
    assert decide(_d(usage=0.3, held=3_000, waiting=4, running=0)).action == KEEP


def test_under_pressure_traffic_that_cannot_fit_its_life_stops_keeping():
    # 1000 tokens/s for a 60 s life needs 60k > the 50k budget: without pressure, the oldest go
    assert decide(_d(rate=1000.0)).action == KEEP
    assert decide(_d(rate=1000.0, held=52_000, usage=0.6)) == (RELEASE, 2_000, SHARE_REASON, 50_000)
    v = decide(_d(rate=1000.0, usage=0.95, held=30_000))
    assert v.action == STOP and v.reason == PRESSURE and v.tokens >= 20_000
    # 65 % is not the proxy's: 10k is left; 100 tokens/s for 60 s fit it
    assert decide(_d(rate=100.0, usage=0.95, held=30_000)).action == RELEASE
    # stopped: until the traffic needs less than 80 % of the budget, or the pressure ends
    assert decide(_d(rate=150.0, usage=0.95, held=30_000, stopped=True)).action == STOP
    assert decide(_d(rate=120.0, usage=0.95, held=30_000, stopped=True)).action == RELEASE
    assert decide(_d(rate=800.0, usage=0.5, held=0, stopped=True)).action == KEEP


def test_kept_rate_decays():
    r = KeptRate(window=10.0)
    r.add(1000, 0.0)
    assert r.rate(0.0) == pytest.approx(100.0)
    assert r.rate(10.0) == pytest.approx(100.0 / 2.718281828, rel=1e-3)
    assert r.rate(100.0) < 0.01


# -- on the simulator, over sockets ------------------------------------------------------------

SYSTEM = " ".join(f"s{i}" for i in range(200))


def _turn(conv: int, answer: int = 96) -> dict:
    return {"model": "sim-model", "max_tokens": answer,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"conversation {conv}: " + " ".join(f"q{conv}x{i}"
                                                                                      for i in range(40))}]}


def _next(prev: dict, conv: int) -> dict:
    return {"model": "sim-model", "max_tokens": prev["max_tokens"],
            "messages": prev["messages"] + [{"role": "assistant", "content": expected_text(prev)},
                                            {"role": "user", "content": f"and then {conv}?"}]}


async def _conversations(client, n: int, concurrency: int, deadline: float) -> list[float]:
    """``n`` two-turn conversations (the second turn reads the first from decode; the second's
    blocks stay pinned, as a conversation that ends leaves them), ``concurrency`` at once; each
    request's latency (a request that waits past ``deadline`` counts as ``deadline``)."""
    latencies: list[float] = []
    todo = iter(range(n))

    async def one(body: dict) -> None:
        t0 = time.monotonic()
        try:
            r = await asyncio.wait_for(client.chat(body, timeout=deadline + 5), deadline)
            assert r.status == 200, r.body
            assert r.text() == expected_text(body)
            latencies.append(time.monotonic() - t0)
        except TimeoutError:
            latencies.append(deadline)

    async def worker() -> None:
        for conv in todo:
            first = _turn(conv)
            await one(first)
            await one(_next(first, conv))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


def _starving_sim() -> SimConfig:
    # A small decode cache (256 blocks of 16 tokens: ~9 finished conversations' pins) and a TTL
    # far longer than the test: without the bound, the pins of ended conversations fill it.
    return SimConfig(itl_ms=1, ttft_ms=1, bidirectional=True, bidirectional_kv_ttl=120.0, num_gpu_blocks=256)


async def test_kept_turns_never_starve_a_decode():
    """Old code: the decode's cache fills with the ended conversations' pinned blocks and every
    request after that waits (vLLM hangs it) until the TTL; with the budget, the oldest kept
    turns are handed back and no request waits more than a couple of seconds."""
    async with stack(sim=_starving_sim(), local_prefill_max_tokens=0, scrape_interval=0.2,
                     kv_reuse_ttl=120.0) as (cluster, proxy, client):
        latencies = await _conversations(client, 40, 4, deadline=8.0)
        d = cluster.instances("decode")[0]
        assert len(latencies) == 80
        assert max(latencies) < 3.0, sorted(latencies)[-5:]
        assert d.engine.num_waiting == 0
        status = proxy.app.pipeline.reuse.status()[d.url]
        assert status["kv_budget"]["let_go"], status
        text = (await client.request("GET", "/metrics")).body.decode()
        assert any(ln.startswith("epd_proxy_kv_reuse_pressure_total{") and d.url in ln
                   for ln in text.splitlines())


async def test_replicas_sharing_their_turns_never_starve_a_decode(redis_server):  # noqa: F811
    """Two replicas keep their turns in one redis store: each counts every replica's held tokens
    on the decode and hands back its own oldest."""
    async with SimCluster(prefill=1, decode=1, config=_starving_sim()) as cluster:
        base = ProxyConfig(probe_interval=0, scrape_interval=0.2, local_prefill_max_tokens=0, kv_reuse_ttl=120.0,
                           state_store=redis_server.url, state_store_prefix="kvb:")
        proxies = [await start_proxy(config_for_cluster(cluster, base)) for _ in range(2)]
        clients = [Client(p.url) for p in proxies]
        try:
            waits = await asyncio.gather(*(_conversations(c, 20, 2, deadline=8.0) for c in clients))
            latencies = waits[0] + waits[1]
            assert len(latencies) == 80 and max(latencies) < 3.0, sorted(latencies)[-5:]
            assert cluster.instances("decode")[0].engine.num_waiting == 0
            let_go = [p.app.pipeline.reuse.guard.let_go for p in proxies]
            assert any(let_go), let_go
        finally:
            for c in clients:
                await c.close()
            for p in proxies:
                await p.close()


async def test_a_decode_that_stands_still_leaves_routing_at_once_and_comes_back():
    """A decode whose queue stands still (requests waiting, none running: its cache full of
    pinned blocks) is taken out of routing by the load scrape, not by probes; new requests go
    to the other decode; once it runs again it is back."""
    sim = SimConfig(itl_ms=1, ttft_ms=1, bidirectional=True, bidirectional_kv_ttl=120.0, num_gpu_blocks=64)
    async with stack(sim=sim, decode=2, kv_reuse=False, scrape_interval=0.1,
                     local_prefill_max_tokens=0) as (cluster, proxy, client):
        d1, d2 = cluster.instances("decode")
        pool = proxy.app.pipeline.decode
        pool.find(d2.url).health.state = DRAINING  # every request to d1 meanwhile
        pool.refresh()
        # Fill d1's cache with kept blocks the proxy does not know of (as streams' are)
        while d1.kv_reuse.kept_blocks < 40:
            await client.chat(_turn(d1.kv_reuse.kept_blocks))
        stuck = [asyncio.ensure_future(client.chat(_turn(1000 + i), timeout=60)) for i in range(2)]
        await wait_for(lambda: d1.engine.num_waiting > 0 and d1.engine.num_running == 0, timeout=10)
        pool.find(d2.url).health.state = HEALTHY
        pool.refresh()
        inst1 = pool.find(d1.url)
        await wait_for(lambda: inst1.health.out, timeout=5)
        assert inst1.health.cause == "wedged" and "waiting" in (inst1.health.last_error or "")
        before = d1.stats.requests
        for i in range(6):  # short ones: d2 keeps their blocks too, and its cache is as small
            r = await asyncio.wait_for(client.chat({"model": "sim-model", "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": f"hi {i}"}]}), 3)
            assert r.status == 200
        assert d1.stats.requests == before  # none sent to the wedged decode
        text = (await client.request("GET", "/metrics")).body.decode()
        assert f'epd_proxy_instance_failures_total{{kind="wedged",role="decode",url="{d1.url}"}}' in text
        d1.kv_reuse.drop()  # its pins freed (the TTL, a restart): it runs again
        d1.engine.capacity_freed()
        await asyncio.wait_for(asyncio.gather(*stuck), 10)
        await wait_for(lambda: not inst1.health.out, timeout=5)
