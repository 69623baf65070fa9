"""The front door under hostile input: pipelined Upgrades, trailers, strict request
lines, the body budget, the connection cap and slow clients (raw loopback clients)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import pytest
from httpkit import connect, read_response, read_to_eof, request_bytes, wait_disconnect


async def echo(req, w):
    w.send(200, json.dumps({
        "path": req.path, "body": req.body.decode("latin-1"),
        "headers": {k.decode(): v.decode("latin-1") for k, v in req.headers.items()},
    }).encode())


def _error(resp) -> dict:
    assert resp.header(b"content-type") == b"application/json"
    env = json.loads(resp.body)
    assert set(env) == {"error"} and set(env["error"]) == {"message", "type", "param", "code"}
    return env["error"]


async def wait_until(predicate, timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- pipelined Upgrade requests ----------------------------------------------------------
UPGRADE = [("Connection", "Upgrade, HTTP2-Settings"), ("Upgrade", "h2c"),
           ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA")]


async def test_many_pipelined_upgrade_requests_are_all_answered(http_server):
    """600 pipelined Upgrade requests used to recurse (data_received ↔ restart) until
    RecursionError, leaving the socket open for good."""
    srv = await http_server(echo)
    n = 600
    r, w = await connect(srv.port)
    w.write(b"".join(request_bytes("GET", f"/{i}", headers=UPGRADE) for i in range(n)))
    paths = [json.loads((await asyncio.wait_for(read_response(r), 5)).body)["path"] for _ in range(n)]
    assert paths == [f"/{i}" for i in range(n)]
    w.close()
    await wait_until(lambda: not srv.connections)


async def test_pipelined_work_per_read_is_bounded(http_server):
    """A read full of pipelined requests is not all parsed at once: once max_pipelined
    wait, the rest waits unparsed (and reading pauses) until the queue drains."""
    release = asyncio.Event()
    seen = []

    async def handler(req, w):
        seen.append(req.path)
        await release.wait()
        w.send(200, req.path.encode())

    srv = await http_server(handler, max_pipelined=4)
    n = 400
    r, w = await connect(srv.port)
    w.write(b"".join(request_bytes("GET", f"/{i}") for i in range(n)))
    await wait_until(lambda: seen)
    await asyncio.sleep(0.05)
    (conn,) = srv.connections
    assert len(conn._queue) < 4 + 8192 // 30  # max_pipelined plus at most one parse slice
    release.set()
    bodies = [(await asyncio.wait_for(read_response(r), 5)).body for _ in range(n)]
    assert bodies == [f"/{i}".encode() for i in range(n)]
    w.close()


async def test_an_unexpected_error_while_parsing_closes_the_connection_with_one_short_log(http_server, caplog):
    srv = await http_server(echo)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/1"))
    await asyncio.wait_for(read_response(r), 2)
    (conn,) = srv.connections

    class Broken:  # a parser that fails in a way no rule foresaw
        def feed_data(self, data):
            raise RecursionError("maximum recursion depth exceeded " + "x" * 100_000)

    conn._parser = Broken()
    with caplog.at_level(logging.WARNING, logger="epd_proxy.http"):
        w.write(request_bytes("GET", "/2"))
        await wait_disconnect(r)
    await wait_until(lambda: not srv.connections)
    records = [rec for rec in caplog.records if rec.name == "epd_proxy.http"]
    assert len(records) == 1 and records[0].exc_info is None
    assert "RecursionError" in records[0].getMessage() and len(records[0].getMessage()) < 400
    w.close()


async def test_a_bad_pipelined_request_does_not_cut_the_response_before_it(http_server):
    async def handler(req, w):
        await asyncio.sleep(0.05)
        w.send(200, req.path.encode())

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/1") + request_bytes("GET", "/2") + b"GARBAGE\r\n\r\n")
    assert (await asyncio.wait_for(read_response(r), 2)).body == b"/1"
    assert (await asyncio.wait_for(read_response(r), 2)).body == b"/2"
    resp = await asyncio.wait_for(read_response(r), 2)
    assert resp.status == 400 and _error(resp)["code"] == 400
    assert await wait_disconnect(r) == b""
    w.close()


async def test_a_slow_head_pipelined_behind_a_request_still_times_out(http_server):
    async def handler(req, w):
        await asyncio.sleep(0.05)
        w.send(200, b"ok")

    srv = await http_server(handler, header_timeout=0.2, keep_alive_timeout=30)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/1") + b"GET /2 HTTP/1.1\r\nHost: t\r\n")  # the second never ends
    assert (await asyncio.wait_for(read_response(r), 2)).body == b"ok"
    resp = await asyncio.wait_for(read_response(r), 2)
    assert resp.status == 408
    w.close()


# -- chunked trailers ------------------------------------------------------------------------
async def test_trailer_fields_never_reach_the_request_headers(http_server):
    srv = await http_server(echo)
    r, w = await connect(srv.port)
    w.write(b"POST /t HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Request-Id: mine\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
            b"X-Request-Id: evil\r\nTraceparent: 00-evil\r\nContent-Type: text/evil\r\n\r\n")
    resp = await asyncio.wait_for(read_response(r), 2)
    got = json.loads(resp.body)
    assert got["body"] == "{}"
    assert got["headers"]["x-request-id"] == "mine"
    assert got["headers"]["content-type"] == "application/json"
    assert "traceparent" not in got["headers"]
    w.close()


@pytest.mark.parametrize("shape", ["one-endless-line", "many-lines"])
async def test_trailers_are_bounded_like_headers(http_server, shape):
    """An unterminated trailer used to be buffered without limit (and quadratically)."""
    srv = await http_server(echo, max_header_bytes=4096, read_timeout=30)
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.setblocking(False)
    try:
        await loop.sock_sendall(sock, b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                                      b"3\r\nabc\r\n0\r\n")
        piece = b"a" * 1000 if shape == "one-endless-line" else b"X-T: aaaaaaaaaaaaaaaaaaaa\r\n" * 40
        try:
            await loop.sock_sendall(sock, b"X-Long: " if shape == "one-endless-line" else b"")
            for _ in range(200):
                await asyncio.sleep(0.002)
                await loop.sock_sendall(sock, piece)
        except ConnectionError:
            pass  # cut off while still sending: fine
        raw = b""
        while b"\r\n\r\n" not in raw:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 2)
            assert data, f"closed without an answer: {raw!r}"
            raw += data
        assert raw.startswith(b"HTTP/1.1 431 ")
    finally:
        sock.close()


# -- strict request lines (RFC 9112) ----------------------------------------------------------
@pytest.mark.parametrize("data", [
    b"GET / HTTP/2.0\r\nHost: t\r\n\r\n",
    b"GET / HTTP/0.9\r\nHost: t\r\n\r\n",
    b"GET  / HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET /  HTTP/1.1\r\nHost: t\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"GET / HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n",
], ids=["http2.0", "http0.9", "two-spaces-before-target", "two-spaces-after-target", "no-host",
        "two-hosts", "two-hosts-1.0"])
async def test_lenient_request_lines_get_400(http_server, data):
    calls = []

    async def handler(req, w):
        calls.append(req)
        w.send(200)

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(data)
    resp = await asyncio.wait_for(read_response(r), 2)
    assert resp.status == 400
    assert _error(resp)["code"] == 400
    assert resp.header(b"connection") == b"close"
    assert await wait_disconnect(r) == b""
    assert calls == []
    w.close()


async def test_http_1_0_without_host_and_split_request_lines_are_accepted(http_server):
    srv = await http_server(echo)
    r, w = await connect(srv.port)
    w.write(b"GET /old HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert (await asyncio.wait_for(read_response(r), 2)).status == 200
    for piece in (b"GET /sp", b"lit HTTP/1.1\r\nHo", b"st: t\r\n\r\n"):  # a request line over reads
        w.write(piece)
        await asyncio.sleep(0.01)
    assert json.loads((await asyncio.wait_for(read_response(r), 2)).body)["path"] == "/split"
    w.close()


# -- the body budget -------------------------------------------------------------------------
async def _held_handler_server(http_server, **limits):
    release = asyncio.Event()
    started = []

    async def handler(req, w):
        started.append(len(req.body))
        await release.wait()
        w.send(200, b"%d" % len(req.body))

    srv = await http_server(handler, **limits)
    return srv, release, started


async def test_bodies_over_the_buffered_budget_get_503_then_pass_once_released(http_server):
    srv, release, started = await _held_handler_server(http_server, max_buffered_bytes=1_000_000)
    r1, w1 = await connect(srv.port)
    w1.write(request_bytes("POST", "/", body=b"a" * 600_000))
    await wait_until(lambda: started)
    assert srv.budget.used == 600_000
    # A Content-Length that does not fit: refused before the body is read.
    r2, w2 = await connect(srv.port)
    w2.write(request_bytes("POST", "/", body=b"b" * 600_000))
    resp = await asyncio.wait_for(read_response(r2), 2)
    assert resp.status == 503 and resp.header(b"retry-after") == b"1"
    assert _error(resp)["code"] == 503
    # A chunked body is charged as it arrives.
    r3, w3 = await connect(srv.port)
    w3.write(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(6):
        w3.write(b"%x\r\n%b\r\n" % (100_000, b"c" * 100_000))
    resp = await asyncio.wait_for(read_response(r3), 2)
    assert resp.status == 503 and _error(resp)["code"] == 503
    await wait_until(lambda: srv.budget.used == 600_000)
    release.set()
    assert (await asyncio.wait_for(read_response(r1), 2)).body == b"600000"
    assert srv.budget.used == 0
    r4, w4 = await connect(srv.port)
    w4.write(request_bytes("POST", "/", body=b"d" * 900_000))
    assert (await asyncio.wait_for(read_response(r4), 2)).body == b"900000"
    for w in (w1, w2, w3, w4):
        w.close()


async def test_a_client_leaving_mid_body_releases_its_budget(http_server):
    srv, release, started = await _held_handler_server(http_server, max_buffered_bytes=10_000_000)
    r, w = await connect(srv.port)
    w.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5000000\r\n\r\n" + b"x" * 100_000)
    await wait_until(lambda: srv.budget.used == 5_000_000)
    w.close()
    await wait_until(lambda: srv.budget.used == 0)
    # And one whose handler is running, with pipelined bodies queued behind it.
    r, w = await connect(srv.port)
    w.write(request_bytes("POST", "/1", body=b"a" * 1000) + request_bytes("POST", "/2", body=b"b" * 2000))
    await wait_until(lambda: started and srv.budget.used == 3000)
    w.close()
    await wait_until(lambda: srv.budget.used == 0)
    release.set()


async def test_a_rejected_upload_still_reads_its_answer(http_server):
    """Over the budget mid-upload: the client, still sending, gets the 503 (the rest of
    its body is read and dropped), not a reset."""
    srv, release, started = await _held_handler_server(http_server, max_buffered_bytes=1_000_000)
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.setblocking(False)
    try:
        await loop.sock_sendall(sock, b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(40):
            await loop.sock_sendall(sock, b"%x\r\n%b\r\n" % (100_000, b"c" * 100_000))
        raw = await asyncio.wait_for(_recv_all(loop, sock), 5)
        assert raw.startswith(b"HTTP/1.1 503 ")
    finally:
        sock.close()
    release.set()


async def _recv_all(loop, sock) -> bytes:
    out = b""
    while True:
        data = await loop.sock_recv(sock, 65536)
        if not data:
            return out
        out += data


# -- the connection cap --------------------------------------------------------------------------
async def test_at_the_cap_idle_keep_alive_connections_make_room(http_server):
    srv = await http_server(echo, max_connections=4)
    idle = []
    for i in range(4):
        r, w = await connect(srv.port)
        w.write(request_bytes("GET", f"/{i}"))
        await asyncio.wait_for(read_response(r), 2)
        idle.append((r, w))
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/new"))
    assert json.loads((await asyncio.wait_for(read_response(r), 2)).body)["path"] == "/new"
    closed = 0
    for ir, iw in idle:
        try:
            if await asyncio.wait_for(ir.read(1), 0.2) == b"":
                closed += 1
        except (asyncio.TimeoutError, ConnectionError):
            pass
        iw.close()
    assert closed >= 1
    assert srv.refused == 0
    w.close()


async def test_at_the_cap_connections_that_were_served_go_before_fresh_ones(http_server):
    srv = await http_server(echo, max_connections=3)
    fresh_r, fresh_w = await connect(srv.port)  # connected, has not sent its request yet
    await wait_until(lambda: len(srv.connections) == 1)
    served = []
    for i in range(2):
        r, w = await connect(srv.port)
        w.write(request_bytes("GET", f"/{i}"))
        await asyncio.wait_for(read_response(r), 2)
        served.append((r, w))
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/new"))
    assert (await asyncio.wait_for(read_response(r), 2)).status == 200
    fresh_w.write(request_bytes("GET", "/fresh"))
    assert json.loads((await asyncio.wait_for(read_response(fresh_r), 2)).body)["path"] == "/fresh"
    for _, sw in served:
        sw.close()
    fresh_w.close()
    w.close()


async def test_beyond_the_cap_new_connections_are_refused_with_503(http_server):
    release = asyncio.Event()

    async def handler(req, w):
        await release.wait()
        w.send(200, b"ok")

    srv = await http_server(handler, max_connections=3)
    busy = []
    for i in range(3):
        r, w = await connect(srv.port)
        w.write(request_bytes("GET", f"/{i}"))
        busy.append((r, w))
    await wait_until(lambda: len(srv.connections) == 3 and all(c._task for c in srv.connections))
    r, w = await connect(srv.port)
    raw = await asyncio.wait_for(read_to_eof(r), 2)
    assert raw.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1\r\n" in raw
    env = json.loads(raw.partition(b"\r\n\r\n")[2])
    assert env["error"]["code"] == 503
    assert srv.refused == 1 and len(srv.connections) == 3
    w.close()
    release.set()
    for br, bw in busy:
        assert (await asyncio.wait_for(read_response(br), 2)).body == b"ok"
        bw.close()


# -- slow clients --------------------------------------------------------------------------------
async def trickle(port: int, first: bytes, piece: bytes, *, interval: float, limit: int) -> tuple[bytes, int]:
    """Send ``first``, then ``piece`` every ``interval`` until the server answers or
    closes (or ``limit`` pieces went out). Returns what arrived and the pieces sent."""
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    got, sent = b"", 0
    try:
        await loop.sock_sendall(sock, first)
        while sent < limit:
            await asyncio.sleep(interval)
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                data = None
            except ConnectionError:
                break
            if data is not None:  # an answer, or the close
                got += data
                break
            try:
                sock.send(piece)
            except (BlockingIOError, ConnectionError):
                break
            sent += 1
        while True:
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 3)
            except ConnectionError:
                break
            if not data:
                break
            got += data
    finally:
        sock.close()
    return got, sent


async def test_header_and_body_timeouts_are_separate(http_server):
    srv = await http_server(echo, header_timeout=0.2, body_timeout=5.0)
    # A head trickled for longer than the header timeout: 408.
    got, sent = await trickle(srv.port, b"POST / HTTP/1.1\r\nHost: t\r\n", b"X-A: b\r\n", interval=0.02, limit=200)
    assert got.startswith(b"HTTP/1.1 408 ") and sent < 200
    # A body that takes longer than the header timeout (but not the body timeout): fine.
    r, w = await connect(srv.port)
    w.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n")
    for _ in range(10):
        await asyncio.sleep(0.04)
        w.write(b"x")
    assert json.loads((await asyncio.wait_for(read_response(r), 2)).body)["body"] == "x" * 10
    w.close()


async def test_body_timeout_answers_408(http_server):
    srv = await http_server(echo, header_timeout=5.0, body_timeout=0.2)
    r, w = await connect(srv.port)
    w.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
    resp = await asyncio.wait_for(read_response(r), 2)
    assert resp.status == 408
    assert await wait_disconnect(r) == b""
    w.close()


async def test_slowloris_clients_are_cut_while_normal_requests_flow(http_server):
    """200 clients trickling headers get 408 and are closed by the header timeout;
    requests from normal clients meanwhile all succeed."""
    srv = await http_server(echo, header_timeout=0.3, keep_alive_timeout=5.0)
    n_slow, limit = 200, 500

    async def normal(i):
        r, w = await connect(srv.port)
        try:
            w.write(request_bytes("POST", f"/n{i}", body=b"{}"))
            return (await asyncio.wait_for(read_response(r), 2)).status
        finally:
            w.close()

    slow = [asyncio.create_task(trickle(srv.port, b"GET / HTTP/1.1\r\nHost: t\r\n", b"X-a: y\r\n",
                                        interval=0.03, limit=limit)) for _ in range(n_slow)]
    # Most of them open at once (the header timeout cuts the first after 0.3 s, so on a slow
    # machine all 200 may never be open together), then the normal requests go.
    await wait_until(lambda: len(srv.connections) >= n_slow // 2, 5)
    statuses = []
    for i in range(20):
        statuses.append(await normal(i))
        await asyncio.sleep(0.01)
    results = await asyncio.wait_for(asyncio.gather(*slow), 15)
    assert statuses == [200] * 20
    assert all(sent < limit for _, sent in results)  # every slow client was cut off mid-head
    assert sum(got.startswith(b"HTTP/1.1 408 ") for got, _ in results) >= n_slow * 0.9
    await wait_until(lambda: not srv.connections, 3)


async def test_a_fresh_silent_connection_is_closed_by_the_header_timeout(http_server):
    srv = await http_server(echo, header_timeout=0.2, keep_alive_timeout=30)
    r, w = await connect(srv.port)
    assert await wait_disconnect(r, 3) == b""
    w.close()

