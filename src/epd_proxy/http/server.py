"""A small HTTP/1.1 server at the asyncio protocol level.

Why not a framework: the proxy's cost per streamed request is dominated by
per-chunk ``await``s and per-request framework set-up (see
docs/architecture.md for the measurements). Here a response chunk is one
``transport.write`` from whatever callback produced it, and back-pressure is
the transport's own pause/resume signal.

One handler task runs per request. If the client goes away, that task is
cancelled, so every ``finally`` in the request's path closes its upstream
connections: that is how an abort reaches vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
from email.utils import formatdate
from typing import Awaitable, Callable

import httptools

from ..errors import ProxyError
from .timers import aim

log = logging.getLogger("epd_proxy.http")

Headers = list[tuple[bytes, bytes]]
Handler = Callable[["Request", "ResponseWriter"], Awaitable[None]]

_REASONS = {
    100: b"Continue", 200: b"OK", 201: b"Created", 202: b"Accepted", 204: b"No Content",
    400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden", 404: b"Not Found",
    405: b"Method Not Allowed", 408: b"Request Timeout", 409: b"Conflict",
    413: b"Payload Too Large", 415: b"Unsupported Media Type", 422: b"Unprocessable Entity",
    429: b"Too Many Requests", 431: b"Request Header Fields Too Large",
    500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable",
    504: b"Gateway Timeout",
}
_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Status"))
        _STATUS_LINES[status] = line
    return line


class _DateCache:
    """The ``Date`` header, formatted at most once a second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def get(self) -> bytes:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._value = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._value


_date = _DateCache()


class Request:
    """One parsed request; the body is fully buffered before the handler runs."""

    __slots__ = ("method", "target", "path", "query", "headers", "body", "keep_alive", "peer",
                 "http_version")

    def __init__(self, method: str, target: bytes, headers: dict[bytes, bytes], body: bytes,
                 keep_alive: bool, peer, http_version: str = "1.1") -> None:
        self.method = method
        self.target = target
        path, _, query = target.partition(b"?")
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
        self.headers = headers  # lower-case names
        self.body = body
        self.keep_alive = keep_alive
        self.peer = peer
        self.http_version = http_version  # "1.1" or "1.0"

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        return self.headers.get(name, default)


class FlowListener:
    """Told when the client's socket buffer is full or drained (relay back-pressure)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class ResponseWriter:
    """Writes one response to the client connection.

    ``send`` writes a complete response. ``start`` / ``write`` / ``end`` write a
    chunked one, each call a single ``transport.write`` with no ``await``. (To an
    HTTP/1.0 client, which cannot parse chunked framing, the streamed body is sent
    as is and ends when the connection closes.)
    """

    __slots__ = ("_conn", "_transport", "started", "finished", "status", "bytes_sent",
                 "keep_alive", "flow", "_head_only", "_chunked", "_held")

    def __init__(self, conn: "HttpServerProtocol", keep_alive: bool, head_only: bool = False,
                 chunked: bool = True) -> None:
        self._conn = conn
        self._transport = conn.transport
        self.started = False
        self.finished = False
        self.status = 0
        self.bytes_sent = 0
        self.keep_alive = keep_alive
        self.flow: FlowListener | None = None
        self._head_only = head_only
        self._chunked = chunked
        self._held = b""  # a head written with the next write (start(hold=True))

    @property
    def disconnected(self) -> bool:
        return self._conn.closed

    def _head(self, status: int, headers: Headers | None, extra: bytes) -> bytes:
        parts = [status_line(status), _date.get()]
        if headers:
            for name, value in headers:
                parts.append(name + b": " + value + b"\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(extra)
        return b"".join(parts)

    def send(self, status: int, body: bytes = b"", content_type: bytes | None = b"application/json",
             headers: Headers | None = None) -> None:
        """Write a whole response with ``Content-Length``."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = status
        extra = b""
        if content_type:
            extra = b"content-type: " + content_type + b"\r\n"
        if status >= 200 and status not in (204, 304):
            extra += b"content-length: %d\r\n" % len(body)
        else:
            body = b""
        data = self._head(status, headers, extra + b"\r\n")
        if not self._conn.closed:
            self._transport.write(data if self._head_only else data + body)
            self.bytes_sent += len(body)
        self._conn.response_finished(self)

    def start(self, status: int, content_type: bytes | None = b"text/event-stream",
              headers: Headers | None = None, *, hold: bool = False) -> None:
        """Commit the status and headers of a chunked response.

        With ``hold`` the head goes out with the first chunk (or :meth:`flush`), in
        one write: a client waiting for its first token then wakes up once, not
        twice (head, then the chunk)."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        if self._chunked:
            extra = b"transfer-encoding: chunked\r\n"
        else:
            extra = b""
            self.keep_alive = False  # the body is delimited by the close
        if content_type:
            extra = b"content-type: " + content_type + b"\r\n" + extra
        head = self._head(status, headers, extra + b"\r\n")
        if hold:
            self._held = head
        elif not self._conn.closed:
            self._transport.write(head)

    def flush(self) -> None:
        """Write a held head now (nothing else to send yet)."""
        if self._held:
            head, self._held = self._held, b""
            if not self._conn.closed:
                self._transport.write(head)

    def write(self, data: bytes) -> None:
        """Write one chunk as received; no copy beyond the framing."""
        if not data or self.finished or self._conn.closed:
            # After end() a write would land in the next response on this connection.
            return
        self.bytes_sent += len(data)
        if self._head_only:
            self.flush()
            return
        if self._chunked:
            self._transport.write(b"%b%x\r\n%b\r\n" % (self._held, len(data), data))
        else:
            self._transport.write(self._held + data if self._held else data)
        self._held = b""

    def end(self, data: bytes = b"") -> None:
        if self.finished:
            return
        self.finished = True
        if data:
            self.bytes_sent += len(data)
        held, self._held = self._held, b""
        if self._head_only:
            out = held
        elif not self._chunked:
            out = held + data
        elif data:
            out = b"%b%x\r\n%b\r\n0\r\n\r\n" % (held, len(data), data)
        else:
            out = held + b"0\r\n\r\n"
        if out and not self._conn.closed:
            self._transport.write(out)
        self._conn.response_finished(self)

    def abort(self) -> None:
        """Cut the connection: the only honest signal left once a body is under way."""
        self.finished = True
        self._held = b""
        self._conn.abort()

    @property
    def writing_paused(self) -> bool:
        return self._conn.writing_paused

    async def drain(self) -> None:
        """Wait until the client's socket buffer has room (or it is gone)."""
        await self._conn.drain()


class ServerLimits:
    """Bounds on what one client may send, and how slowly."""

    def __init__(self, *, max_header_bytes: int = 64 * 1024, max_body_bytes: int = 64 * 1024 * 1024,
                 keep_alive_timeout: float = 75.0, read_timeout: float = 60.0,
                 max_pipelined: int = 16) -> None:
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.keep_alive_timeout = keep_alive_timeout
        self.read_timeout = read_timeout
        self.max_pipelined = max_pipelined


class _ParseError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpServerProtocol(asyncio.Protocol):
    """One client connection: parse requests, run the handler, write responses in order."""

    def __init__(self, handler: Handler, limits: ServerLimits, connections: set) -> None:
        self._handler = handler
        self._limits = limits
        self._connections = connections
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.writing_paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._peer = None
        # Current message being parsed.
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._header_bytes = 0
        self._header_name = b""
        self._body: list[bytes] = []
        self._body_len = 0
        self._parsing = False
        # Requests parsed but not yet answered (pipelining), and the active handler.
        self._queue: list[Request] = []
        self._task: asyncio.Task | None = None
        self._writer: ResponseWriter | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due: float | None = None  # when the armed timeout expires (loop time)
        self._reading_paused = False
        # Bytes of a request head still in progress (httptools buffers one header's
        # name and value internally until the line ends: bound that too).
        self._in_head = False
        self._head_pending = 0
        self._chunk_fresh = False
        self._began_here = False
        self._began_at_chunk_start = False
        self._ignoring_upgrade = False
        self._done_reading = False  # a non-keep-alive request was read: ignore the rest

    # -- connection events --------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self._peer = transport.get_extra_info("peername")
        self._connections.add(self)
        self._arm_timer(self._limits.keep_alive_timeout)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._connections.discard(self)
        self._drop_timer()
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        self._drain_waiters.clear()
        if self._writer is not None and self._writer.flow is not None:
            # Let a relay stop throttling its upstream; it will notice the close.
            self._writer.flow.resume()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._queue.clear()
        # Both refer back to this protocol (the parser holds its callbacks, the task's
        # frames its handler's): let go of them so the connection is freed without the
        # cyclic collector, which the frozen-GC settings make rare.
        self._task = None
        self._parser = None

    def pause_writing(self) -> None:
        self.writing_paused = True
        w = self._writer
        if w is not None and w.flow is not None:
            w.flow.pause()

    def resume_writing(self) -> None:
        self.writing_paused = False
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        self._drain_waiters.clear()
        w = self._writer
        if w is not None and w.flow is not None:
            w.flow.resume()

    async def drain(self) -> None:
        if not self.writing_paused or self.closed:
            return
        fut = self._loop.create_future()
        self._drain_waiters.append(fut)
        await fut

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def eof_received(self):
        # A client that half-closes is treated as gone: a request in flight is
        # cancelled, which closes its upstreams.
        return False

    def data_received(self, data: bytes) -> None:
        if self._done_reading:
            return
        self._chunk_fresh = not self._parsing  # this chunk starts at a message boundary
        self._began_here = False
        try:
            self._parser.feed_data(data)
        except _ParseError as exc:
            self._reject(exc.status, str(exc))
        except httptools.HttpParserUpgrade as exc:
            if self._ignoring_upgrade:
                self._restart_without_upgrade(data[exc.args[0]:])
            else:
                self._reject(400, "protocol upgrade is not supported")
        except httptools.HttpParserCallbackError as exc:
            # httptools wraps what a callback raised; the original is the context.
            inner = exc.__context__
            if isinstance(inner, _ParseError):
                self._reject(inner.status, str(inner))
            else:
                self._reject(400, f"malformed HTTP request: {exc}")
        except httptools.HttpParserError as exc:
            if self._done_reading:
                return  # bytes after a "Connection: close" request: not a request of ours
            self._reject(400, f"malformed HTTP request: {exc}")
        else:
            if self._in_head:
                if self._began_here:
                    # Count this chunk only if it began with the message (else part of it
                    # belongs to the previous one; the next chunk will be counted).
                    self._head_pending = len(data) if self._began_at_chunk_start else 0
                else:
                    self._head_pending += len(data)
                if self._head_pending > self._limits.max_header_bytes:
                    self._reject(431, "request headers too large")

    def _restart_without_upgrade(self, rest: bytes) -> None:
        """Answer an ``Upgrade: h2c`` (or similar) request over HTTP/1.1, ignoring the
        header (RFC 9110 7.8). httptools stops at an upgrade and skips the body, so the
        head is parsed again without it by a fresh parser, followed by the rest."""
        self._ignoring_upgrade = False
        parser = self._parser
        head = [parser.get_method(), b" ", self._url, b" HTTP/", parser.get_http_version().encode(), b"\r\n"]
        for name, value in self._headers.items():
            if name != b"upgrade":
                head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        self._parser = httptools.HttpRequestParser(self)
        self._parsing = False
        self.data_received(b"".join(head) + rest)

    # -- timers -------------------------------------------------------------------
    # One timer, moved lazily (``timers``): disarming clears the deadline and leaves
    # the timer to fire into nothing or to re-aim; a keep-alive request costs no timer
    # operations at all.
    def _arm_timer(self, delay: float) -> None:
        if not delay or delay <= 0:
            self._due = None
            return
        self._due = due = self._loop.time() + delay
        self._timer = aim(self._loop, self._timer, due, self._on_timeout)

    def _disarm_timer(self) -> None:
        self._due = None

    def _drop_timer(self) -> None:
        self._due = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timeout(self) -> None:
        self._timer = None
        due = self._due
        if due is None or self.closed:
            return
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._on_timeout)
            return
        self._due = None
        if self._task is not None and not self._task.done():
            return  # a handler is running: its own timeouts govern
        if self._parsing:
            self._reject(408, "request not received in time")
        elif self.transport is not None:
            self.transport.close()

    # -- httptools callbacks ------------------------------------------------------
    def on_message_begin(self) -> None:
        self._parsing = True
        self._in_head = True
        self._began_here = True
        self._began_at_chunk_start = self._chunk_fresh
        self._chunk_fresh = False
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._body = []
        self._body_len = 0
        if self._task is None:
            self._arm_timer(self._limits.read_timeout)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > self._limits.max_header_bytes:
            raise _ParseError(431, "request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self._limits.max_header_bytes:
            raise _ParseError(431, "request headers too large")
        name = name.lower()
        if name in self._headers:
            self._headers[name] += b", " + value
        else:
            self._headers[name] = value

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._parser.should_upgrade():
            if self._parser.get_method() == b"CONNECT":
                raise _ParseError(400, "CONNECT is not supported")
            self._ignoring_upgrade = True  # see _restart_without_upgrade
            return
        cl = self._headers.get(b"content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise _ParseError(400, "invalid content-length") from None
            if n > self._limits.max_body_bytes:
                raise _ParseError(413, f"request body larger than {self._limits.max_body_bytes} bytes")
        if self._headers.get(b"expect", b"").lower() == b"100-continue" and self._task is None \
                and self._parser.get_http_version() != "1.0":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._limits.max_body_bytes:
            raise _ParseError(413, f"request body larger than {self._limits.max_body_bytes} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._parsing = False
        if self._ignoring_upgrade:
            return  # parsed again by _restart_without_upgrade
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            self._parser.get_method().decode("latin-1"),
            self._url,
            self._headers,
            body,
            self._parser.should_keep_alive(),
            self._peer,
            self._parser.get_http_version(),
        )
        self._body = []
        if not request.keep_alive:
            # Nothing after this request is read (llhttp calls it an error anyway).
            self._done_reading = True
        if self._task is None:
            self._start(request)
        else:
            self._queue.append(request)
            if len(self._queue) >= self._limits.max_pipelined and not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()

    # -- running handlers ---------------------------------------------------------
    def _start(self, request: Request) -> None:
        self._disarm_timer()
        writer = ResponseWriter(self, request.keep_alive, head_only=request.method == "HEAD",
                                chunked=request.http_version != "1.0")
        self._writer = writer
        self._task = self._loop.create_task(self._run(request, writer))

    async def _run(self, request: Request, writer: ResponseWriter) -> None:
        try:
            await self._handler(request, writer)
        except asyncio.CancelledError:
            if not self.closed:
                # Cancelled for another reason (shutdown): do not leave the client hanging.
                writer.abort()
            raise
        except Exception:
            log.exception("unhandled error in request handler for %s %s", request.method, request.path)
            if not writer.started:
                writer.keep_alive = False
                writer.send(500, b'{"error":{"message":"internal proxy error","type":"InternalServerError",'
                                 b'"param":null,"code":500}}')
            elif not writer.finished:
                writer.abort()
        else:
            if not writer.started:
                writer.send(500, b'{"error":{"message":"no response produced","type":"InternalServerError",'
                                 b'"param":null,"code":500}}')
            elif not writer.finished:
                writer.abort()

    def response_finished(self, writer: ResponseWriter) -> None:
        """Called when a response is fully written: close or serve the next request."""
        if writer is not self._writer:
            return
        self._writer = None
        self._task = None
        if self.closed:
            return
        if not writer.keep_alive:
            self.transport.close()
            self.closed = True
            return
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        if self._queue:
            self._loop.call_soon(self._next)
        else:
            self._arm_timer(self._limits.keep_alive_timeout)

    def _next(self) -> None:
        if self._queue and self._task is None and not self.closed:
            self._start(self._queue.pop(0))

    def _reject(self, status: int, message: str) -> None:
        """A request we cannot parse: answer it and close the connection."""
        if self.closed:
            return
        if self._task is None or self._task.done():
            body = ProxyError(status, message).body()
            self.transport.write(status_line(status) + _date.get() +
                                 b"content-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n" % len(body) + body)
            self.transport.close()
            self.closed = True
        else:
            self.abort()


class HttpServer:
    """Owns the listening socket and the live connections."""

    def __init__(self, handler: Handler, *, limits: ServerLimits | None = None) -> None:
        self.handler = handler
        self.limits = limits or ServerLimits()
        self.connections: set[HttpServerProtocol] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, backlog: int = 4096,
                    reuse_port: bool = False, sock=None) -> "HttpServer":
        loop = asyncio.get_running_loop()
        factory = lambda: HttpServerProtocol(self.handler, self.limits, self.connections)  # noqa: E731
        if sock is not None:
            self._server = await loop.create_server(factory, sock=sock, backlog=backlog)
        else:
            self._server = await loop.create_server(factory, host, port, backlog=backlog,
                                                    reuse_port=reuse_port or None)
        return self

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def host(self) -> str:
        return self._server.sockets[0].getsockname()[0]

    # -- graceful shutdown (serve.py drives these) ----------------------------------------
    def drain(self) -> None:
        """Every response in progress closes its connection when it ends (the handler makes
        later ones do so too)."""
        for conn in self.connections:
            if conn._writer is not None:
                conn._writer.keep_alive = False

    def close_idle(self) -> None:
        """Close the connections that have no request in progress or half received."""
        for conn in list(self.connections):
            if conn._task is None and not conn._parsing and not conn._queue and conn.transport is not None:
                conn.transport.close()

    def stop_accepting(self) -> None:
        """Close the listening socket; accepted connections go on."""
        if self._server is not None:
            self._server.close()

    def busy(self) -> list[asyncio.Task]:
        """The handler tasks still running."""
        return [c._task for c in self.connections if c._task is not None and not c._task.done()]

    async def close(self, *, abort_connections: bool = True) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.connections):
            if abort_connections:
                conn.abort()
            elif conn.transport is not None:
                conn.transport.close()
        await self._server.wait_closed()
        self._server = None
