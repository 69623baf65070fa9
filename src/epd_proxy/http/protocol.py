"""One client connection: httptools parses, this protocol applies the limits, runs one
handler task per request, answers pipelined requests in order and bounds every wait.

If the client goes away, the request's handler task is cancelled, so every ``finally``
in the request's path closes its upstream connections: that is how an abort reaches
vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Protocol

import httptools

from epd_proxy.http.response import Request, ResponseWriter, date_cache, parsed_request, status_line
from epd_proxy.http.server_limits import BodyBudget, ServerLimits
from epd_proxy.http.timers import ConnectionTimer

log = logging.getLogger("epd_proxy.http")

Handler = Callable[[Request, ResponseWriter], Awaitable[None]]
# (status, message, path) -> a JSON body; the path is the request's when the request line was
# read ("" before it), so that the owner can answer in the envelope of that path's API.
ErrorBody = Callable[[int, str, str], bytes]

# Input is parsed in slices of at most this many bytes (a Content-Length body in one
# go), so that a read full of pipelined requests stops being parsed once enough of them
# wait: the rest waits, with reading paused, until the queue drains.
_SLICE = 8 * 1024

# How long a connection rejected mid-request keeps reading (and dropping) what its
# client still sends before it is closed.
_LINGER = 5.0

# A request's task made as ``Task(coro)``, bound to the running loop (the connection's), not by
# ``loop.create_task``: uvloop's passes the loop by keyword, ~1,400 instructions more a request.
_Task = asyncio.Task


class Listener(Protocol):
    """What a connection needs of the server that accepted it (``HttpServer``): its
    connection cap, its body budget and its refusal counts. Kept narrow so that this
    module does not import the server that imports it."""

    budget: BodyBudget
    refused_answer: bytes
    refused: int
    rejections: dict[int, int]

    def at_capacity(self) -> bool: ...

    def make_room(self) -> bool: ...


class _ParseError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpServerProtocol(asyncio.Protocol):
    """One client connection: parse requests, run the handler, write responses in order."""

    def __init__(self, handler: Handler, limits: ServerLimits, connections: set, error_body: ErrorBody,
                 server: Listener | None = None) -> None:
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
                budget = self._budget  # _charge's, inline: every request with a body
                if budget.used + n > budget.limit:
                    raise _ParseError(503, "the proxy is holding too many request bodies; retry shortly")
                budget.used += n
                self._charged += n
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
        request = parsed_request(
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
        self._timer.due = None  # disarmed
        self._active_size = len(request.body)
        # Positional: a class's call with keywords builds a dict for them.
        writer = ResponseWriter(self, request.keep_alive, request.method == "HEAD", request.http_version != "1.0")
        self._writer = writer
        self._task = _Task(self._run(request, writer))

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
                writer.send(500, self._error_body(500, "internal proxy error", request.path))
            elif not writer.finished:
                writer.abort()
        else:
            if not writer.started:
                writer.send(500, self._error_body(500, "no response produced", request.path))
            elif not writer.finished:
                writer.abort()

    def response_finished(self, writer: ResponseWriter) -> None:
        """Called when a response is fully written: close or serve the next request."""
        if writer is not self._writer:
            return
        self._writer = None
        self._task = None
        n = self._active_size
        if n:
            self._active_size = 0
            # _release's, inline: every request with a body.
            if n > self._charged:
                n = self._charged
            if n > 0:
                self._charged -= n
                self._budget.release(n)
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
            # _arm_waiting's, inline: after every keep-alive response.
            limits = self._limits
            if not self._parsing:
                self._timer.arm(limits.keep_alive_timeout)
            else:
                self._timer.arm(limits.header_timeout if self._in_head else limits.body_timeout)

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
        # The path of the message being parsed (its request line read, or part of it).
        path = self._url.partition(b"?")[0].decode("latin-1") if self._parsing else ""
        body = self._error_body(status, message, path)
        extra = b"retry-after: 1\r\n" if status == 503 else b""
        self.transport.write(status_line(status) + date_cache.get() + extra +
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
