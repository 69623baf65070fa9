"""ConnectionPool's per-upstream connection cap against a real loopback server."""

from __future__ import annotations

import asyncio

import pytest

from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts, UpstreamError

T = TransportTimeouts(connect=2.0, headers=5.0, idle=5.0)


class Gate:
    """A server handler that answers each request only when the test lets it, and
    remembers the order requests arrived in and the most connections open at once."""

    def __init__(self) -> None:
        self.arrived: list[str] = []
        self.open_gates: asyncio.Event = asyncio.Event()
        self.peak = 0
        self.server = None

    async def __call__(self, req, writer) -> None:
        self.arrived.append(req.path)
        self.peak = max(self.peak, len(self.server.connections))
        if req.path.startswith("/hold"):
            await self.open_gates.wait()
        if req.path.startswith("/stream"):  # headers now, the end of the body later
            writer.start(200, b"text/plain")
            writer.write(b"part;")
            await self.open_gates.wait()
            writer.end(b"end")
            return
        writer.send(200, req.path.encode(), b"text/plain")


@pytest.fixture
async def gated(http_server):
    pools: list[ConnectionPool] = []

    async def make(limit: int) -> tuple[Gate, ConnectionPool]:
        gate = Gate()
        gate.server = await http_server(gate)
        pool = ConnectionPool(f"http://127.0.0.1:{gate.server.port}", max_connections=limit)
        pools.append(pool)
        return gate, pool

    yield make
    for pool in pools:
        await pool.close()


async def fetch(pool: ConnectionPool, path: str, timeouts: TransportTimeouts = T) -> bytes:
    resp = await pool.request("GET", path, timeouts=timeouts)
    try:
        return await resp.read()
    finally:
        resp.close()


async def until(predicate) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not reached")


async def test_requests_over_the_cap_wait_and_all_complete(gated):
    gate, pool = await gated(3)
    tasks = [asyncio.ensure_future(fetch(pool, f"/hold/{i}")) for i in range(20)]
    await until(lambda: len(gate.arrived) == 3 and pool.waiting == 17)
    assert pool.open_connections == 3
    gate.open_gates.set()
    bodies = await asyncio.gather(*tasks)
    assert bodies == [f"/hold/{i}".encode() for i in range(20)]
    assert gate.peak <= 3 and pool.open_connections <= 3 and pool.waiting == 0


async def test_the_line_is_first_in_first_out(gated):
    gate, pool = await gated(1)
    first = asyncio.ensure_future(fetch(pool, "/hold/first"))
    await until(lambda: gate.arrived == ["/hold/first"])
    rest = []
    for i in range(5):
        rest.append(asyncio.ensure_future(fetch(pool, f"/n/{i}")))
        await until(lambda n=i + 1: pool.waiting == n)
    gate.open_gates.set()
    await asyncio.gather(first, *rest)
    assert gate.arrived == ["/hold/first"] + [f"/n/{i}" for i in range(5)]
    assert pool.open_connections == 1


async def test_a_cancelled_waiter_leaks_no_slot(gated):
    gate, pool = await gated(1)
    first = asyncio.ensure_future(fetch(pool, "/hold/a"))
    await until(lambda: len(gate.arrived) == 1)
    waiter = asyncio.ensure_future(fetch(pool, "/b"))
    await until(lambda: pool.waiting == 1)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert pool.waiting == 0
    gate.open_gates.set()
    assert await first == b"/hold/a"
    assert await fetch(pool, "/c") == b"/c"
    assert gate.arrived == ["/hold/a", "/c"]


async def test_a_waiter_cancelled_as_it_is_served_passes_the_connection_on(gated):
    """The connection is handed to the waiter's future, then the waiter is cancelled
    before it runs: the connection must go back, not vanish with the waiter."""
    gate, pool = await gated(1)
    resp = await pool.request("GET", "/stream", timeouts=T)  # holds the only connection
    waiter = asyncio.ensure_future(fetch(pool, "/served-then-cancelled"))
    await until(lambda: pool.waiting == 1)
    gate.open_gates.set()
    assert await resp.read() == b"part;end"  # the connection is handed to the waiter's future here...
    resp.close()
    waiter.cancel()  # ...and the waiter is cancelled before it resumes
    await asyncio.gather(waiter, return_exceptions=True)
    assert waiter.cancelled()
    assert await asyncio.wait_for(fetch(pool, "/next"), 2) == b"/next"
    assert pool.open_connections == 1


async def test_a_waiter_cancelled_as_a_slot_frees_passes_the_slot_on(gated):
    gate, pool = await gated(1)
    resp = await pool.request("GET", "/stream", timeouts=T)
    waiter = asyncio.ensure_future(fetch(pool, "/y"))
    await until(lambda: pool.waiting == 1)
    resp.close()  # an unfinished body: the connection is aborted, its slot given to the waiter...
    waiter.cancel()  # ...which leaves before it could use it
    await asyncio.gather(waiter, return_exceptions=True)
    assert waiter.cancelled()
    gate.open_gates.set()
    assert await asyncio.wait_for(fetch(pool, "/z"), 2) == b"/z"


async def test_the_wait_is_bounded_by_the_header_timeout(gated):
    gate, pool = await gated(1)
    first = asyncio.ensure_future(fetch(pool, "/hold/a"))
    await until(lambda: len(gate.arrived) == 1)
    with pytest.raises(UpstreamError, match="--max-upstream-connections") as exc:
        await fetch(pool, "/late", TransportTimeouts(connect=1.0, headers=0.05, idle=1.0))
    assert exc.value.kind == "local" and "127.0.0.1" not in str(exc.value)
    assert pool.waiting == 0
    gate.open_gates.set()
    await first
    assert await fetch(pool, "/after") == b"/after"


async def test_closing_the_pool_fails_its_waiters(gated):
    gate, pool = await gated(1)
    first = asyncio.ensure_future(fetch(pool, "/hold/a"))
    await until(lambda: len(gate.arrived) == 1)
    waiter = asyncio.ensure_future(fetch(pool, "/b"))
    await until(lambda: pool.waiting == 1)
    await pool.close()
    with pytest.raises(UpstreamError):
        await waiter
    await asyncio.gather(first, return_exceptions=True)


async def test_many_abandoned_waiters_are_dropped_from_the_line(gated):
    gate, pool = await gated(1)
    first = asyncio.ensure_future(fetch(pool, "/hold/a"))
    await until(lambda: len(gate.arrived) == 1)
    waiters = [asyncio.ensure_future(fetch(pool, f"/w{i}")) for i in range(200)]
    await until(lambda: pool.waiting == 200)
    for w in waiters[:150]:
        w.cancel()
    await asyncio.gather(*waiters[:150], return_exceptions=True)
    assert pool.waiting == 50 and len(pool._waiters) < 150
    gate.open_gates.set()
    await asyncio.gather(first, *waiters[150:])
    assert gate.arrived[1:] == [f"/w{i}" for i in range(150, 200)]


async def test_the_cap_must_be_positive():
    with pytest.raises(ValueError):
        ConnectionPool("http://127.0.0.1:1", max_connections=0)


async def test_a_request_that_may_not_queue_opens_one_over_the_cap(gated):
    """A health probe measures the upstream, not the pool's line: it never waits."""
    gate, pool = await gated(1)
    first = asyncio.ensure_future(fetch(pool, "/hold/a"))
    await until(lambda: len(gate.arrived) == 1)
    waiter = asyncio.ensure_future(fetch(pool, "/queued"))
    await until(lambda: pool.waiting == 1)
    resp = await pool.request("GET", "/probe", timeouts=T, queue=False)
    assert await resp.read() == b"/probe"
    resp.close()
    assert pool.waiting == 1  # the over-the-cap connection was closed, not handed on
    assert pool.open_connections == 1
    gate.open_gates.set()
    assert await first == b"/hold/a" and await waiter == b"/queued"
    assert await fetch(pool, "/again") == b"/again"
    assert pool.open_connections == 1
