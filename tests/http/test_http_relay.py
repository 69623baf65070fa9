"""End to end: client -> HttpServer (proxy) -> ConnectionPool -> HttpServer (upstream),
with the upstream's SSE chunks relayed from the protocol callback."""

from __future__ import annotations

import asyncio
import hashlib
import socket

import pytest
from httpkit import Incomplete, connect, read_body, read_head, read_response, request_bytes

from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.response import FlowListener
from epd_proxy.http.transport import TransportTimeouts, UpstreamError

SSE_TEXT = "".join(
    f'data: {{"id":{i},"delta":"{t}"}}\n\n'
    for i, t in enumerate(["héllo", " 世界", " 🎉🎉", " ünïcödé", " ends"])
) + "data: [DONE]\n\n"
SSE = SSE_TEXT.encode()


def split_awkwardly(data: bytes) -> list[bytes]:
    """Pieces of 1..7 bytes: many cut through the middle of a UTF-8 sequence."""
    out, i, n = [], 0, 1
    while i < len(data):
        out.append(data[i:i + n])
        i += n
        n = n % 7 + 1
    return out


class RelaySink(FlowListener):
    """What the proxy does: upstream body pieces -> client chunks; client back-pressure ->
    upstream reads paused."""

    def __init__(self, writer, resp) -> None:
        self.writer = writer
        self.resp = resp
        self.pieces = 0
        self.error: Exception | None = None
        self.pauses = 0
        self.resumes = 0

    def on_data(self, data: bytes) -> None:
        self.pieces += 1
        self.writer.write(data)

    def on_end(self) -> None:
        self.writer.end()

    def on_error(self, exc: Exception) -> None:
        self.error = exc
        self.writer.abort()

    def pause(self) -> None:
        self.pauses += 1
        self.resp.pause_reading()

    def resume(self) -> None:
        self.resumes += 1
        self.resp.resume_reading()


class Proxy:
    def __init__(self, upstream_port: int, timeouts: TransportTimeouts | None = None) -> None:
        self.pool = ConnectionPool(f"http://127.0.0.1:{upstream_port}")
        self.timeouts = timeouts or TransportTimeouts(connect=1, headers=2, idle=2)
        self.sinks: list[RelaySink] = []
        self.writers = []
        self.outcomes: list[str] = []

    async def handler(self, req, w) -> None:
        self.writers.append(w)
        resp = await self.pool.request("POST", req.path, body=req.body, timeouts=self.timeouts)
        try:
            if resp.status != 200:
                w.send(resp.status, await resp.read(), content_type=resp.content_type)
                return
            w.start(200, resp.content_type)
            sink = RelaySink(w, resp)
            self.sinks.append(sink)
            w.flow = sink
            if w.writing_paused:
                resp.pause_reading()
            resp.relay(sink)
            try:
                await resp.wait()
                self.outcomes.append("end")
            except UpstreamError as exc:
                self.outcomes.append(f"upstream {exc.kind}")
        except asyncio.CancelledError:
            self.outcomes.append("cancelled")
            raise
        finally:
            resp.close()


@pytest.fixture
async def proxy_pair(http_server):
    made = []

    async def make(upstream_handler, **kw):
        upstream = await http_server(upstream_handler)
        proxy = Proxy(upstream.port, **kw)
        made.append(proxy)
        front = await http_server(proxy.handler)
        return upstream, proxy, front

    yield make
    for p in made:
        await p.pool.close()


async def test_sse_relay_is_byte_identical_with_split_multibyte_utf8(proxy_pair):
    pieces = split_awkwardly(SSE)
    assert any(not _valid_utf8(p) for p in pieces)  # the split really cuts characters

    async def upstream(req, w):
        assert req.body == b'{"stream": true}'
        w.start(200)
        for p in pieces:
            w.write(p)
            await asyncio.sleep(0.001)  # separate segments, separate on_body calls
        w.end()

    up, proxy, front = await proxy_pair(upstream)
    r, w = await connect(front.port)
    for _ in range(2):  # twice: the upstream connection is reused for the second relay
        w.write(request_bytes("POST", "/v1/chat/completions", body=b'{"stream": true}'))
        resp = await asyncio.wait_for(read_response(r), 5)
        assert resp.status == 200
        assert resp.header(b"content-type") == b"text/event-stream"
        assert resp.body == SSE
        assert resp.body.decode() == SSE_TEXT
    assert proxy.outcomes == ["end", "end"]
    assert proxy.sinks[0].pieces > 20  # relayed piece by piece, not buffered
    assert len(up.connections) == 1
    w.close()


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode()
        return True
    except UnicodeDecodeError:
        return False


async def test_non_stream_error_passthrough(proxy_pair):
    async def upstream(req, w):
        w.send(400, b'{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}')

    up, proxy, front = await proxy_pair(upstream)
    r, w = await connect(front.port)
    w.write(request_bytes("POST", "/v1/completions", body=b"{}"))
    resp = await asyncio.wait_for(read_response(r), 2)
    assert resp.status == 400
    assert resp.body == b'{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}'
    w.close()


async def test_back_pressure_propagates_to_the_upstream(proxy_pair):
    chunk = b"data: " + b"x" * 65530 + b"\n\n"
    total_chunks = 600  # ~39 MB: far more than all the socket buffers in between
    state = {"produced": 0, "paused": False}
    h = hashlib.sha256()

    async def upstream(req, w):
        w.start(200)
        for _ in range(total_chunks):
            w.write(chunk)
            state["produced"] += len(chunk)
            if w.writing_paused:
                state["paused"] = True
                await w.drain()
        w.end()

    for _ in range(total_chunks):
        h.update(chunk)
    up, proxy, front = await proxy_pair(upstream, timeouts=TransportTimeouts(connect=1, headers=2, idle=0.2))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", front.port))
    sock.setblocking(False)
    r, w = await asyncio.open_connection(sock=sock)
    w.write(request_bytes("POST", "/", body=b"{}"))
    await asyncio.sleep(0.4)  # the client does not read; longer than the upstream idle timeout
    sink = proxy.sinks[0]
    assert sink.pauses >= 1 and sink.pauses == sink.resumes + 1
    assert state["paused"]  # the upstream server felt it
    stalled = state["produced"]
    assert stalled < total_chunks * len(chunk) // 2
    assert proxy.writers[0]._transport.get_write_buffer_size() < 1024 * 1024
    await asyncio.sleep(0.1)
    assert state["produced"] == stalled  # bounded: nothing grows while the client stalls
    # Then the client reads it all; no idle timeout fired while paused.
    head = await asyncio.wait_for(read_head(r), 2)
    assert head.status == 200
    await asyncio.wait_for(read_body(r, head), 30)
    assert hashlib.sha256(head.body).hexdigest() == h.hexdigest()
    assert proxy.outcomes == ["end"]
    # (A pause right before the end is never followed by a resume: the writer is done.)
    assert sink.pauses - sink.resumes in (0, 1)
    w.close()


async def test_client_disconnect_aborts_the_upstream(proxy_pair):
    upstream_cancelled = asyncio.Event()

    async def upstream(req, w):
        w.start(200)
        w.write(b"data: first\n\n")
        try:
            await asyncio.sleep(10)  # decode is still generating
        except asyncio.CancelledError:
            upstream_cancelled.set()
            raise

    up, proxy, front = await proxy_pair(upstream)
    r, w = await connect(front.port)
    w.write(request_bytes("POST", "/", body=b"{}"))
    await asyncio.wait_for(read_head(r), 2)
    size_line = await asyncio.wait_for(r.readuntil(b"\r\n"), 2)
    assert size_line == b"d\r\n"
    w.close()
    await asyncio.wait_for(upstream_cancelled.wait(), 2)
    assert proxy.outcomes == ["cancelled"]
    assert proxy.pool.open_connections == 0


@pytest.mark.parametrize("failure", ["reset", "idle-timeout"])
async def test_upstream_failure_mid_stream_aborts_the_client(proxy_pair, failure):
    async def upstream(req, w):
        w.start(200)
        w.write(b"data: one\n\n")
        await asyncio.sleep(0.05)
        w.write(b"data: two\n\n")
        if failure == "reset":
            await asyncio.sleep(0.05)
            w.abort()
        else:
            await asyncio.sleep(10)

    up, proxy, front = await proxy_pair(upstream, timeouts=TransportTimeouts(connect=1, headers=1, idle=0.2))
    r, w = await connect(front.port)
    w.write(request_bytes("POST", "/", body=b"{}"))
    with pytest.raises(Incomplete) as ei:
        await asyncio.wait_for(read_response(r), 2)
    assert ei.value.partial == b"data: one\n\ndata: two\n\n"
    # The sink learns why; aborting the client connection then cancels the handler task
    # (so resp.wait() never returns to it): the error must be accounted for in on_error.
    err = proxy.sinks[0].error
    assert isinstance(err, UpstreamError) and err.response_started
    assert err.kind == ("connection" if failure == "reset" else "timeout")
    assert proxy.outcomes == ["cancelled"]
    await asyncio.sleep(0.01)
    assert proxy.pool.open_connections == 0
    w.close()


async def test_relay_of_an_already_complete_response_to_a_slow_client(http_server):
    """The upstream answer is complete (and its connection pooled) before the relay starts;
    replaying it fills the client's socket, so the flow listener pauses *that response*.
    The pooled connection must not stay paused for the next request."""
    body = b"data: " + b"y" * (12 * 1024 * 1024) + b"\n\n"

    async def upstream(req, w):
        w.send(200, body if req.path == "/big" else b"data: small\n\n", content_type=b"text/event-stream")

    up = await http_server(upstream)
    pool = ConnectionPool(f"http://127.0.0.1:{up.port}")
    sinks = []

    async def proxy(req, w):
        resp = await pool.request("GET", req.path, timeouts=TransportTimeouts(connect=1, headers=0.5, idle=0.5))
        try:
            for _ in range(500):  # wait until the whole body is in (and the connection pooled)
                if resp.complete:
                    break
                await asyncio.sleep(0.01)
            assert resp.complete
            w.start(200)
            sink = RelaySink(w, resp)
            sinks.append(sink)
            w.flow = sink
            resp.relay(sink)
            await resp.wait()
        finally:
            resp.close()

    front = await http_server(proxy)
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.connect(("127.0.0.1", front.port))
        sock.setblocking(False)
        r, w = await asyncio.open_connection(sock=sock)
        w.write(request_bytes("GET", "/big"))
        for _ in range(500):  # not reading yet: the replay hits back-pressure
            if sinks and sinks[0].pauses >= 1:
                break
            await asyncio.sleep(0.01)
        assert sinks[0].pauses >= 1
        resp = await asyncio.wait_for(read_response(r), 5)
        assert resp.body == body
        w.write(request_bytes("GET", "/small"))
        resp = await asyncio.wait_for(read_response(r), 2)
        assert resp.status == 200 and resp.body == b"data: small\n\n"
        assert len(up.connections) == 1
        w.close()
    finally:
        await pool.close()
