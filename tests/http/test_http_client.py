"""ConnectionPool / Response against real loopback peers."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket

import pytest
from httpkit import Recorder, all_requests, chunked, connect, read_to_eof, send_fin_now, set_rst_on_close

from epd_proxy.http.client import ConnectionPool, _Connection
from epd_proxy.http.transport import TransportTimeouts, UpstreamError, UpstreamTimeout

FAST = TransportTimeouts(connect=1.0, headers=1.0, idle=1.0)


def ok(body: bytes, *headers: bytes) -> bytes:
    extra = b"".join(h + b"\r\n" for h in headers)
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%b\r\n%b" % (len(body), extra, body)


async def serve_ok(conn) -> None:
    """Answer every request with its own target as the body (keep-alive)."""
    while (req := await conn.request()) is not None:
        conn.send(ok(req.target.encode()))


@pytest.fixture
async def pools():
    made: list[ConnectionPool] = []

    def make(url: str, **kw) -> ConnectionPool:
        p = ConnectionPool(url, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        await p.close()


# -- bodies ------------------------------------------------------------------------------
async def test_content_length_body_and_request_line(http_server, pools):
    seen = []

    async def handler(req, w):
        seen.append((req.method, req.path, req.query, req.header(b"x-req"), req.header(b"host"), req.body))
        w.send(200, b'{"a":1}', headers=[(b"x-test", b"yes")])

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}/base/")
    resp = await pool.request("POST", "/v1/x?q=1", body=b"hello", headers=[(b"x-req", b"1")], timeouts=FAST)
    assert resp.status == 200
    assert resp.headers[b"x-test"] == b"yes"
    assert resp.content_type == b"application/json"
    assert await resp.read() == b'{"a":1}'
    assert resp.complete
    assert seen == [("POST", "/base/v1/x", "q=1", b"1", f"127.0.0.1:{srv.port}".encode(), b"hello")]


async def test_fetch_reads_the_whole_answer_and_hands_the_connection_back(http_server, pools):
    seen = []

    async def handler(req, w):
        seen.append((req.method, req.path, req.header(b"x-req"), req.body))
        if req.path == "/missing":
            w.send(404, b"not here", b"text/plain")
        else:
            w.send(200, b'{"a":1}')

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}")
    got = await pool.fetch("POST", "/x", headers=[(b"x-req", b"1")], timeouts=FAST, body=b"hello")
    assert got == (200, b"application/json", b'{"a":1}')
    assert pool.open_connections == 1 and pool.idle_connections == 1  # released, kept alive
    assert await pool.fetch("GET", "/missing", timeouts=FAST) == (404, b"text/plain", b"not here")
    assert pool.open_connections == 1  # the same connection again
    assert seen == [("POST", "/x", b"1", b"hello"), ("GET", "/missing", None, b"")]


async def test_fetch_body_cut_short_is_an_upstream_error_and_the_connection_is_dropped(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await conn.writer.drain()
        conn.writer.close()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    with pytest.raises(UpstreamError) as ei:
        await pool.fetch("GET", "/", timeouts=FAST)
    assert ei.value.response_started
    assert pool.open_connections == 0 and pool.idle_connections == 0


async def test_fetch_silent_body_is_an_upstream_timeout(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nstart")
        conn.eof = await read_to_eof(conn.reader)  # then nothing

    srv = await raw_server(handler)
    pool = pools(srv.url)
    with pytest.raises(UpstreamTimeout) as ei:
        await pool.fetch("GET", "/", timeouts=TransportTimeouts(connect=1, headers=1, idle=0.2))
    assert ei.value.kind == "timeout" and ei.value.response_started
    await asyncio.wait_for(srv.conns[0].closed.wait(), 1)  # the client hung up
    assert pool.open_connections == 0


async def test_chunked_body_read_chunk_piece_by_piece(raw_server, pools):
    pieces = [b"alpha", b"beta", b"gamma"]
    step = asyncio.Queue()

    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n")
        for p in pieces:
            await step.get()
            conn.send(b"%x\r\n%b\r\n" % (len(p), p))
        await step.get()
        conn.send(b"0\r\n\r\n")
        await conn.reader.read()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=FAST)
    assert resp.content_type == b"text/event-stream"
    got = []
    for _ in pieces:
        step.put_nowait(None)
        got.append(await resp.read_chunk())
    step.put_nowait(None)
    assert await resp.read_chunk() == b""
    assert got == pieces
    assert resp.complete
    assert await resp.read_chunk() == b""  # stays at the end
    assert pool.idle_connections == 1


async def test_chunked_body_read_joins_everything(raw_server, pools):
    body = os.urandom(200_000)

    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(0, len(body), 7_000):
            conn.send(chunked(body[i:i + 7_000])[:-5])
            await conn.writer.drain()
        conn.send(b"0\r\n\r\n")
        await conn.reader.read()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=FAST)
    assert await resp.read() == body


async def test_close_delimited_body(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart one, ")
        await conn.writer.drain()
        await asyncio.sleep(0.02)
        conn.send(b"part two")
        await conn.writer.drain()
        # returning closes the connection: that is the end of the body

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/a", timeouts=FAST)
    assert resp.status == 200
    assert await resp.read() == b"part one, part two"
    assert resp.complete
    assert pool.open_connections == 0 and pool.idle_connections == 0
    resp2 = await pool.request("GET", "/b", timeouts=FAST)
    assert await resp2.read() == b"part one, part two"
    assert len(srv.conns) == 2


async def test_close_delimited_body_read_chunk(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.0 200 OK\r\n\r\nabc")
        await conn.writer.drain()
        await asyncio.sleep(0.02)
        conn.send(b"def")

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=FAST)
    got = b""
    while chunk := await resp.read_chunk():
        got += chunk
    assert got == b"abcdef"
    assert resp.complete


async def test_close_delimited_body_cut_by_reset_is_an_error(raw_server, pools):
    """A RST is not the EOF that ends a close-delimited body: the body is truncated."""
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\n\r\nfirst")
        await conn.writer.drain()
        await asyncio.sleep(0.1)
        set_rst_on_close(conn.writer)
        conn.writer.transport.abort()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=FAST)
    assert await resp.read_chunk() == b"first"
    with pytest.raises(UpstreamError) as ei:
        await resp.read_chunk()
    assert ei.value.response_started
    assert not resp.complete


# -- relay -------------------------------------------------------------------------------
def _streaming_handler(pieces, *, gap=0.01, end=b"0\r\n\r\n", rst=False):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for p in pieces:
            await asyncio.sleep(gap)
            conn.send(b"%x\r\n%b\r\n" % (len(p), p))
            await conn.writer.drain()
        await asyncio.sleep(gap)
        if rst:
            set_rst_on_close(conn.writer)
            conn.writer.transport.abort()
            return
        if end is None:
            return  # close without the terminating chunk
        conn.send(end)
        await conn.reader.read()
    return handler


async def test_relay_gets_every_piece_in_order_then_end(raw_server, pools):
    pieces = [b"data: %d\n\n" % i for i in range(20)]
    srv = await raw_server(_streaming_handler(pieces))
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=FAST)
    sink = Recorder()
    resp.relay(sink)
    await asyncio.wait_for(resp.wait(), 2)
    assert sink.kinds[-1] == "end" and sink.kinds.count("end") == 1
    assert sink.data == b"".join(pieces)
    assert all(d for k, d in sink.events if k == "data")
    assert resp.complete
    assert pool.idle_connections == 1


async def test_relay_delivers_buffered_pieces_first(raw_server, pools):
    step = asyncio.Event()

    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunked(b"one")[:-5])
        await step.wait()
        conn.send(chunked(b"two")[:-5])
        await conn.writer.drain()
        await asyncio.sleep(0.05)
        conn.send(chunked(b"three")[:-5])
        await conn.writer.drain()
        await asyncio.sleep(0.05)
        conn.send(chunked(b"four"))
        await conn.reader.read()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=FAST)
    assert await resp.read_chunk() == b"one"
    step.set()
    await asyncio.sleep(0.08)  # "two" and "three" are buffered in the response by now
    sink = Recorder()
    resp.relay(sink)
    await asyncio.wait_for(sink.done.wait(), 2)
    assert sink.data == b"twothreefour"
    assert sink.kinds[-1] == "end"


async def test_relay_on_a_finished_response_ends_at_once(http_server, pools):
    async def handler(req, w):
        w.send(200, b"whole")

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}")
    resp = await pool.request("GET", "/", timeouts=FAST)
    await asyncio.sleep(0.02)
    sink = Recorder()
    resp.relay(sink)
    assert sink.events == [("data", b"whole"), ("end", None)]
    await resp.wait()


@pytest.mark.parametrize("rst", [False, True], ids=["fin", "rst"])
async def test_relay_upstream_cut_mid_body_calls_on_error(raw_server, pools, rst):
    pieces = [b"data: a\n\n", b"data: b\n\n"]
    srv = await raw_server(_streaming_handler(pieces, end=None, rst=rst))
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=FAST)
    sink = Recorder()
    resp.relay(sink)
    with pytest.raises(UpstreamError) as ei:
        await asyncio.wait_for(resp.wait(), 2)
    assert ei.value.response_started
    assert sink.kinds[-1] == "error" and "end" not in sink.kinds
    assert isinstance(sink.events[-1][1], UpstreamError)
    if not rst:  # a RST may discard data the kernel had already queued
        assert sink.data == b"".join(pieces)
    assert pool.open_connections == 0


# -- keep-alive --------------------------------------------------------------------------
async def test_keep_alive_reuses_one_socket(http_server, pools):
    async def handler(req, w):
        w.send(200, repr(req.peer).encode())

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}")
    peers = []
    for i in range(5):
        resp = await pool.request("GET", f"/{i}", timeouts=FAST)
        peers.append(await resp.read())
        assert pool.idle_connections == 1
    assert len(set(peers)) == 1
    assert len(srv.connections) == 1
    assert pool.open_connections == 1


async def test_concurrent_requests_use_separate_connections_then_pool_them(http_server, pools):
    gate = asyncio.Event()

    async def handler(req, w):
        await gate.wait()
        w.send(200, repr(req.peer).encode())

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}")
    tasks = [asyncio.create_task(pool.request("GET", "/", timeouts=FAST)) for _ in range(3)]
    await asyncio.sleep(0.05)
    gate.set()
    bodies = [await (await t).read() for t in tasks]
    assert len(set(bodies)) == 3
    assert pool.open_connections == 3 and pool.idle_connections == 3


async def test_max_idle_bounds_the_pool(http_server, pools):
    gate = asyncio.Event()

    async def handler(req, w):
        await gate.wait()
        w.send(200, b"x")

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}", max_idle=1)
    tasks = [asyncio.create_task(pool.request("GET", "/", timeouts=FAST)) for _ in range(3)]
    await asyncio.sleep(0.05)
    gate.set()
    for t in tasks:
        assert await (await t).read() == b"x"
    assert pool.idle_connections == 1 and pool.open_connections == 1
    await asyncio.sleep(0.05)
    assert len(srv.connections) == 1


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_reused_connection_closed_before_answer_is_retried_once(raw_server, pools, how):
    async def handler(conn):
        if conn.index == 0:
            req = await conn.request()
            conn.send(ok(req.target.encode()))
            await conn.request()  # the reused request: the server had decided to close
            if how == "rst":
                set_rst_on_close(conn.writer)
                conn.writer.transport.abort()
            return
        await serve_ok(conn)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    assert await (await pool.request("GET", "/1", timeouts=FAST)).read() == b"/1"
    resp = await pool.request("POST", "/2", body=b"payload", timeouts=FAST)
    assert resp.status == 200
    assert await resp.read() == b"/2"
    assert all_requests(srv) == [(0, "/1"), (0, "/2"), (1, "/2")]
    assert srv.conns[1].requests[0].body == b"payload"
    assert pool.open_connections == 1


async def test_retry_happens_only_once(raw_server, pools):
    async def handler(conn):
        if conn.index == 0:
            req = await conn.request()
            conn.send(ok(req.target.encode()))
        await conn.request()  # then close without answering, every time

    srv = await raw_server(handler)
    pool = pools(srv.url)
    assert await (await pool.request("GET", "/1", timeouts=FAST)).read() == b"/1"
    with pytest.raises(UpstreamError) as ei:
        await pool.request("GET", "/2", timeouts=FAST)
    assert ei.value.kind == "connection" and not ei.value.response_started
    assert all_requests(srv) == [(0, "/1"), (0, "/2"), (1, "/2")]


async def test_fresh_connection_failure_is_not_retried(raw_server, pools):
    async def handler(conn):
        await conn.request()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    with pytest.raises(UpstreamError) as ei:
        await pool.request("GET", "/", timeouts=FAST)
    assert ei.value.kind == "connection" and not ei.value.response_started
    assert len(srv.conns) == 1


async def test_server_idle_close_between_requests_uses_a_fresh_connection(raw_server, pools):
    """uvicorn / vLLM close idle keep-alive connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE."""
    async def handler(conn):
        while True:
            try:
                req = await asyncio.wait_for(conn.request(), 0.05)
            except asyncio.TimeoutError:
                return
            if req is None:
                return
            conn.send(ok(req.target.encode()))

    srv = await raw_server(handler)
    pool = pools(srv.url, idle_timeout=10)
    assert await (await pool.request("GET", "/1", timeouts=FAST)).read() == b"/1"
    await asyncio.sleep(0.15)
    assert pool.open_connections == 0  # the EOF on the idle socket took it out of the pool
    assert await (await pool.request("GET", "/2", timeouts=FAST)).read() == b"/2"
    assert all_requests(srv) == [(0, "/1"), (1, "/2")]


async def test_keep_alive_race_server_closes_as_client_reuses(raw_server, pools):
    """The server's idle close and the client's reuse land in the same loop iteration.

    The server sends a byte on a side channel and then a FIN on the pooled connection;
    the side channel wakes a task that reuses the pooled connection before the loop
    has called connection_lost for it. The request must be retried on a fresh
    connection, not fail (and on uvloop not raise a RuntimeError from a closed handle).
    """
    trigger = asyncio.Event()
    side = {}

    async def handler(conn):
        if conn.index == 0:
            req = await conn.request()
            conn.send(ok(req.target.encode()))
            await trigger.wait()
            side["w"].write(b"!")  # wakes the client task...
            send_fin_now(conn.writer)  # ...and the FIN lands in the same select() round
            await conn.reader.read()
            return
        if conn.index == 1:  # the side channel
            side["w"] = conn.writer
            await conn.reader.read()
            return
        await serve_ok(conn)

    srv = await raw_server(handler)
    pool = pools(srv.url, idle_timeout=10)
    assert await (await pool.request("GET", "/1", timeouts=FAST)).read() == b"/1"
    side_reader, side_writer = await connect(srv.port)
    await srv.wait_conns(2)
    await asyncio.sleep(0.01)
    trigger.set()
    assert await side_reader.readexactly(1) == b"!"
    resp = await pool.request("GET", "/2", timeouts=FAST)
    assert await resp.read() == b"/2"
    assert [c.index for c in srv.conns if c.requests and c.requests[-1].target == "/2"] == [2]
    side_writer.close()


async def test_failure_after_a_response_byte_is_not_retried(raw_server, pools):
    async def handler(conn):
        req = await conn.request()
        conn.send(ok(req.target.encode()))
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-le")
        await conn.writer.drain()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    assert await (await pool.request("GET", "/1", timeouts=FAST)).read() == b"/1"
    with pytest.raises(UpstreamError) as ei:
        await pool.request("GET", "/2", timeouts=FAST)
    assert ei.value.response_started
    assert len(srv.conns) == 1
    assert pool.open_connections == 0


async def test_failure_mid_body_is_not_retried(raw_server, pools):
    async def handler(conn):
        req = await conn.request()
        conn.send(ok(req.target.encode()))
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await conn.writer.drain()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    assert await (await pool.request("GET", "/1", timeouts=FAST)).read() == b"/1"
    resp = await pool.request("GET", "/2", timeouts=FAST)
    with pytest.raises(UpstreamError) as ei:
        await resp.read()
    assert ei.value.response_started and ei.value.kind == "connection"
    assert len(srv.conns) == 1


async def test_idle_connections_older_than_idle_timeout_are_not_reused(http_server, pools):
    async def handler(req, w):
        w.send(200, repr(req.peer).encode())

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}", idle_timeout=0.1)
    a = await (await pool.request("GET", "/", timeouts=FAST)).read()
    b = await (await pool.request("GET", "/", timeouts=FAST)).read()
    assert a == b  # within idle_timeout: reused
    await asyncio.sleep(0.15)
    c = await (await pool.request("GET", "/", timeouts=FAST)).read()
    assert c != a
    await asyncio.sleep(0.05)
    assert len(srv.connections) == 1  # the stale one was closed, not leaked
    assert pool.open_connections == 1


# -- special responses -------------------------------------------------------------------
async def test_interim_1xx_responses_are_skipped(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        await conn.writer.drain()
        await asyncio.sleep(0.01)
        conn.send(b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n"
                  + ok(b"final", b"x-final: 1"))
        await serve_ok(conn)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("POST", "/", body=b"x", timeouts=FAST)
    assert resp.status == 200
    assert resp.headers == {b"content-length": b"5", b"x-final": b"1"}
    assert await resp.read() == b"final"
    assert await (await pool.request("GET", "/next", timeouts=FAST)).read() == b"/next"
    assert len(srv.conns) == 1


@pytest.mark.parametrize("split", [False, True])
async def test_head_fields_as_a_field_callback_would_give_them(raw_server, pools, split):
    """The head's fields are read from its bytes once it is complete: names lower-cased,
    repeated fields joined, a value's leading whitespace dropped and its trailing kept, empty
    values kept, a colon inside a value kept; the same whether the head comes in one read or a
    byte at a time, after an interim head and blank lines."""
    head = (b"HTTP/1.1 100 Continue\r\nX-Interim: 1\r\n\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Type:  text/plain \r\nX-Dup: a\r\nx-dup:\tb\r\nX-Empty:\r\n"
            b"X-Url: http://h:1/p\r\nContent-Length: 4\r\n\r\nbody")

    async def handler(conn):
        await conn.request()
        if split:
            for i in range(len(head)):
                conn.send(head[i:i + 1])
                await conn.writer.drain()
                await asyncio.sleep(0)
        else:
            conn.send(head)
        await serve_ok(conn)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("POST", "/", body=b"x", timeouts=FAST)
    assert resp.headers == {b"content-type": b"text/plain ", b"x-dup": b"a, b", b"x-empty": b"",
                            b"x-url": b"http://h:1/p", b"content-length": b"4"}
    assert resp.content_type == b"text/plain "
    assert await resp.read() == b"body"
    assert await (await pool.request("GET", "/next", timeouts=FAST)).read() == b"/next"  # the next head alone
    assert len(srv.conns) == 1


@pytest.mark.parametrize("status", [204, 304])
async def test_no_body_status_and_reuse(raw_server, pools, status):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 %d Whatever\r\nx-a: b\r\n\r\n" % status)
        await serve_ok(conn)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=FAST)
    assert resp.status == status
    assert await asyncio.wait_for(resp.read(), 1) == b""
    assert resp.complete
    assert await (await pool.request("GET", "/next", timeouts=FAST)).read() == b"/next"
    assert len(srv.conns) == 1


async def test_head_request_has_no_body(http_server, pools):
    async def handler(req, w):
        w.send(200, b"0123456789")

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}")
    resp = await pool.request("HEAD", "/", timeouts=TransportTimeouts(connect=1, headers=1, idle=0.5))
    assert resp.headers[b"content-length"] == b"10"
    assert await asyncio.wait_for(resp.read(), 1) == b""
    resp2 = await pool.request("GET", "/", timeouts=FAST)
    assert await resp2.read() == b"0123456789"


async def test_connection_close_response_is_not_reused(raw_server, pools):
    async def handler(conn):
        req = await conn.request()
        conn.send(ok(req.target.encode(), b"connection: close"))
        await conn.writer.drain()
        conn.eof = await read_to_eof(conn.reader)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/1", timeouts=FAST)
    assert await resp.read() == b"/1"
    resp.close()
    assert pool.open_connections == 0 and pool.idle_connections == 0
    await asyncio.wait_for(srv.conns[0].closed.wait(), 1)  # the client closed its end
    assert await (await pool.request("GET", "/2", timeouts=FAST)).read() == b"/2"
    assert all_requests(srv) == [(0, "/1"), (1, "/2")]


async def test_unsolicited_response_on_idle_connection_is_not_reused(raw_server, pools):
    async def handler(conn):
        req = await conn.request()
        conn.send(ok(req.target.encode()))
        await conn.writer.drain()
        await asyncio.sleep(0.02)
        conn.send(ok(b"stale"))  # nobody asked for this one
        await serve_ok(conn)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    assert await (await pool.request("GET", "/1", timeouts=FAST)).read() == b"/1"
    await asyncio.sleep(0.08)
    assert pool.idle_connections == 0 and pool.open_connections == 0  # dropped, not re-pooled
    t = TransportTimeouts(connect=1, headers=0.5, idle=0.5)
    r = await asyncio.gather(*(pool.request("GET", f"/{i}", timeouts=t) for i in (2, 3)))
    assert [await x.read() for x in r] == [b"/2", b"/3"]


async def test_malformed_response_head(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 2x0 Nope\r\n\r\n")
        conn.eof = await read_to_eof(conn.reader)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    with pytest.raises(UpstreamError) as ei:
        await pool.request("GET", "/", timeouts=FAST)
    assert ei.value.kind == "protocol" and ei.value.response_started
    await asyncio.wait_for(srv.conns[0].closed.wait(), 1)
    assert len(srv.conns) == 1 and pool.open_connections == 0


async def test_malformed_body_fails_and_drops_the_connection(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nZZ\r\n")
        conn.eof = await read_to_eof(conn.reader)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=FAST)
    with pytest.raises(UpstreamError) as ei:
        await resp.read()
    assert ei.value.kind == "protocol"
    # The connection is gone even though nobody called resp.close().
    await asyncio.wait_for(srv.conns[0].closed.wait(), 1)
    assert pool.open_connections == 0


# -- connect errors and timeouts -----------------------------------------------------------
async def test_connect_refused(pools):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    pool = pools(f"http://127.0.0.1:{port}")
    with pytest.raises(UpstreamError) as ei:
        await pool.request("GET", "/", timeouts=FAST)
    assert ei.value.kind == "connect" and not ei.value.response_started
    assert pool.open_connections == 0


async def test_connect_timeout():
    # A listener that never accepts, with its accept queue full: SYNs are dropped.
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(0)
    port = ls.getsockname()[1]
    fillers = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(s)
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    probe = socket.socket()
    probe.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(probe, ("127.0.0.1", port)), 0.1)
        pytest.skip("this kernel completes connections to a full accept queue")
    except asyncio.TimeoutError:
        pass
    finally:
        probe.close()
    pool = ConnectionPool(f"http://127.0.0.1:{port}")
    t0 = loop.time()
    try:
        with pytest.raises(UpstreamError) as ei:
            await pool.request("GET", "/", timeouts=TransportTimeouts(connect=0.2, headers=1, idle=1))
        elapsed = loop.time() - t0
        assert ei.value.kind == "connect"
        assert 0.15 <= elapsed < 1.0
    finally:
        await pool.close()
        for s in fillers:
            s.close()
        ls.close()


async def test_header_timeout(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.eof = await read_to_eof(conn.reader)  # never answers

    srv = await raw_server(handler)
    pool = pools(srv.url)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(UpstreamTimeout) as ei:
        await pool.request("GET", "/", timeouts=TransportTimeouts(connect=1, headers=0.2, idle=5))
    elapsed = loop.time() - t0
    assert 0.18 <= elapsed < 0.8
    assert ei.value.kind == "timeout" and not ei.value.response_started
    await asyncio.wait_for(srv.conns[0].closed.wait(), 1)  # the client hung up
    assert pool.open_connections == 0


async def test_header_timeout_on_reused_connection_is_not_retried(raw_server, pools):
    async def handler(conn):
        req = await conn.request()
        conn.send(ok(req.target.encode()))
        await conn.request()
        await read_to_eof(conn.reader)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    assert await (await pool.request("GET", "/1", timeouts=FAST)).read() == b"/1"
    with pytest.raises(UpstreamTimeout):
        await pool.request("GET", "/2", timeouts=TransportTimeouts(connect=1, headers=0.15, idle=5))
    assert len(srv.conns) == 1


async def test_header_timeout_not_lost_when_connection_reused_immediately(raw_server, pools):
    """Request A's whole response arrives in one segment, so its connection goes back to
    the pool before A's task resumes. Task B, woken in the same round, takes that
    connection; A's resumption must not disarm B's header timer."""
    side = {}
    side_ready = asyncio.Event()
    b_waiting = asyncio.Event()

    async def handler(conn):
        if conn.index == 1:
            side["w"] = conn.writer
            side_ready.set()
            await conn.reader.read()
            return
        await conn.request()  # A
        await side_ready.wait()
        await b_waiting.wait()
        side["w"].write(b"!")  # wake B first...
        conn.send(ok(b"A"))    # ...then complete A, in the same select() round
        await conn.request()  # B: never answered
        await read_to_eof(conn.reader)

    srv = await raw_server(handler)
    pool = pools(srv.url, idle_timeout=10)
    task_a = asyncio.create_task(pool.request("GET", "/a", timeouts=FAST))
    await srv.wait_conns(1)
    side_reader, side_writer = await connect(srv.port)
    await asyncio.wait_for(side_ready.wait(), 1)

    async def b():
        b_waiting.set()
        await side_reader.readexactly(1)
        return await pool.request("GET", "/b", timeouts=TransportTimeouts(connect=1, headers=0.2, idle=1))

    task_b = asyncio.create_task(b())
    resp_a = await asyncio.wait_for(task_a, 1)
    assert await resp_a.read() == b"A"
    with pytest.raises(UpstreamTimeout):
        await asyncio.wait_for(task_b, 1.5)
    assert all_requests(srv) == [(0, "/a"), (0, "/b")]  # B really reused A's connection
    side_writer.close()


async def test_cancel_after_head_arrived_does_not_kill_a_reused_connection(raw_server, pools, monkeypatch):
    """Request A's whole response arrives and its connection goes back to the pool; in the
    same round, before A's task runs again, A is cancelled (its client went away) and B asks
    for a connection. A's cancellation must not abort the connection it handed back: B gets it.

    The cancel and B are made in the very call that hands the connection back, so the order
    does not depend on which of two sockets the event loop happens to read first."""
    async def handler(conn):
        while (req := await conn.request()) is not None:
            await asyncio.sleep(0.02)
            conn.send(ok(req.target.encode()))

    srv = await raw_server(handler)
    pool = pools(srv.url, idle_timeout=10)
    tasks: dict[str, asyncio.Task] = {}
    hand_back = _Connection.response_done

    def response_done(conn, resp):
        hand_back(conn, resp)
        if "b" not in tasks:
            assert not tasks["a"].done()  # A's task has not run since its head arrived
            tasks["a"].cancel()
            tasks["b"] = asyncio.ensure_future(pool.request("GET", "/b", timeouts=FAST))

    monkeypatch.setattr(_Connection, "response_done", response_done)
    tasks["a"] = asyncio.create_task(pool.request("GET", "/a", timeouts=FAST))
    with pytest.raises(asyncio.CancelledError):
        await tasks["a"]
    resp_b = await asyncio.wait_for(tasks["b"], 1.5)
    assert await resp_b.read() == b"/b"
    assert all_requests(srv) == [(0, "/a"), (0, "/b")]  # the connection A handed back, never cut


async def test_idle_body_timeout(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        conn.eof = await read_to_eof(conn.reader)  # then stalls

    srv = await raw_server(handler)
    pool = pools(srv.url)
    loop = asyncio.get_running_loop()
    resp = await pool.request("GET", "/", timeouts=TransportTimeouts(connect=1, headers=1, idle=0.2))
    t0 = loop.time()
    assert await resp.read_chunk() == b"abc"
    with pytest.raises(UpstreamTimeout) as ei:
        await resp.read_chunk()
    assert 0.1 <= loop.time() - t0 < 0.8
    assert ei.value.response_started and ei.value.kind == "timeout"
    await asyncio.wait_for(srv.conns[0].closed.wait(), 1)
    assert pool.open_connections == 0


async def test_idle_timer_restarts_with_each_piece(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(6):  # 6 x 0.08 s > the 0.2 s idle timeout, but no single gap is
            await asyncio.sleep(0.08)
            conn.send(chunked(b"%d" % i)[:-5])
        conn.send(b"0\r\n\r\n")
        await conn.reader.read()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=TransportTimeouts(connect=1, headers=1, idle=0.2))
    assert await resp.read() == b"012345"


async def test_paused_silence_is_not_an_idle_timeout(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nabc")
        await conn.writer.drain()
        await asyncio.sleep(0.3)
        conn.send(b"def")
        await conn.reader.read()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=TransportTimeouts(connect=1, headers=1, idle=0.15))
    resp.pause_reading()
    await asyncio.sleep(0.45)  # paused for longer than the idle timeout
    resp.resume_reading()
    assert await resp.read() == b"abcdef"


async def test_read_resumes_a_paused_response(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\n")
        await conn.writer.drain()
        await asyncio.sleep(0.05)
        conn.send(b"abcdef")
        await conn.reader.read()

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=TransportTimeouts(connect=1, headers=1, idle=5))
    resp.pause_reading()
    assert await asyncio.wait_for(resp.read(), 1) == b"abcdef"


async def test_flow_control_after_release_does_not_touch_the_pooled_connection(http_server, pools):
    """Once a response is complete its connection is back in the pool; a late
    pause_reading() from a relay's flow listener must not freeze the next request."""
    async def handler(req, w):
        w.send(200, req.path.encode())

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}")
    resp = await pool.request("GET", "/1", timeouts=FAST)
    assert await resp.read() == b"/1"
    resp.pause_reading()  # e.g. the client socket filled up while the body was replayed
    resp2 = await pool.request("GET", "/2", timeouts=TransportTimeouts(connect=1, headers=0.5, idle=0.5))
    assert await resp2.read() == b"/2"
    resp.resume_reading()
    assert len(srv.connections) == 1


# -- closing and cancelling ----------------------------------------------------------------
async def test_close_unfinished_response_aborts_connection(raw_server, pools):
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        conn.eof = await read_to_eof(conn.reader)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    resp = await pool.request("GET", "/", timeouts=FAST)
    assert await resp.read_chunk() == b"abc"
    resp.close()
    await asyncio.wait_for(srv.conns[0].closed.wait(), 1)  # the server saw the disconnect
    assert pool.open_connections == 0 and pool.idle_connections == 0
    resp.close()  # idempotent


async def test_close_finished_response_keeps_connection_pooled(http_server, pools):
    async def handler(req, w):
        w.send(200, repr(req.peer).encode())

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}")
    resp = await pool.request("GET", "/", timeouts=FAST)
    first = await resp.read()
    resp.close()
    assert pool.idle_connections == 1 and pool.open_connections == 1
    resp2 = await pool.request("GET", "/", timeouts=FAST)
    assert await resp2.read() == first
    resp2.close()
    assert len(srv.connections) == 1


async def test_cancelling_the_request_closes_the_connection(raw_server, pools):
    got = asyncio.Event()

    async def handler(conn):
        await conn.request()
        got.set()
        conn.eof = await read_to_eof(conn.reader)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    task = asyncio.create_task(pool.request("GET", "/", timeouts=FAST))
    await asyncio.wait_for(got.wait(), 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(srv.conns[0].closed.wait(), 1)
    assert pool.open_connections == 0


async def test_pool_close_aborts_connections_and_refuses_requests(raw_server, pools):
    async def handler(conn):
        await serve_ok(conn)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    assert await (await pool.request("GET", "/1", timeouts=FAST)).read() == b"/1"
    await pool.close()
    await asyncio.wait_for(srv.conns[0].closed.wait(), 1)
    with pytest.raises(UpstreamError):
        await pool.request("GET", "/2", timeouts=FAST)


# -- request bodies --------------------------------------------------------------------------
async def test_large_request_body_arrives_intact(http_server, pools):
    async def handler(req, w):
        w.send(200, b"%d %s" % (len(req.body), hashlib.sha256(req.body).hexdigest().encode()))

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}")
    body = os.urandom(4 * 1024 * 1024)
    for _ in range(2):  # twice on one connection
        resp = await pool.request("POST", "/", body=body, timeouts=TransportTimeouts(connect=1, headers=5, idle=5))
        assert await resp.read() == b"%d %s" % (len(body), hashlib.sha256(body).hexdigest().encode())
    assert len(srv.connections) == 1


async def test_empty_post_sends_content_length_zero(raw_server, pools):
    async def handler(conn):
        await serve_ok(conn)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    assert await (await pool.request("POST", "/p", timeouts=FAST)).read() == b"/p"
    assert await (await pool.request("GET", "/g", timeouts=FAST)).read() == b"/g"
    post, get = srv.conns[0].requests
    assert post.header(b"content-length") == b"0"
    assert get.header(b"content-length") is None
    assert post.header(b"host") == f"127.0.0.1:{srv.port}".encode()


def test_pool_rejects_bad_urls():
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        with pytest.raises(ValueError):
            ConnectionPool("ftp://x")
        with pytest.raises(ValueError):
            ConnectionPool("http://")
    finally:
        asyncio.set_event_loop(None)
        loop.close()



async def test_early_header_timer_gives_way_to_the_idle_timeout(raw_server, pools):
    """The header wait (0.1 s) is pending when the head arrives; a body whose pieces
    come every 0.15 s (each gap under the 0.3 s idle timeout) must not be cut by it,
    and a later silence must still end in the idle timeout."""
    async def handler(conn):
        await conn.request()
        await asyncio.sleep(0.05)
        conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(4):
            await asyncio.sleep(0.15)
            conn.send(chunked(b"%d" % i)[:-5])
        conn.eof = await read_to_eof(conn.reader)  # then stalls

    srv = await raw_server(handler)
    pool = pools(srv.url)
    loop = asyncio.get_running_loop()
    resp = await pool.request("GET", "/", timeouts=TransportTimeouts(connect=1, headers=0.1, idle=0.3))
    got = b""
    for _ in range(4):
        got += await resp.read_chunk()
    assert got == b"0123"
    t0 = loop.time()
    with pytest.raises(UpstreamTimeout) as ei:
        await resp.read_chunk()
    assert 0.2 <= loop.time() - t0 < 1.0
    assert ei.value.response_started


async def test_reused_connection_keeps_its_own_header_deadline(raw_server, pools):
    """The first request's idle timer (0.1 s) is still pending when the connection is
    reused; when it fires it must re-aim at the second request's header deadline
    (0.6 s) rather than end a request whose answer takes 0.25 s."""
    async def handler(conn):
        req = await conn.request()
        conn.send(ok(req.target.encode()))
        req = await conn.request()
        await asyncio.sleep(0.25)
        conn.send(ok(req.target.encode()))
        await read_to_eof(conn.reader)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    t = TransportTimeouts(connect=1, headers=0.6, idle=0.1)
    assert await (await pool.request("GET", "/1", timeouts=t)).read() == b"/1"
    assert await (await pool.request("GET", "/2", timeouts=t)).read() == b"/2"
    assert len(srv.conns) == 1


async def test_bursts_reuse_the_connections_the_last_burst_opened(http_server, pools):
    """Bursts with a quiet stretch between them longer than the idle timeout, while a few
    requests go on: the idle connections are taken in turn, so the quiet stretch keeps every
    one of the burst's connections warm and each burst after the first opens none."""
    peers: set = set()  # one client port per connection opened

    async def handler(req, w):
        peers.add(req.peer)
        await asyncio.sleep(0.005)
        w.send(200, b"x")

    srv = await http_server(handler)
    pool = pools(f"http://127.0.0.1:{srv.port}", idle_timeout=1.0)
    loop = asyncio.get_running_loop()

    async def one() -> None:
        resp = await pool.request("GET", "/", timeouts=FAST)
        assert await resp.read() == b"x"

    burst = 16
    for _ in range(3):
        await asyncio.gather(*(one() for _ in range(burst)))
        quiet_until = loop.time() + 1.5  # longer than idle_timeout
        while loop.time() < quiet_until:
            await one()
            await asyncio.sleep(0.01)
    assert len(peers) == burst


async def test_a_body_all_here_is_taken_without_waiting_and_a_partial_one_is_not(raw_server, pools):
    """``Response.body()``: the whole body when it came with the head (the connection is then
    back in the pool), None while some of it is still on its way (then ``read()`` waits)."""
    async def handler(conn):
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
        await conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello")
        await asyncio.sleep(0.05)
        conn.send(b"world")
        conn.eof = await read_to_eof(conn.reader)

    srv = await raw_server(handler)
    pool = pools(srv.url)
    whole = await pool.request("GET", "/", timeouts=FAST)
    assert whole.body() == b"hello" and whole.body() == b""  # taken once
    assert pool.idle_connections == 1
    partial = await pool.request("GET", "/", timeouts=FAST)
    assert partial.body() is None
    assert await partial.read() == b"helloworld"
