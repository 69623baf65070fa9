"""How a hedged prefill's race ends, on the simulator (request/legs/hedged.py): a first attempt
that fails while its hedge runs leaves the answer to the hedge, a hedge that fails leaves it to
the first attempt, and a client that leaves mid-race takes both prefills down with it."""

import asyncio

from helpers import Client, chat_body, stack, wait_for

HEDGE = {"prefill_policy": "round-robin", "hedge_min_delay": 0.01, "hedge_max_delay": 0.02, "hedge_budget": 100.0}


async def test_a_failed_first_attempt_or_a_failed_hedge_leaves_the_answer_to_the_other():
    async with stack(prefill=2, **HEDGE) as (cluster, proxy, client):
        p0, p1 = cluster.instances("prefill")
        p0.inject("delay=0.1,status=500", times=10)  # fails, after the hedge started
        p1.inject("delay=0.3", times=10)  # slow but answers
        for i in range(4):  # round-robin: the first attempt on each in turn
            reply = await client.chat(chat_body(f"race {i}"))
            assert reply.status == 200, reply.body
        hedges = proxy.app.metrics.hedges
        # First on p0: it fails at 0.1 s, the hedge on p1 answers. First on p1: the hedge on p0 fails.
        assert hedges[("prefill", "won")] == 2 and hedges[("prefill", "failed")] == 2, hedges
        decodes = cluster.records("decode")
        assert len(decodes) == 4  # one decode per request, never two
        pool = proxy.app.pools["prefill"]
        assert all(i.inflight == 0 for i in pool.instances)
        hedging = proxy.app.pipeline.connector.hedging
        assert hedging.pending == {} and hedging.in_flight == {}


async def test_a_client_leaving_mid_race_aborts_both_prefills():
    async with stack(prefill=2, **HEDGE) as (cluster, proxy, _):
        for p in cluster.instances("prefill"):
            p.inject("delay=2", times=10)
        client = Client(proxy.url)
        try:
            await asyncio.wait_for(client.chat(chat_body("leaving")), 0.3)
        except (asyncio.TimeoutError, TimeoutError):
            pass
        await client.close()
        pool = proxy.app.pools["prefill"]
        hedging = proxy.app.pipeline.connector.hedging
        await wait_for(lambda: all(i.inflight == 0 for i in pool.instances) and not hedging.in_flight)
        assert hedging.pending == {}
        await wait_for(lambda: sum(r.aborted for r in cluster.records("prefill")) == 2)  # both legs aborted
        assert cluster.records("decode") == []
        assert proxy.app.metrics.hedges[("prefill", "won")] == 0


async def test_a_slow_encoder_sub_request_is_hedged_on_another_encoder():
    async with stack(encode=2, prefill=1, encode_policy="round-robin", **HEDGE) as (cluster, proxy, client):
        e0, _ = cluster.instances("encode")
        e0.inject("delay=2", times=10)  # accepts, answers nothing for 2 s
        loop = asyncio.get_running_loop()
        for i in range(4):  # round-robin: the first call on each encoder in turn
            t = loop.time()
            reply = await client.chat(chat_body(f"look {i}", images=[f"https://example.com/{i}.png"]))
            assert reply.status == 200, reply.body
            assert reply.text()
            assert loop.time() - t < 1.0  # not the slow encoder's 2 s
        hedges = proxy.app.metrics.hedges
        won = hedges[("encode", "won")]  # a hedge's placement moves the round-robin cursor too
        assert won >= 2, hedges
        assert len(cluster.records("decode")) == 4  # one decode per request
        # The slow encoder's calls were aborted (their connections closed), none left in flight.
        await wait_for(lambda: sum(r.aborted for r in e0.records) == won)
        fanout = proxy.app.pipeline.fanout
        assert not any(fanout.outstanding.values()) and fanout.hedging.in_flight == {}
