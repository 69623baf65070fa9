"""ResponseWriter against raw loopback clients: framing, held heads, HEAD and no-body
statuses, misuse, and back-pressure."""

from __future__ import annotations

import asyncio
import socket

import pytest
from httpkit import connect, exchange, read_head, read_response, request_bytes

from epd_proxy.http.response import FlowListener


# -- framing -------------------------------------------------------------------------------
async def test_streamed_response_framing(http_server):
    async def handler(req, w):
        w.start(200, headers=[(b"x-request-id", b"42")])
        w.write(b"data: a\n\n")
        w.write(b"")  # empty writes must not end the body
        w.write("data: é\n\n".encode())
        w.end(b"data: [DONE]\n\n")

    srv = await http_server(handler)
    (resp,), r, w = await exchange(srv.port, request_bytes("GET", "/"))
    assert resp.header(b"content-type") == b"text/event-stream"
    assert resp.header(b"transfer-encoding") == b"chunked"
    assert resp.header(b"x-request-id") == b"42"
    assert resp.chunks == [b"data: a\n\n", "data: é\n\n".encode(), b"data: [DONE]\n\n"]
    w.close()


async def test_a_held_head_goes_out_with_the_first_chunk(http_server):
    go = asyncio.Event()

    async def handler(req, w):
        w.start(200, headers=[(b"x-request-id", b"7")], hold=True)
        await go.wait()
        w.write(b"data: first\n\n")
        w.end(b"data: [DONE]\n\n")

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/"))
    with pytest.raises(asyncio.TimeoutError):  # nothing at all before the first chunk
        await asyncio.wait_for(r.read(1), 0.1)
    go.set()
    resp = await asyncio.wait_for(read_response(r), 1)
    assert resp.status == 200 and resp.header(b"x-request-id") == b"7"
    assert resp.chunks == [b"data: first\n\n", b"data: [DONE]\n\n"]
    w.close()


@pytest.mark.parametrize("how", ["flush", "end", "end-data", "head", "http1.0"])
async def test_a_held_head_is_never_lost(http_server, how):
    go = asyncio.Event()

    async def handler(req, w):
        w.start(200, hold=True)
        if how == "flush":
            w.flush()
            await go.wait()
            w.end(b"x")
        elif how == "end":
            w.end()
        elif how == "head":
            w.write(b"ignored")
            w.end()
        else:
            w.end(b"last")

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    method = "HEAD" if how == "head" else "GET"
    w.write(request_bytes(method, "/", version="HTTP/1.0" if how == "http1.0" else "HTTP/1.1"))
    if how == "flush":
        head = await asyncio.wait_for(read_head(r), 1)  # before the handler goes on
        assert head.status == 200
        go.set()
        await asyncio.sleep(0)
        assert (await asyncio.wait_for(r.readuntil(b"0\r\n\r\n"), 1)) == b"1\r\nx\r\n0\r\n\r\n"
    else:
        resp = await asyncio.wait_for(read_response(r, head=how == "head"), 1)
        assert resp.status == 200
        assert resp.body == {"end": b"", "head": b"", "end-data": b"last", "http1.0": b"last"}[how]
    w.close()


async def test_write_after_end_is_ignored(http_server):
    writers = []

    async def handler(req, w):
        writers.append(w)
        w.start(200)
        w.write(b"x")
        w.end()
        w.write(b"late data")  # e.g. a relay's straggler after the response was ended
        w.end(b"more")

    srv = await http_server(handler)
    data = request_bytes("GET", "/1") + request_bytes("GET", "/2")
    resps, r, w = await exchange(srv.port, data, n=2)
    assert [x.body for x in resps] == [b"x", b"x"]
    assert writers[0].bytes_sent == 1
    w.close()


async def test_double_start_or_send_raises(http_server):
    errors = []

    async def handler(req, w):
        w.send(200, b"a")
        for call in (lambda: w.send(200, b"b"), lambda: w.start(200)):
            try:
                call()
            except RuntimeError as exc:
                errors.append(str(exc))

    srv = await http_server(handler)
    (resp,), r, w = await exchange(srv.port, request_bytes("GET", "/"))
    assert resp.body == b"a"
    assert errors == ["response already started"] * 2
    w.close()


@pytest.mark.parametrize("status", [204, 304])
async def test_no_body_statuses(http_server, status):
    async def handler(req, w):
        w.send(status, b"ignored")

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/") + request_bytes("GET", "/"))
    for _ in range(2):
        resp = await asyncio.wait_for(read_response(r), 1)
        assert resp.status == status
        assert resp.header(b"content-length") is None
        assert resp.body == b""
    w.close()


async def test_head_send(http_server):
    async def handler(req, w):
        w.send(200, b"0123456789")

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("HEAD", "/") + request_bytes("GET", "/"))
    head = await asyncio.wait_for(read_response(r, head=True), 1)
    assert head.header(b"content-length") == b"10" and head.body == b""
    resp = await asyncio.wait_for(read_response(r), 1)
    assert resp.body == b"0123456789"
    w.close()


async def test_head_streamed_response_has_no_body(http_server):
    async def handler(req, w):
        w.start(200)
        w.write(b"data: x\n\n")
        w.end(b"data: [DONE]\n\n")

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("HEAD", "/") + request_bytes("GET", "/"))
    head = await asyncio.wait_for(read_response(r, head=True), 1)
    assert head.status == 200
    resp = await asyncio.wait_for(read_response(r), 1)  # parsed in sync: no stray body
    assert resp.status == 200 and resp.body == b"data: x\n\ndata: [DONE]\n\n"
    w.close()


# -- back-pressure -------------------------------------------------------------------------
class CountingFlow(FlowListener):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause(self) -> None:
        self.calls.append("pause")

    def resume(self) -> None:
        self.calls.append("resume")


async def test_stalled_client_back_pressure(http_server):
    """A client that stops reading: writing_paused turns on, drain() blocks, the flow
    listener is told, and a producer that respects it stops producing."""
    chunk = b"z" * 65536
    total = 32 * 1024 * 1024
    state = {"produced": 0, "draining": False}
    flow = CountingFlow()
    writers = []

    async def handler(req, w):
        writers.append(w)
        w.flow = flow
        w.start(200, b"application/octet-stream")
        while state["produced"] < total:
            w.write(chunk)
            state["produced"] += len(chunk)
            if w.writing_paused:
                state["draining"] = True
                await w.drain()
                state["draining"] = False
        w.end()

    srv = await http_server(handler)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", srv.port))
    sock.setblocking(False)
    r, w = await asyncio.open_connection(sock=sock)
    w.write(request_bytes("GET", "/"))
    await asyncio.sleep(0.3)  # the client reads nothing
    assert writers and writers[0].writing_paused
    assert state["draining"]
    assert flow.calls == ["pause"]
    stalled_at = state["produced"]
    assert stalled_at < total // 2  # bounded by socket buffers, not by the producer
    transport = writers[0]._transport
    assert transport.get_write_buffer_size() <= 64 * 1024 + len(chunk) + 64
    await asyncio.sleep(0.1)
    assert state["produced"] == stalled_at  # still blocked
    # Now read everything: the producer resumes and the body is complete and exact.
    resp = await asyncio.wait_for(read_response(r), 20)
    assert len(resp.body) == total and resp.body.count(b"z") == total
    assert flow.calls[:2] == ["pause", "resume"]
    assert flow.calls.count("pause") == flow.calls.count("resume")
    w.close()


async def test_drain_returns_at_once_when_not_paused(http_server):
    results = []
    gone = asyncio.Event()

    async def handler(req, w):
        w.start(200)
        w.write(b"x")
        await asyncio.wait_for(w.drain(), 0.5)
        results.append("not paused")
        await gone.wait()
        w.write(b"y" * 100)  # after the client left: silently dropped
        await asyncio.wait_for(w.drain(), 0.5)
        results.append(("gone", w.disconnected))

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/"))
    await asyncio.wait_for(read_head(r), 1)
    await asyncio.sleep(0.02)
    assert results == ["not paused"]
    w.close()
    await asyncio.sleep(0.05)
    # The handler was cancelled by the disconnect (so it never reached the second drain).
    assert results == ["not paused"]
    gone.set()
