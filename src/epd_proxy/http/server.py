"""A small HTTP/1.1 server at the asyncio protocol level.

Why not a framework: the proxy's cost per streamed request is dominated by
per-chunk ``await``s and per-request framework set-up (see
docs/architecture.md for the measurements). Here a response chunk is one
``transport.write`` from whatever callback produced it, and back-pressure is
the transport's own pause/resume signal.

The server says nothing of its own in any particular error format: whoever builds
it passes ``error_body(status, message) -> bytes`` (the proxy its OpenAI envelope,
the simulator vLLM's), used for the errors it answers itself (unparsable or
oversized requests, timeouts, a handler that fails).

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

from epd_proxy.http import Headers
from epd_proxy.http.timers import ConnectionTimer

log = logging.getLogger("epd_proxy.http")

Handler = Callable[["Request", "ResponseWriter"], Awaitable[None]]
ErrorBody = Callable[[int, str], bytes]  # (status, message) -> a JSON body

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
    """Bounds on what clients may send, how slowly, and how many may be connected.

    ``header_timeout`` bounds the time from a request's first byte to the end of its
    head (a fresh connection must start within it, or within the keep-alive timeout if
    shorter); ``body_timeout`` bounds the whole body after the head. Zero means no
    bound for ``max_connections`` and ``max_buffered_bytes``.
    """

    def __init__(self, *, max_header_bytes: int = 64 * 1024, max_body_bytes: int = 64 * 1024 * 1024,
                 keep_alive_timeout: float = 75.0, header_timeout: float = 10.0, body_timeout: float = 60.0,
                 max_pipelined: int = 16, max_connections: int = 0, max_buffered_bytes: int = 0,
                 read_timeout: float | None = None) -> None:
        if read_timeout is not None:  # one bound for both parts of a request
            header_timeout = body_timeout = read_timeout
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.keep_alive_timeout = keep_alive_timeout
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_pipelined = max_pipelined
        self.max_connections = max_connections
        self.max_buffered_bytes = max_buffered_bytes


class BodyBudget:
    """Request-body bytes held by all connections of one server, against a limit.

    A body is charged while it is read (a ``Content-Length`` at once) and released when
    its response is finished or its connection is gone, so many large uploads at once
    get 503 instead of growing the process without bound."""

    __slots__ = ("limit", "used", "_released", "_on_large_release")

    def __init__(self, limit: int, on_large_release: Callable[[], None] | None = None) -> None:
        self.limit = limit if limit > 0 else 1 << 62
        self.used = 0
        self._released = 0
        self._on_large_release = on_large_release

    def release(self, n: int) -> None:
        self.used -= n
        if n >= _LARGE_BODY:
            self._released += n
        if self._released and (self._released >= _TRIM_AFTER or self.used == 0):
            self._released = 0
            if self._on_large_release is not None:
                self._on_large_release()


# After bodies of 1 MiB or more were released, 32 MiB of them or all bodies at once,
# the heap is trimmed (see ``http/heap.py``) a moment later, once they are freed.
_LARGE_BODY = 1 << 20
_TRIM_AFTER = 32 << 20
_TRIM_DELAY = 0.5

# Input is parsed in slices of at most this many bytes (a Content-Length body in one
# go), so that a read full of pipelined requests stops being parsed once enough of them
# wait: the rest waits, with reading paused, until the queue drains.
_SLICE = 8 * 1024

# How long a connection rejected mid-request keeps reading (and dropping) what its
# client still sends before it is closed.
_LINGER = 5.0


def _refusal(error_body: ErrorBody) -> bytes:
    """The whole answer to a connection beyond the cap, written once without reading."""
    body = error_body(503, "the proxy has too many client connections; retry shortly")
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)


class _ParseError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpServerProtocol(asyncio.Protocol):
    """One client connection: parse requests, run the handler, write responses in order."""

    def __init__(self, handler: Handler, limits: ServerLimits, connections: set, error_body: ErrorBody,
                 server: "HttpServer | None" = None) -> None:
        self._handler = handler
        self._error_body = error_body
        self._limits = limits
        self._connections = connections
        self._server = server
        self._budget = server.budget if server is not None else BodyBudget(limits.max_buffered_bytes)
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # until connection_made
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
        self._length = -1  # the current message's Content-Length (-1: none)
        self._version = "1.1"
        self._method = b""
        self._parsing = False
        # Requests parsed but not yet answered (pipelining), and the active handler.
        self._queue: list[Request] = []
        self._task: asyncio.Task | None = None
        self._writer: ResponseWriter | None = None
        self._timer = ConnectionTimer(self._loop, self._on_timeout)
        self._reading_paused = False
        self._held_input: bytes | None = None  # input not parsed yet: too many requests wait
        # Bytes of a request head (or trailer section) still in progress: httptools
        # buffers one field's name and value internally until the line ends, so
        # bound that too.
        self._in_head = False
        self._head_pending = 0
        self._data = b""  # the slice being parsed
        self._line_data: bytes | None = None  # the slice the current message began at, if it did
        self._chunk_fresh = False
        self._began_here = False
        self._began_at_chunk_start = False
        self._chunk_mark = -1  # body length at the last chunk header (-1: not in a chunk)
        self._chunk_mark_new = False
        self._body_timed = False
        self._ignoring_upgrade = False
        self._done_reading = False  # a non-keep-alive request was read: ignore the rest
        self._rejection: tuple[int, str] | None = None  # an error to answer after the queued requests
        self._lingering = False  # rejected mid-request: the client's bytes are dropped until _LINGER
        # Body bytes charged to the server's budget: everything this connection holds,
        # and the part that belongs to the request being answered.
        self._charged = 0
        self._active_size = 0
        self.kept_alive = False  # has answered a request and waits for the next

    # -- connection events --------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        server = self._server
        if server is not None and server.at_capacity() and not server.make_room():
            # Refused without reading: a canned answer and the descriptor back at once.
            self.closed = self._done_reading = True
            transport.write(server.refused_answer)
            transport.close()
            server.refused += 1
            return
        self._peer = transport.get_extra_info("peername")
        self._connections.add(self)
        limits = self._limits
        self._timer.arm(min(limits.keep_alive_timeout, limits.header_timeout or limits.keep_alive_timeout))

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._connections.discard(self)
        self._timer.close()
        self._held_input = None
        if self._charged:
            self._release(self._charged)
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
        self._body = []
        # Both refer back to this protocol (the parser holds its callbacks, the task's
        # frames its handler's): let go of them so the connection is freed without the
        # cyclic collector, which the frozen-GC settings make rare.
        self._task = None
        self._parser = None  # type: ignore[assignment]  # closed: never fed again

    @property
    def idle(self) -> bool:
        """Waiting for a request (between requests, or before the first byte)."""
        return self._task is None and not self._parsing and not self._queue and not self.closed

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

    def data_received(self, data) -> None:
        if self._done_reading:
            return
        if self._held_input is not None:
            self._held_input += data  # reading is paused; a read already under way lands here
            return
        try:
            if len(data) <= _SLICE and len(self._queue) < self._limits.max_pipelined:
                data = self._feed(data)
                if data is None:
                    return
            self._consume(data)
        except Exception as exc:  # never leave a socket open behind an unexpected error
            self._fail(exc)

    def _consume(self, data) -> None:
        """Parse ``data`` slice by slice, re-parsing Upgrade requests without the
        header, and hold the rest back while ``max_pipelined`` requests wait."""
        while data:
            if self.closed or self._done_reading:
                return
            if len(self._queue) >= self._limits.max_pipelined:
                self._held_input = bytes(data)
                if not self._reading_paused:
                    self._reading_paused = True
                    self.transport.pause_reading()
                return
            step = _SLICE
            if self._length > 0 and not self._in_head and self._parsing:
                step = max(step, self._length - self._body_len)  # no message ends inside a body
            if len(data) > step:
                view = data if isinstance(data, memoryview) else memoryview(data)
                piece, data = view[:step], view[step:]
            else:
                piece, data = data, b""
            again = self._feed(piece)
            if again is not None:
                data = again + data if data else again

    def _feed(self, data) -> bytes | None:
        """Parse one slice. Returns what must be parsed next in its place (an Upgrade
        request's head without the header, and the rest of the slice), else None."""
        self._chunk_fresh = not self._parsing  # this slice starts at a message boundary
        self._began_here = False
        self._data = data
        try:
            self._parser.feed_data(data)
        except _ParseError as exc:
            self._reject(exc.status, str(exc))
        except httptools.HttpParserUpgrade as exc:
            if self._ignoring_upgrade:
                return self._without_upgrade(data[exc.args[0]:])
            self._reject(400, "protocol upgrade is not supported")
        except httptools.HttpParserCallbackError as exc:
            # httptools wraps what a callback raised; the original is the context.
            inner = exc.__context__
            if isinstance(inner, _ParseError):
                self._reject(inner.status, str(inner))
            elif inner is not None and not isinstance(inner, Exception):
                raise inner from None
            else:
                self._reject(400, f"malformed HTTP request: {exc}")
        except httptools.HttpParserError as exc:
            if self._done_reading:
                return None  # bytes after a "Connection: close" request: not a request of ours
            self._reject(400, f"malformed HTTP request: {exc}")
        else:
            if self._in_head:
                if self._began_here:
                    # Count this slice only if it began with the message (else part of it
                    # belongs to the previous one; the next slice will be counted).
                    self._head_pending = len(data) if self._began_at_chunk_start else 0
                else:
                    self._head_pending += len(data)
                if self._head_pending > self._limits.max_header_bytes:
                    self._reject(431, "request headers too large")
            elif self._parsing:
                self._body_in_progress(len(data))
        finally:
            self._data = b""
        return None

    def _body_in_progress(self, n: int) -> None:
        """A message's body (or its trailers) continues in the next read."""
        if not self._body_timed:
            self._body_timed = True
            if self._task is None:
                self._timer.arm(self._limits.body_timeout)
        if self._chunk_mark == self._body_len:
            # No body byte since the last chunk header: after the last chunk these are
            # trailer bytes, which httptools holds until their line ends.
            if self._chunk_mark_new:
                self._chunk_mark_new = False
                self._head_pending = 0
            else:
                self._head_pending += n
                if self._head_pending > self._limits.max_header_bytes:
                    self._reject(431, "request trailers too large")

    def _without_upgrade(self, rest) -> bytes:
        """An ``Upgrade: h2c`` (or similar) request is answered over HTTP/1.1, ignoring
        the header (RFC 9110 7.8). httptools stops at an upgrade and skips the body, so
        the head is parsed again without it by a fresh parser, followed by the rest."""
        self._ignoring_upgrade = False
        parser = self._parser
        head = [parser.get_method(), b" ", self._url, b" HTTP/", parser.get_http_version().encode(), b"\r\n"]
        for name, value in self._headers.items():
            if name != b"upgrade":
                head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        head.append(rest)
        self._parser = httptools.HttpRequestParser(self)
        self._parsing = False
        return b"".join(head)

    def _fail(self, exc: BaseException) -> None:
        """An error no rule foresaw: one short log line and the connection closed."""
        log.warning("closing client connection from %s after an unexpected %s: %.200s",
                    self._peer, type(exc).__name__, exc)
        self._done_reading = True
        self._held_input = None
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    # -- timers -------------------------------------------------------------------
    # One timer, moved lazily (``timers``): disarming clears the deadline and leaves
    # the loop timer to fire into nothing or to re-aim; a keep-alive request costs no
    # loop-timer operations at all.
    def _on_timeout(self) -> None:
        if self.closed and not self._lingering:
            return
        if self._lingering:
            self.transport.close()
            return
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
        self._line_data = self._data if self._chunk_fresh else None
        self._chunk_fresh = False
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._body = []
        self._body_len = 0
        self._length = -1
        self._chunk_mark = -1
        self._body_timed = False
        if self._task is None:
            self._timer.arm(self._limits.header_timeout)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > self._limits.max_header_bytes:
            raise _ParseError(431, "request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self._limits.max_header_bytes:
            raise _ParseError(431, "request headers too large" if self._in_head else "request trailers too large")
        if not self._in_head:
            return  # a trailer field: counted, never merged into the judged head
        name = name.lower()
        if name in self._headers:
            if name == b"host":
                raise _ParseError(400, "more than one Host header")
            self._headers[name] += b", " + value
        else:
            self._headers[name] = value

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        self._version = version = parser.get_http_version()
        if version != "1.1":
            if version != "1.0":
                raise _ParseError(400, f"HTTP/{version} is not supported on this HTTP/1.1 connection")
        elif b"host" not in self._headers:
            raise _ParseError(400, "missing Host header")
        self._method = method = parser.get_method()
        line = self._line_data
        if line is not None:
            self._line_data = None
            self._check_request_line(line, method)
        if parser.should_upgrade():
            if method == b"CONNECT":
                raise _ParseError(400, "CONNECT is not supported")
            self._ignoring_upgrade = True  # see _without_upgrade
            return
        cl = self._headers.get(b"content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise _ParseError(400, "invalid content-length") from None
            if n > self._limits.max_body_bytes:
                raise _ParseError(413, f"request body larger than {self._limits.max_body_bytes} bytes")
            if n:
                self._length = n
                self._charge(n)
        if self._headers.get(b"expect", b"").lower() == b"100-continue" and self._task is None \
                and version != "1.0":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _check_request_line(self, line: bytes, method: bytes) -> None:
        """RFC 9112 3: one space on each side of the target (llhttp skips extra ones).
        Checked when the request line is in the slice the message began at."""
        n = len(method)
        end = n + 1 + len(self._url)
        if not isinstance(line, bytes):
            line = bytes(line[:end + 6])
        if len(line) >= end + 6 and line.startswith(method) and \
                (line[n + 1] == 32 or not line.startswith(b" HTTP/", end)):
            raise _ParseError(400, "malformed request line")

    def on_chunk_header(self) -> None:
        self._chunk_mark = self._body_len
        self._chunk_mark_new = True

    def on_chunk_complete(self) -> None:
        self._chunk_mark = -1

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._limits.max_body_bytes:
            raise _ParseError(413, f"request body larger than {self._limits.max_body_bytes} bytes")
        if self._length < 0:
            self._charge(len(body))
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._parsing = False
        if self._ignoring_upgrade:
            return  # parsed again by _without_upgrade
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            self._method.decode("latin-1"),
            self._url,
            self._headers,
            body,
            self._parser.should_keep_alive(),
            self._peer,
            self._version,
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

    # -- the body budget ----------------------------------------------------------
    def _charge(self, n: int) -> None:
        budget = self._budget
        if budget.used + n > budget.limit:
            raise _ParseError(503, "the proxy is holding too many request bodies; retry shortly")
        budget.used += n
        self._charged += n

    def _release(self, n: int) -> None:
        n = min(n, self._charged)
        if n > 0:
            self._charged -= n
            self._budget.release(n)

    # -- running handlers ---------------------------------------------------------
    def _start(self, request: Request) -> None:
        self._timer.disarm()
        self._active_size = len(request.body)
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
                writer.send(500, self._error_body(500, "internal proxy error"))
            elif not writer.finished:
                writer.abort()
        else:
            if not writer.started:
                writer.send(500, self._error_body(500, "no response produced"))
            elif not writer.finished:
                writer.abort()

    def response_finished(self, writer: ResponseWriter) -> None:
        """Called when a response is fully written: close or serve the next request."""
        if writer is not self._writer:
            return
        self._writer = None
        self._task = None
        if self._active_size:
            self._release(self._active_size)
            self._active_size = 0
        if self.closed:
            return
        if not writer.keep_alive:
            self.transport.close()
            self.closed = True
            return
        self.kept_alive = True
        if self._queue or self._held_input is not None:
            self._loop.call_soon(self._next)
        elif self._rejection is not None:
            status, message = self._rejection
            self._rejection = None
            self._parsing = False  # the rejected message is not read further
            self._answer_error(status, message)
        else:
            if self._reading_paused:
                self._reading_paused = False
                self.transport.resume_reading()
            self._arm_waiting()

    def _next(self) -> None:
        if self.closed or self._task is not None:
            return
        if self._queue:
            self._start(self._queue.pop(0))
        held = self._held_input
        if held is not None and len(self._queue) < self._limits.max_pipelined:
            self._held_input = None
            try:
                self._consume(held)
            except Exception as exc:
                self._fail(exc)
                return
        if self.closed:
            return
        if self._held_input is None and self._reading_paused and len(self._queue) < self._limits.max_pipelined:
            self._reading_paused = False
            self.transport.resume_reading()
        if self._task is None:
            if self._queue:
                self._start(self._queue.pop(0))
            else:
                self._arm_waiting()

    def _arm_waiting(self) -> None:
        """No request is being answered: bound the wait for the next one (or for the
        rest of one that began while the previous was answered)."""
        limits = self._limits
        if not self._parsing:
            self._timer.arm(limits.keep_alive_timeout)
        else:
            self._timer.arm(limits.header_timeout if self._in_head else limits.body_timeout)

    def _reject(self, status: int, message: str) -> None:
        """A request we cannot parse (or take): answer it and close the connection."""
        if self.closed:
            return
        self._done_reading = True
        self._held_input = None
        if self._server is not None:
            counts = self._server.rejections
            counts[status] = counts.get(status, 0) + 1
        if self._task is None or self._task.done():
            self._answer_error(status, message)
        else:
            # A request before this one is being answered: it and those queued are
            # answered first, then this error, then the connection closes.
            self._rejection = (status, message)
            self._body = []
            partial = self._charged - self._active_size - sum(len(q.body) for q in self._queue)
            if partial > 0:
                self._release(partial)

    def _answer_error(self, status: int, message: str) -> None:
        """Write the error with the envelope and close (no handler is running)."""
        body = self._error_body(status, message)
        extra = b"retry-after: 1\r\n" if status == 503 else b""
        self.transport.write(status_line(status) + _date.get() + extra +
                             b"content-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n" % len(body) + body)
        self.closed = True
        self._body = []
        if self._charged:
            self._release(self._charged)
        if self._parsing and status != 408 and self.transport.can_write_eof():
            # The client may still be sending (a large body): its bytes are read and
            # dropped for a moment, so that it reads this answer instead of the reset
            # that closing on unread data causes.
            self._lingering = True
            self.transport.write_eof()
            self._timer.arm(_LINGER)
        else:
            self.transport.close()


class HttpServer:
    """Owns the listening socket and the live connections."""

    def __init__(self, handler: Handler, *, error_body: ErrorBody, limits: ServerLimits | None = None,
                 on_large_release: Callable[[], object] | None = None) -> None:
        self.handler = handler
        self.error_body = error_body
        self.refused_answer = _refusal(error_body)  # built once: refusing must cost next to nothing
        self.limits = limits or ServerLimits()
        self.connections: set[HttpServerProtocol] = set()
        self._trim = on_large_release
        self._trim_pending = False
        self.budget = BodyBudget(self.limits.max_buffered_bytes, self._schedule_trim if on_large_release else None)
        self.refused = 0  # connections turned away at the connection cap
        self.reclaimed = 0  # idle connections closed to make room at the cap
        self.rejections: dict[int, int] = {}  # status -> requests refused while parsing
        self._server: asyncio.base_events.Server | None = None
        self._scan_after = 0.0
        self.tls = False

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, backlog: int = 4096,
                    reuse_port: bool = False, sock=None, ssl=None) -> "HttpServer":
        """Listen; with ``ssl`` (an ``ssl.SSLContext``) connections speak TLS (the event loop's
        own TLS layer sits under the protocol, which sees plain bytes either way)."""
        loop = asyncio.get_running_loop()
        factory = lambda: HttpServerProtocol(  # noqa: E731
            self.handler, self.limits, self.connections, self.error_body, self)
        self.tls = ssl is not None
        if sock is not None:
            self._server = await loop.create_server(factory, sock=sock, backlog=backlog, ssl=ssl)
        else:
            self._server = await loop.create_server(factory, host, port, backlog=backlog,
                                                    reuse_port=reuse_port or None, ssl=ssl)
        return self

    def _schedule_trim(self) -> None:
        if not self._trim_pending:
            self._trim_pending = True
            asyncio.get_running_loop().call_later(_TRIM_DELAY, self._run_trim)

    def _run_trim(self) -> None:
        self._trim_pending = False
        if self._trim is not None:  # scheduled only when set
            self._trim()

    def at_capacity(self) -> bool:
        cap = self.limits.max_connections
        return cap > 0 and len(self.connections) >= cap

    def make_room(self) -> bool:
        """At the connection cap: close idle keep-alive connections (a batch, so the
        scan is paid rarely). False if none was idle (then the newcomer is refused)."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._scan_after:
            return False
        batch = max(1, self.limits.max_connections // 16)
        idle = [conn for conn in self.connections if conn.idle]
        # Connections that answered a request and wait for another go first; one that
        # never sent a byte may be a client about to send its first request.
        idle.sort(key=lambda conn: not conn.kept_alive)
        for conn in idle[:batch]:
            conn.closed = True
            self.connections.discard(conn)
            conn.transport.close()
        closed = min(len(idle), batch)
        self.reclaimed += closed
        if not closed:
            self._scan_after = loop.time() + 0.05  # nothing idle: refuse cheaply for a moment
        return closed > 0

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        return self._server.sockets[0].getsockname()[1]

    @property
    def host(self) -> str:
        assert self._server is not None, "not started"
        return self._server.sockets[0].getsockname()[0]

    # -- graceful shutdown (serve.py drives these) ----------------------------------------
    def end_keep_alive(self) -> None:
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
