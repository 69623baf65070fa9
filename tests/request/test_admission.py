"""Admission control: the pure policy, the slot/queue mechanics, and shedding over real sockets."""

import asyncio

import pytest
from helpers import chat_body, stack, wait_for

from epd_proxy.request.admission import ADMIT, QUEUE, SHED, Admission, decide

# -- the policy ------------------------------------------------------------------------------------

@pytest.mark.parametrize("active, waiting, limit, queue, want", [
    (10_000, 0, 0, 0, ADMIT),   # unlimited
    (0, 0, 1, 0, ADMIT),
    (1, 0, 1, 0, SHED),         # full, no queue
    (1, 0, 1, 2, QUEUE),
    (1, 2, 1, 2, SHED),         # queue full
    (0, 1, 1, 2, QUEUE),        # a free slot never lets a newcomer overtake a waiter
])
def test_decide(active, waiting, limit, queue, want):
    assert decide(active, waiting, limit, queue) == want


async def test_a_freed_slot_goes_to_the_oldest_waiter():
    adm = Admission(limit=1, queue_size=2)
    assert adm.try_enter() == ADMIT
    assert adm.try_enter() == QUEUE
    first = asyncio.ensure_future(adm.wait())
    assert adm.try_enter() == QUEUE
    second = asyncio.ensure_future(adm.wait())
    await wait_for(lambda: adm.waiting == 2)
    assert adm.try_enter() == SHED and adm.shed == 1
    adm.leave()
    assert await first is True and not second.done()
    assert adm.active == 1 and adm.waiting == 1
    adm.leave()
    assert await second is True
    adm.leave()
    assert adm.active == 0 and adm.waiting == 0


async def test_queue_timeout_and_cancelled_waiters_leave_no_trace():
    adm = Admission(limit=1, queue_size=5, queue_timeout=0.05)
    assert adm.try_enter() == ADMIT
    assert adm.try_enter() == QUEUE
    assert await adm.wait() is False
    assert adm.shed == adm.timed_out == 1 and adm.waiting == 0
    adm.queue_timeout = 0
    assert adm.try_enter() == QUEUE
    gone = asyncio.ensure_future(adm.wait())
    await wait_for(lambda: adm.waiting == 1)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert adm.waiting == 0
    adm.leave()
    assert adm.active == 0


async def test_a_slot_handed_to_a_waiter_that_left_is_passed_on():
    adm = Admission(limit=1, queue_size=5)
    adm.try_enter()
    adm.try_enter()
    a = asyncio.ensure_future(adm.wait())
    adm.try_enter()
    b = asyncio.ensure_future(adm.wait())
    await wait_for(lambda: adm.waiting == 2)
    adm.leave()  # a's future is resolved; a has not run yet
    a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a
    assert await b is True
    assert adm.active == 1


async def test_closing_sends_every_waiter_away_without_a_slot():
    adm = Admission(limit=1, queue_size=5)
    adm.try_enter()
    waiters = []
    for _ in range(3):
        assert adm.try_enter() == QUEUE
        waiters.append(asyncio.ensure_future(adm.wait()))
    await wait_for(lambda: adm.waiting == 3)
    adm.close()
    assert await asyncio.gather(*waiters) == [False, False, False]
    assert adm.active == 1 and adm.waiting == 0
    adm.leave()
    assert adm.active == 0


# -- over real sockets -----------------------------------------------------------------------------

def _hold_one(cluster, client):
    """A request that stays in flight: its prefill never answers."""
    cluster.instances("prefill")[0].inject("hang")
    task = asyncio.ensure_future(client.chat(chat_body(stream=True)))
    return task


async def test_beyond_the_limit_a_request_is_shed_with_429_before_any_upstream_work():
    async with stack(max_inflight=1) as (cluster, proxy, client):
        held = _hold_one(cluster, client)
        await wait_for(lambda: len(cluster.records("prefill")) == 1)
        # The body is not even valid JSON: shedding happens before it is parsed.
        reply = await client.post("/v1/chat/completions", b"{not json", headers=[(b"x-request-id", b"shed-1")])
        assert reply.status == 429
        assert reply.headers[b"retry-after"] == b"1"
        assert reply.headers[b"x-request-id"] == b"shed-1"
        # A key's 429 in shape (a string code), without the proxy's configuration.
        err = reply.json()["error"]
        assert err == {"message": "the proxy is at capacity; retry later", "type": "RateLimitError", "param": None,
                       "code": "overloaded"}
        anthropic = await client.post("/v1/messages", b"{not json")
        assert anthropic.status == 429 and anthropic.json() == {
            "type": "error", "error": {"type": "rate_limit_error", "message": "the proxy is at capacity; retry later"}}
        assert len(cluster.records("prefill")) == 1 and cluster.records("decode") == []
        # /health and /metrics are not admission-controlled.
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert "epd_proxy_shed_requests_total 2.0" in metrics
        assert 'status="429"} 1.0' in metrics
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await wait_for(lambda: proxy.app.pipeline.admission.active == 0)
        cluster.instances("prefill")[0].clear_faults()
        assert (await client.chat(chat_body())).status == 200


async def test_a_queued_request_is_served_when_a_slot_frees_and_a_full_queue_sheds():
    async with stack(max_inflight=1, queue_size=1, queue_timeout=30) as (cluster, proxy, client):
        held = _hold_one(cluster, client)
        await wait_for(lambda: len(cluster.records("prefill")) == 1)
        queued = asyncio.ensure_future(client.chat(chat_body(stream=True)))
        adm = proxy.app.pipeline.admission
        await wait_for(lambda: adm.waiting == 1)
        assert (await client.chat(chat_body())).status == 429  # the queue is full
        assert len(cluster.records("prefill")) == 1
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert "epd_proxy_queue_depth 1.0" in metrics
        held.cancel()  # the client leaves: its slot goes to the queued request
        await asyncio.gather(held, return_exceptions=True)
        reply = await queued
        assert reply.status == 200 and reply.body.endswith(b"data: [DONE]\n\n")
        assert adm.active == 0 and adm.waiting == 0 and adm.queued == 1
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert "epd_proxy_queue_wait_seconds_count 1.0" in metrics


async def test_queue_timeout_answers_429():
    async with stack(max_inflight=1, queue_size=4, queue_timeout=0.1) as (cluster, proxy, client):
        held = _hold_one(cluster, client)
        await wait_for(lambda: len(cluster.records("prefill")) == 1)
        reply = await client.chat(chat_body())
        assert reply.status == 429 and reply.json()["error"]["type"] == "RateLimitError"
        assert proxy.app.pipeline.admission.timed_out == 1
        assert len(cluster.records("prefill")) == 1
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)


# -- per-stage caps (--max-inflight-per-role) -----------------------------------------------------

async def test_a_full_prefill_stage_sheds_with_429_naming_the_stage():
    async with stack(max_inflight_per_role={"prefill": 1}) as (cluster, proxy, client):
        held = _hold_one(cluster, client)
        await wait_for(lambda: len(cluster.records("prefill")) == 1)
        reply = await client.chat(chat_body())
        assert reply.status == 429 and reply.headers[b"retry-after"] == b"1"
        assert "prefill stage" in reply.json()["error"]["message"]
        assert len(cluster.records("prefill")) == 1 and cluster.records("decode") == []
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert 'epd_proxy_stage_shed_requests_total{role="prefill"} 1.0' in metrics
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await wait_for(lambda: proxy.app.pipeline.role_caps["prefill"].active == 0)
        cluster.instances("prefill")[0].clear_faults()
        assert (await client.chat(chat_body())).status == 200


async def test_a_hung_encoder_pool_holds_image_requests_only():
    async with stack(encode=1, max_inflight_per_role={"encode": 1}, queue_size=1,
                     queue_timeout=30) as (cluster, proxy, client):
        cluster.instances("encode")[0].inject("hang")
        held = asyncio.ensure_future(client.chat(chat_body(images=["https://x/a.png"])))
        await wait_for(lambda: len(cluster.records("encode")) == 1)
        queued = asyncio.ensure_future(client.chat(chat_body(images=["https://x/b.png"])))
        cap = proxy.app.pipeline.role_caps["encode"]
        await wait_for(lambda: cap.waiting == 1)
        assert (await client.chat(chat_body(images=["https://x/c.png"]))).status == 429  # queue full
        assert (await client.chat(chat_body())).status == 200  # text needs no encoder slot
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        assert (await queued).status == 200
        assert cap.active == 0


def test_role_caps_on_the_command_line():
    from epd_proxy.cli import build_parser
    from epd_proxy.cli.serve import config_from_args

    args = build_parser().parse_args(["serve", "--decode", "http://d:1", "--prefill", "http://p:1",
                                      "--max-inflight-per-role", "prefill=64,encode=8"])
    assert config_from_args(args).max_inflight_per_role == {"prefill": 64, "encode": 8}
    args = build_parser().parse_args(["serve", "--decode", "http://d:1", "--max-inflight-per-role", "decode=1"])
    with pytest.raises(ValueError, match="encode or prefill"):
        config_from_args(args).validate()


async def test_reserved_slots_are_the_top_classs_and_it_overtakes_the_classes_below():
    adm = Admission(limit=2, queue_size=8)
    adm.reserve_for(top=2, slots=1)
    assert adm.try_enter(0) == ADMIT  # a standard request: the one unreserved slot
    assert adm.try_enter(0) == QUEUE  # the reserved slot is not a standard request's
    low = asyncio.ensure_future(adm.wait("a", 0))
    await wait_for(lambda: adm.waiting == 1)
    assert adm.try_enter(2) == ADMIT  # a critical one takes it at once, past the standard waiter
    assert adm.try_enter(2) == QUEUE  # both slots taken: it waits, ahead of the standard one
    high = asyncio.ensure_future(adm.wait("b", 2))
    await wait_for(lambda: adm.waiting == 2)
    adm.leave()
    assert await high is True and not low.done()
    adm.leave()  # a critical request ends: its slot is reserved, the standard waiter keeps waiting
    await asyncio.sleep(0)
    assert not low.done() and adm.active == 1
    adm.leave()  # the standard request ends: its slot goes to the standard waiter
    assert await low is True and adm.active == 1
    adm.leave()
    assert adm.active == 0
