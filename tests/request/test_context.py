"""RequestContext: in-flight counts stay exact whatever way a request ends."""

import asyncio

import pytest

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import choose
from epd_proxy.request.context import RequestContext


@pytest.fixture
async def pool():
    p = InstancePool("decode", [InstanceSpec(f"http://127.0.0.1:{9100 + i}", "decode") for i in range(2)])
    try:
        yield p
    finally:
        await p.close()


def ctx(headers=()):
    return RequestContext("req-1", "/v1/chat/completions", list(headers))


async def test_hold_and_release_count_each_instance(pool):
    a, b = pool.instances
    c = ctx()
    c.hold(a)
    c.hold(b)
    c.hold(a)  # a second leg on the same instance (a retry that came back to it)
    assert (a.inflight, b.inflight) == (2, 1)
    c.release(a)
    assert (a.inflight, b.inflight) == (1, 1)
    c.release_all()
    assert (a.inflight, b.inflight) == (0, 0)
    assert c.legs == [a, b, a]  # the access log's record keeps every leg


async def test_release_of_what_is_not_held_changes_nothing(pool):
    a, b = pool.instances
    c = ctx()
    c.hold(a)
    c.release(b)
    c.release(a)
    c.release(a)
    assert (a.inflight, b.inflight) == (0, 0)
    c.release_all()
    assert (a.inflight, b.inflight) == (0, 0)


async def test_release_all_is_idempotent(pool):
    a, _ = pool.instances
    c = ctx()
    c.hold(a)
    c.release_all()
    c.release_all()
    assert a.inflight == 0


async def test_counts_are_exact_when_requests_are_cancelled(pool):
    """Requests cancelled at every point of their legs (the client left) give back exactly
    what they held, while others still hold theirs."""
    a, b = pool.instances
    gate = asyncio.Event()
    holding = []

    async def request(legs):
        c = ctx()
        try:
            for inst in legs:
                c.hold(inst)
                holding.append(inst)
                await gate.wait()
                c.release(inst)
        finally:
            c.release_all()

    tasks = [asyncio.ensure_future(request(legs)) for legs in ([a], [a, b], [b, b], [b])]
    while len(holding) < 4:
        await asyncio.sleep(0)
    assert (a.inflight, b.inflight) == (2, 2)
    tasks[0].cancel()
    tasks[2].cancel()
    await asyncio.gather(tasks[0], tasks[2], return_exceptions=True)
    assert (a.inflight, b.inflight) == (1, 1)
    gate.set()  # the others finish their legs; [a, b] holds b next, then lets it go
    await asyncio.gather(tasks[1], tasks[3])
    assert (a.inflight, b.inflight) == (0, 0)
    assert all(t.cancelled() for t in (tasks[0], tasks[2]))


async def test_failed_instances_are_excluded_for_the_request(pool):
    a, b = pool.instances
    c = ctx()
    c.failed(a)
    c.failed(a)
    assert c.excluded == {a}
    assert choose(pool, c.excluded) is b


def test_timings_add_up_per_stage():
    c = ctx()
    c.timing("prefill", 0.25)
    c.timing("prefill", 0.5)
    c.timing("decode", 1.0)
    assert c.timings == {"prefill": 0.75, "decode": 1.0}


def test_upstream_headers_carry_the_request_id_and_the_forwarded_ones():
    auth = (b"authorization", b"Bearer k")
    c = ctx([auth])
    assert c.upstream_headers() == [(b"content-type", b"application/json"), (b"x-request-id", b"req-1"), auth]
    extra = (b"x-data-parallel-rank", b"1")
    assert c.upstream_headers("leg-2", [extra]) == [
        (b"content-type", b"application/json"), (b"x-request-id", b"leg-2"), auth, extra]
    assert c.upstream_headers() == [(b"content-type", b"application/json"), (b"x-request-id", b"req-1"), auth]


async def test_backlog_leaves_with_its_leg_or_the_request(pool):
    a, b = pool.instances
    c = ctx()
    c.queue(a, 300)  # chosen, not held yet (the leg never started): the request's end takes it out
    c.hold(b)
    c.queue(b, 50)
    assert (a.backlog, b.backlog) == (300, 50)
    c.release(b)  # the prefill answered: what it computed is no longer ahead of anyone
    assert (a.backlog, b.backlog) == (300, 0)
    c.release_all()
    assert (a.backlog, b.backlog) == (0, 0)
