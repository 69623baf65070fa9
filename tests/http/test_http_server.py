"""HttpServer and its connection protocol against raw loopback clients (the writer's
own tests are in test_response.py)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from httpkit import (
    Incomplete,
    chunked,
    connect,
    exchange,
    read_head,
    read_response,
    read_to_eof,
    request_bytes,
    wait_disconnect,
)


async def echo(req, w):
    w.send(200, json.dumps({
        "method": req.method, "path": req.path, "query": req.query, "target": req.target.decode(),
        "body": req.body.decode("latin-1"), "keep_alive": req.keep_alive,
        "x": (req.header(b"x-multi") or b"").decode(),
    }).encode())


# -- request bodies ----------------------------------------------------------------------
async def test_content_length_body_and_request_fields(http_server):
    srv = await http_server(echo)
    (resp,), r, w = await exchange(srv.port, request_bytes(
        "POST", "/v1/chat?x=1&y=2", body=b'{"a": 1}',
        headers=[("X-Multi", "a"), ("x-multi", "b")]))
    assert resp.start_line == b"HTTP/1.1 200 OK"
    assert resp.header(b"content-type") == b"application/json"
    assert resp.header(b"content-length") == str(len(resp.body)).encode()
    assert resp.header(b"date") is not None
    assert resp.header(b"connection") is None
    assert json.loads(resp.body) == {
        "method": "POST", "path": "/v1/chat", "query": "x=1&y=2", "target": "/v1/chat?x=1&y=2",
        "body": '{"a": 1}', "keep_alive": True, "x": "a, b"}
    w.close()


async def test_chunked_request_body(http_server):
    srv = await http_server(echo)
    r, w = await connect(srv.port)
    w.write(b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    for piece in (b"hel", b"lo ", b"world"):
        await asyncio.sleep(0.01)
        w.write(b"%x\r\n%b\r\n" % (len(piece), piece))
    w.write(b"0\r\n\r\n")
    resp = await asyncio.wait_for(read_response(r), 2)
    assert json.loads(resp.body)["body"] == "hello world"
    w.close()


async def test_large_body_split_across_many_writes(http_server):
    srv = await http_server(echo)
    body = b"x" * 3_000_000
    (resp,), r, w = await exchange(srv.port, request_bytes("POST", "/", body=body))
    assert len(json.loads(resp.body)["body"]) == len(body)
    w.close()


async def test_expect_100_continue(http_server):
    srv = await http_server(echo)
    r, w = await connect(srv.port)
    w.write(b"POST /e HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
    interim = await asyncio.wait_for(read_head(r), 1)  # before the body is sent
    assert interim.raw_head == b"HTTP/1.1 100 Continue\r\n\r\n"
    w.write(b"hello")
    resp = await asyncio.wait_for(read_response(r), 1)
    assert resp.status == 200 and json.loads(resp.body)["body"] == "hello"
    w.close()


async def test_expect_100_continue_with_too_large_body_gets_413_not_100(http_server):
    srv = await http_server(echo, max_body_bytes=1000)
    r, w = await connect(srv.port)
    w.write(b"POST /e HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
    resp = await asyncio.wait_for(read_response(r, interim=True), 1)
    assert resp.status == 413
    assert await wait_disconnect(r) == b""
    w.close()


# -- connection management -----------------------------------------------------------------
async def test_pipelined_requests_answered_in_order_one_at_a_time(http_server):
    active = 0
    overlap = []

    async def handler(req, w):
        nonlocal active
        active += 1
        overlap.append(active)
        await asyncio.sleep({"/a": 0.06, "/b": 0.0, "/c": 0.03}[req.path])
        active -= 1
        w.send(200, req.path.encode())

    srv = await http_server(handler)
    data = b"".join(request_bytes("GET", p) for p in ("/a", "/b", "/c"))
    resps, r, w = await exchange(srv.port, data, n=3)
    assert [x.body for x in resps] == [b"/a", b"/b", b"/c"]
    assert overlap == [1, 1, 1]
    assert len(srv.connections) == 1
    w.close()


async def test_pipelining_beyond_max_pipelined(http_server):
    async def handler(req, w):
        await asyncio.sleep(0.005)
        w.send(200, req.path.encode())

    srv = await http_server(handler, max_pipelined=2)
    paths = [f"/{i}" for i in range(12)]
    data = b"".join(request_bytes("POST", p, body=b"b" * 100) for p in paths)
    resps, r, w = await exchange(srv.port, data, n=12)
    assert [x.body.decode() for x in resps] == paths
    w.close()


async def test_keep_alive_then_connection_close(http_server):
    srv = await http_server(echo)
    r, w = await connect(srv.port)
    for i in range(3):
        w.write(request_bytes("GET", f"/{i}"))
        resp = await asyncio.wait_for(read_response(r), 1)
        assert json.loads(resp.body)["path"] == f"/{i}"
        assert resp.header(b"connection") is None
    w.write(request_bytes("GET", "/last", headers=[("Connection", "close")]))
    resp = await asyncio.wait_for(read_response(r), 1)
    assert json.loads(resp.body)["keep_alive"] is False
    assert resp.header(b"connection") == b"close"
    assert await wait_disconnect(r) == b""
    w.close()


async def test_requests_pipelined_after_connection_close_are_dropped(http_server):
    seen = []

    async def handler(req, w):
        seen.append(req.path)
        w.send(200, req.path.encode())

    srv = await http_server(handler)
    data = request_bytes("GET", "/1", headers=[("Connection", "close")]) + request_bytes("GET", "/2")
    (resp,), r, w = await exchange(srv.port, data)
    assert resp.body == b"/1"
    assert await wait_disconnect(r) == b""
    assert seen == ["/1"]
    w.close()


async def test_http_1_0(http_server):
    srv = await http_server(echo)
    (resp,), r, w = await exchange(srv.port, b"GET /old HTTP/1.0\r\n\r\n")
    assert json.loads(resp.body)["keep_alive"] is False
    assert resp.header(b"connection") == b"close"
    assert await wait_disconnect(r) == b""
    w.close()


async def test_http_1_0_keep_alive(http_server):
    srv = await http_server(echo)
    r, w = await connect(srv.port)
    for i in range(2):
        w.write(b"GET /%d HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" % i)
        resp = await asyncio.wait_for(read_response(r), 1)
        assert json.loads(resp.body)["path"] == f"/{i}"
    w.close()


async def test_http_1_0_streamed_response_is_not_chunked(http_server):
    """RFC 9112: no Transfer-Encoding to an HTTP/1.0 client; the body ends at close."""
    async def handler(req, w):
        w.start(200)
        w.write(b"data: 1\n\n")
        await asyncio.sleep(0.01)
        w.write(b"data: 2\n\n")
        w.end(b"data: [DONE]\n\n")

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(b"GET /s HTTP/1.0\r\n\r\n")
    raw = await asyncio.wait_for(read_to_eof(r), 2)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    w.close()


async def test_http_1_0_expect_gets_no_100(http_server):
    srv = await http_server(echo)
    r, w = await connect(srv.port)
    w.write(b"POST /e HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi")
    raw = await asyncio.wait_for(read_to_eof(r), 2)
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
    w.close()


async def test_idle_keep_alive_timeout_closes_the_connection(http_server):
    srv = await http_server(echo, keep_alive_timeout=0.2)
    loop = asyncio.get_running_loop()
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/"))
    await asyncio.wait_for(read_response(r), 1)
    t0 = loop.time()
    assert await wait_disconnect(r) == b""
    assert 0.15 <= loop.time() - t0 < 1.0
    # A connection that never sends anything is closed as well.
    r2, w2 = await connect(srv.port)
    assert await wait_disconnect(r2) == b""
    await asyncio.sleep(0.01)
    assert len(srv.connections) == 0
    w.close()
    w2.close()


async def test_slow_handler_is_not_cut_by_the_keep_alive_timer(http_server):
    async def handler(req, w):
        await asyncio.sleep(0.3)
        w.send(200, b"late")

    srv = await http_server(handler, keep_alive_timeout=0.1, read_timeout=0.1)
    (resp,), r, w = await exchange(srv.port, request_bytes("GET", "/"))
    assert resp.body == b"late"
    w.close()


async def test_read_timeout_answers_408(http_server):
    srv = await http_server(echo, read_timeout=0.2)
    r, w = await connect(srv.port)
    w.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
    resp = await asyncio.wait_for(read_response(r), 1)
    assert resp.status == 408
    assert json.loads(resp.body)["error"]["code"] == 408
    assert await wait_disconnect(r) == b""
    w.close()


# -- rejected requests ---------------------------------------------------------------------
def _error(resp) -> dict:
    assert resp.header(b"content-type") == b"application/json"
    assert resp.header(b"connection") == b"close"
    env = json.loads(resp.body)
    assert set(env) == {"error"} and set(env["error"]) == {"message", "type", "param", "code"}
    return env["error"]


async def test_too_many_header_bytes_431(http_server):
    srv = await http_server(echo, max_header_bytes=4096)
    headers = [(f"x-h{i}", "v" * 100) for i in range(60)]
    (resp,), r, w = await exchange(srv.port, request_bytes("GET", "/", headers=headers))
    assert resp.status == 431
    err = _error(resp)
    assert err["code"] == 431 and err["type"] == "BadRequestError"
    assert await wait_disconnect(r) == b""
    w.close()


async def test_too_long_url_431(http_server):
    srv = await http_server(echo, max_header_bytes=4096)
    (resp,), r, w = await exchange(srv.port, request_bytes("GET", "/" + "a" * 10_000))
    assert resp.status == 431
    assert await wait_disconnect(r) == b""
    w.close()


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "many-writes"])
async def test_one_endless_header_431(http_server, split):
    """A single header value that never ends must be cut at the limit, not buffered
    until the read timeout."""
    srv = await http_server(echo, max_header_bytes=4096, read_timeout=5)
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.setblocking(False)
    try:
        await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: ")
        try:
            if split:
                for _ in range(20):
                    await asyncio.sleep(0.005)
                    await loop.sock_sendall(sock, b"a" * 1000)
            else:
                await loop.sock_sendall(sock, b"a" * 100_000)
        except ConnectionError:
            pass  # the server gave up on us while we were still sending: fine
        raw = b""
        while b"\r\n\r\n" not in raw:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 1)
            assert data, f"closed without an answer: {raw!r}"
            raw += data
        assert raw.startswith(b"HTTP/1.1 431 ")
    finally:
        sock.close()


async def test_large_but_allowed_headers_pass(http_server):
    srv = await http_server(echo, max_header_bytes=8192)
    headers = [(f"x-h{i}", "v" * 100) for i in range(50)]  # ~5.5 KB
    r, w = await connect(srv.port)
    # Two pipelined requests in one write, then one split at an awkward place.
    data = request_bytes("GET", "/1", headers=headers) + request_bytes("GET", "/2", headers=headers)
    w.write(data)
    third = request_bytes("POST", "/3", headers=headers, body=b"z" * 50_000)
    w.write(third[:3000])
    await asyncio.sleep(0.02)
    w.write(third[3000:])
    resps = [await asyncio.wait_for(read_response(r), 1) for _ in range(3)]
    assert [json.loads(x.body)["path"] for x in resps] == ["/1", "/2", "/3"]
    w.close()


async def test_content_length_over_limit_413(http_server):
    srv = await http_server(echo, max_body_bytes=1000)
    r, w = await connect(srv.port)
    w.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1001\r\n\r\n")  # body never sent
    resp = await asyncio.wait_for(read_response(r), 1)
    assert resp.status == 413
    assert _error(resp)["code"] == 413
    assert await wait_disconnect(r) == b""
    w.close()


async def test_chunked_body_over_limit_413(http_server):
    srv = await http_server(echo, max_body_bytes=1000)
    r, w = await connect(srv.port)
    w.write(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    w.write(chunked(b"a" * 600)[:-5])
    w.write(chunked(b"b" * 600)[:-5])
    resp = await asyncio.wait_for(read_response(r), 1)
    assert resp.status == 413
    w.close()


async def test_body_exactly_at_limit_is_accepted(http_server):
    srv = await http_server(echo, max_body_bytes=1000)
    (resp,), r, w = await exchange(srv.port, request_bytes("POST", "/", body=b"a" * 1000))
    assert resp.status == 200
    w.close()


@pytest.mark.parametrize("data", [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
], ids=["garbage", "bad-length", "two-lengths", "bad-header", "bad-chunk"])
async def test_malformed_request_400(http_server, data):
    calls = []

    async def handler(req, w):
        calls.append(req)
        w.send(200)

    srv = await http_server(handler)
    (resp,), r, w = await exchange(srv.port, data)
    assert resp.status == 400
    err = _error(resp)
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert await wait_disconnect(r) == b""
    assert calls == []
    w.close()


async def test_h2c_upgrade_request_is_answered_over_http_1_1(http_server):
    """curl --http2 and Java's HttpClient ask for an h2c upgrade on http:// URLs; the
    server may ignore the Upgrade header (RFC 9110 7.8) but must still answer."""
    srv = await http_server(echo)
    up = [("Connection", "Upgrade, HTTP2-Settings"), ("Upgrade", "h2c"),
          ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA")]
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/u", headers=up) + request_bytes("GET", "/after"))
    resp = await asyncio.wait_for(read_response(r), 1)
    assert resp.status == 200 and json.loads(resp.body)["path"] == "/u"
    resp = await asyncio.wait_for(read_response(r), 1)
    assert json.loads(resp.body)["path"] == "/after"
    w.write(request_bytes("POST", "/p", headers=up, body=b"payload"))
    resp = await asyncio.wait_for(read_response(r), 1)
    assert json.loads(resp.body)["body"] == "payload"
    w.close()


async def test_connect_method_is_rejected(http_server):
    srv = await http_server(echo)
    (resp,), r, w = await exchange(srv.port, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com\r\n\r\n")
    assert resp.status == 400
    w.close()


# -- handler outcomes ----------------------------------------------------------------------
async def test_handler_exception_is_500_and_close(http_server):
    async def handler(req, w):
        raise RuntimeError("boom")

    srv = await http_server(handler)
    (resp,), r, w = await exchange(srv.port, request_bytes("GET", "/"))
    assert resp.status == 500
    assert json.loads(resp.body) == {"error": {"message": "internal proxy error", "type": "InternalServerError",
                                               "param": None, "code": 500}}
    assert resp.header(b"connection") == b"close"
    assert await wait_disconnect(r) == b""
    w.close()


async def test_handler_without_response_is_500_and_keeps_alive(http_server):
    async def handler(req, w):
        if req.path == "/ok":
            w.send(200, b"fine")

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/none"))
    resp = await asyncio.wait_for(read_response(r), 1)
    assert resp.status == 500
    assert json.loads(resp.body)["error"]["type"] == "InternalServerError"
    w.write(request_bytes("GET", "/ok"))
    resp = await asyncio.wait_for(read_response(r), 1)
    assert resp.body == b"fine"
    w.close()


@pytest.mark.parametrize("how", ["return", "raise"])
async def test_unfinished_chunked_response_aborts_the_connection(http_server, how):
    async def handler(req, w):
        w.start(200)
        w.write(b"data: partial\n\n")
        await asyncio.sleep(0.01)
        if how == "raise":
            raise RuntimeError("upstream died")

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/"))
    with pytest.raises(Incomplete) as ei:
        await asyncio.wait_for(read_response(r), 1)
    assert ei.value.partial == b"data: partial\n\n"
    w.close()


# -- disconnects and back-pressure ---------------------------------------------------------
async def test_client_disconnect_mid_response_cancels_the_handler(http_server):
    cancelled = asyncio.Event()
    wrote = asyncio.Event()

    async def handler(req, w):
        w.start(200)
        w.write(b"data: 1\n\n")
        wrote.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/"))
    await asyncio.wait_for(wrote.wait(), 1)
    await asyncio.wait_for(read_head(r), 1)
    w.close()
    await asyncio.wait_for(cancelled.wait(), 1)
    await asyncio.sleep(0.01)
    assert len(srv.connections) == 0


async def test_client_disconnect_before_response_cancels_the_handler(http_server):
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def handler(req, w):
        started.set()
        try:
            await asyncio.sleep(10)  # e.g. waiting for prefill
        except asyncio.CancelledError:
            cancelled.set()
            raise

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("POST", "/", body=b"{}"))
    await asyncio.wait_for(started.wait(), 1)
    w.transport.abort()
    await asyncio.wait_for(cancelled.wait(), 1)


async def test_server_close_cancels_handlers_and_drops_clients(http_server):
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def handler(req, w):
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/"))
    await asyncio.wait_for(started.wait(), 1)
    await srv.close()
    await asyncio.wait_for(cancelled.wait(), 1)
    assert await wait_disconnect(r) == b""
    w.close()


async def test_half_close_is_treated_as_gone(http_server):
    cancelled = asyncio.Event()

    async def handler(req, w):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    srv = await http_server(handler)
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/"))
    w.write_eof()
    await asyncio.wait_for(cancelled.wait(), 1)
    w.close()


async def test_413_reaches_a_client_that_is_still_uploading(http_server):
    """A client sends its whole (too large) body without waiting: it must still read the
    413, not a connection reset caused by closing on unread data."""
    srv = await http_server(echo, max_body_bytes=1000)
    for _ in range(3):
        r, w = await connect(srv.port)
        w.write(request_bytes("POST", "/", body=b"x" * 2_000_000))
        try:
            await w.drain()
        except ConnectionError:
            pass
        resp = await asyncio.wait_for(read_response(r), 2)
        assert resp.status == 413
        w.close()


async def test_keep_alive_deadline_moves_with_each_response(http_server):
    """The timer is moved lazily: the first response's keep-alive deadline is still
    pending when the second response ends; when it fires it must re-aim at the second
    deadline, neither closing the connection early nor leaving it open for good."""
    srv = await http_server(echo, keep_alive_timeout=0.3)
    loop = asyncio.get_running_loop()
    r, w = await connect(srv.port)
    w.write(request_bytes("GET", "/1"))
    await asyncio.wait_for(read_response(r), 1)
    await asyncio.sleep(0.2)  # 0.1 s before the first deadline
    w.write(request_bytes("GET", "/2"))
    await asyncio.wait_for(read_response(r), 1)
    t0 = loop.time()
    assert await wait_disconnect(r) == b""
    assert 0.25 <= loop.time() - t0 < 1.0  # the second response's keep-alive, not the first's
    w.close()
