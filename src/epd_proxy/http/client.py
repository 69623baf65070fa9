"""A keep-alive HTTP/1.1 client pool at the asyncio protocol level.

Two ways to consume a response body:

* ``await response.read()`` buffers the whole body (encoder, prefill, and
  non-stream decode answers, which are small JSON documents);
* ``response.relay(sink)`` hands every body piece to ``sink`` from the
  protocol callback, with no ``await`` per chunk: the streamed decode path.

vLLM closes idle keep-alive connections after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s by default), so
the pool never reuses a connection idle for longer than ``idle_timeout`` (default 2.5 s). A request on
a *reused* connection that dies before any response byte arrives is retried once on a fresh
connection — the race with the server's idle close — and never after a byte was seen.

``max_connections`` caps the connections open to one upstream (in use, idle
or being opened), so no burst — one request with a thousand media items, or
a thousand requests — can take every file descriptor. Requests over the cap
wait in line (FIFO) for a connection another request hands back, or for a
free slot; the wait is bounded by the request's header timeout, and running out
of it is a ``local`` error (the proxy's limit, not the upstream's failure).
"""

from __future__ import annotations

import asyncio
import errno
import ssl as _ssl
import sys
from collections import deque
from urllib.parse import urlsplit

import httptools
import msgspec

from epd_proxy.http import Headers
from epd_proxy.http.timers import ConnectionTimer
from epd_proxy.http.transport import BodySink, TransportTimeouts, UpstreamError, UpstreamTimeout

_Future: type[asyncio.Future] = asyncio.Future  # the running loop's; loop.create_future() costs ~860 more


class Response(msgspec.Struct, eq=False):
    """One upstream response: status and headers first, then the body (a Struct: no ``__init__`` frame)."""

    _conn: _Connection
    status: int
    headers: dict[bytes, bytes]
    content_type: bytes | None  # an attribute, not a property over the headers: read on every answer
    _chunks: list[bytes] = []
    _waiter: asyncio.Future | None = None
    _done: asyncio.Future | None = None
    _error: Exception | None = None
    _sink: BodySink | None = None
    complete: bool = False
    _released: bool = False

    # -- fed by the connection (its ``on_body`` appends to ``_chunks`` or feeds the sink) ---
    def _finish(self, exc: Exception | None) -> None:
        if self.complete or self._error is not None:
            return
        if exc is None:
            self.complete = True
        else:
            self._error = exc
        sink = self._sink
        if sink is not None:
            if exc is None:
                sink.on_end()
            else:
                sink.on_error(exc)
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(None)
        fut = self._done
        if fut is not None and not fut.done():
            fut.set_result(None)
        if exc is None and not self._released:  # a finished body hands the connection back
            self._released = True
            self._conn.response_done(self)

    # -- consumer API ---------------------------------------------------------------
    async def read_chunk(self) -> bytes:
        """The next body piece as received; ``b""`` at the end of the body."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = _Future()
            self._conn.resume_reading()
            await self._waiter
            self._waiter = None
        return self._chunks.pop(0) if len(self._chunks) > 1 else self._chunks.pop()

    def body(self) -> bytes | None:
        """The whole body if all of it is here, else None (then ``await read()``): no coroutine."""
        if not self.complete:
            return None
        chunks, self._chunks = self._chunks, []
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read(self) -> bytes:
        """The whole body."""
        while not self.complete:
            if self._error is not None:
                raise self._error
            self._waiter = _Future()
            self._conn.resume_reading()
            await self._waiter
            self._waiter = None
        return self.body()  # type: ignore[return-value]  # complete: the body

    def relay(self, sink: BodySink) -> None:
        """Send the rest of the body to ``sink`` as it arrives (anything buffered first)."""
        self._sink = sink
        if self._chunks:
            chunks, self._chunks = self._chunks, []
            for c in chunks:
                sink.on_data(c)
        if self.complete:
            sink.on_end()
        elif self._error is not None:
            sink.on_error(self._error)

    async def wait(self) -> None:
        """Wait until the body has ended (relay mode) or failed; raises the failure."""
        if not self.complete and self._error is None:
            self._done = _Future()
            await self._done
        if self._error is not None:
            raise self._error

    def pause_reading(self) -> None:
        # Once released, the connection is back in the pool (or gone): a late signal
        # from a flow listener must not freeze whichever request uses it next.
        if not self._released:
            self._conn.pause_reading()

    def resume_reading(self) -> None:
        if not self._released:
            self._conn.resume_reading()

    def close(self) -> None:
        """Done with this response. An unfinished body aborts the connection, which
        is how vLLM learns that the request is abandoned."""
        if self._released:
            return
        self._released = True
        if self.complete:
            self._conn.response_done(self)
        else:
            self._conn.abort()


class _Connection(asyncio.Protocol):
    """One upstream TCP connection; carries one request at a time."""

    def __init__(self, pool: "ConnectionPool") -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # until connection_made
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reusable = True
        self.idle_since = 0.0
        self.requests = 0
        self._headers: dict[bytes, bytes] = {}
        self._head_future: asyncio.Future | None = None
        self._response: Response | None = None
        self._got_bytes = False
        self._body_has_length = False
        self._timeouts: TransportTimeouts = None  # type: ignore[assignment]  # each request's, set before the timer
        self._last_activity = 0.0
        self._timer = ConnectionTimer(self.loop, self._on_timeout)
        self._sent_at = 0.0
        self._paused = False
        self._ignore_message = False
        self._head_request = False

    # -- asyncio protocol -------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        self._last_activity = self.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            # httptools wraps what a callback raised; the original is the context.
            inner = exc.__context__
            if not isinstance(inner, UpstreamError):
                inner = UpstreamError(f"malformed response from upstream: {exc!r}", kind="protocol",
                                      response_started=True)
            self._fail(inner)
            # The parser cannot resync: the connection is useless, and the upstream
            # must not keep generating for it.
            self.abort()

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        self._timer.close()
        resp = self._response
        if exc is None and resp is not None and not resp.complete and not self._body_has_length \
                and resp._error is None and self._head_future is None:
            # A close-delimited body ends at a clean EOF (a reset is a truncation).
            resp._finish(None)
        else:
            self._fail(UpstreamError("upstream closed the connection" + (f": {exc}" if exc else ""),
                                     response_started=self._got_bytes))
        # The parser holds this connection's callbacks and the response refers back to it:
        # let go of both, so a closed connection is freed without the cyclic collector.
        self._response = None
        self.parser = None  # type: ignore[assignment]  # closed: never fed again

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._head_future is None:
            # Bytes nobody asked for (e.g. on an idle connection): a confused upstream.
            # Parsing them as a response would hand this connection out twice.
            raise UpstreamError("unsolicited response from upstream", kind="protocol",
                                response_started=self._response is not None)
        self._headers = {}

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        headers = self._headers
        if name in headers:
            headers[name] += b", " + value
        else:
            headers[name] = value

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            self._ignore_message = True  # interim response (100 Continue): wait for the real one
            return
        self._ignore_message = False
        if not self.parser.should_keep_alive():
            self.reusable = False
        headers = self._headers
        self._body_has_length = b"content-length" in headers or status in (204, 304) \
            or b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        resp = Response(self, status, headers, headers.get(b"content-type"))
        self._response = resp
        fut = self._head_future
        self._head_future = None
        # Switch the timer from the header wait to the idle-body wait here, not when the requesting
        # task resumes: by then the body may be complete and this connection back in the pool,
        # carrying someone else's request (and header timer). From the read that completed the
        # head (the parser runs in ``data_received``).
        delay = self._timeouts.idle
        if delay is None:
            self._timer.due = None
        elif self._timer.fires > (due := self._last_activity + delay):
            self._timer.arm_at(due)
        else:  # arm_at's common case, inline: the loop timer fires in time
            self._timer.due = due
        if fut is not None and not fut.done():
            fut.set_result(resp)
        if self._head_request:
            # No body follows, whatever the headers say; httptools cannot be told so,
            # so the parser would wait for one: do not reuse this connection.
            self.reusable = False
            self._timer.due = None
            resp._finish(None)

    def on_body(self, body: bytes) -> None:
        resp = self._response
        if resp is not None:
            # Response._feed, inline: one call less for every piece of every body.
            sink = resp._sink
            if sink is not None:
                sink.on_data(body)
                return
            resp._chunks.append(body)
            w = resp._waiter
            if w is not None and not w.done():
                w.set_result(None)

    def on_message_complete(self) -> None:
        if self._ignore_message:
            self._ignore_message = False
            return
        resp = self._response
        if resp is not None:
            self._timer.due = None  # disarmed
            resp._finish(None)

    # -- request lifecycle ----------------------------------------------------------------
    def send(self, head: bytes, body: bytes, timeouts: TransportTimeouts, is_head: bool = False) -> asyncio.Future:
        """Send one request (``is_head``: its method is HEAD: no body will follow its answer)."""
        self.requests += 1
        self._got_bytes = False
        self._response = None
        self._head_request = is_head
        self._timeouts = timeouts
        self._head_future = fut = _Future()
        self._last_activity = self._sent_at = now = self.loop.time()
        if body:
            if len(body) < 65536:
                self.transport.write(head + body)
            else:
                self.transport.writelines((head, body))
        else:
            self.transport.write(head)
        delay = timeouts.headers
        if delay is None:
            self._timer.due = None
        elif self._timer.fires > (due := now + delay):
            self._timer.arm_at(due)
        else:  # arm_at's common case, inline: the loop timer fires in time
            self._timer.due = due
        return fut

    # One timer, moved lazily (``timers``): armed for the header wait in ``send``, for the
    # idle-body wait in ``on_headers_complete``; disarming leaves it to fire into nothing.
    # Body bytes move the idle deadline without touching it: ``_on_timeout`` looks at
    # the last activity and re-arms when the connection was not silent that long.
    def _on_timeout(self) -> None:
        if self.closed:
            return
        t = self._timeouts
        waiting_head = self._head_future is not None
        delay = t.headers if waiting_head else t.idle
        if delay is None:
            return
        now = self.loop.time()
        if waiting_head:
            # The header wait runs from when the request was sent, not from the last byte.
            due = self._sent_at + delay
            if now < due:
                self._timer.arm_at(due)
                return
            self._fail(UpstreamTimeout(f"no response headers within {delay:g} s",
                                       response_started=self._got_bytes))
            self.transport.abort()
            return
        if self._paused:
            # Silence because we are throttling for a slow client is not the upstream's fault.
            self._timer.arm_at(now + delay)
            return
        elapsed = now - self._last_activity
        if elapsed >= delay:
            self._fail(UpstreamTimeout(f"upstream sent nothing for {delay:g} s", response_started=True))
            self.transport.abort()
        else:
            self._timer.arm_at(self._last_activity + delay)

    def _fail(self, exc: UpstreamError) -> None:
        self.reusable = False
        fut = self._head_future
        self._head_future = None
        if fut is not None and not fut.done():
            fut.set_exception(exc)
        resp = self._response
        if resp is not None:
            resp._finish(exc)

    def response_done(self, resp: Response) -> None:
        if resp is not self._response:
            return
        self._response = None
        self._timer.due = None  # disarmed
        if self._paused:
            self.resume_reading()
        if self.reusable and not self.closed:
            pool = self.pool
            if pool._slots <= pool._limit and not pool._waiters and not pool.closed \
                    and len(pool._idle) < pool.max_idle:
                # ConnectionPool._release's common case, inline: back to the idle line.
                self.idle_since = self.loop.time()
                pool._idle.append(self)
            else:
                pool._release(self)
        else:
            self.abort()

    def pause_reading(self) -> None:
        if not self._paused and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and not self.closed:
            self._paused = False
            self._last_activity = self.loop.time()
            self.transport.resume_reading()

    def abort(self) -> None:
        self.reusable = False
        if not self.closed and self.transport is not None:
            self.transport.abort()
        self.closed = True
        self.pool._forget(self)


class ConnectionPool:
    """Keep-alive connections to one upstream origin (``http://host:port``)."""

    def __init__(self, url: str, *, idle_timeout: float = 2.5, max_idle: int = 256,
                 default_headers: Headers | None = None, ssl_context: _ssl.SSLContext | None = None,
                 max_connections: int | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {url!r}")
        if not parts.hostname:
            raise ValueError(f"no host in {url!r}")
        self.url = url.rstrip("/")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base_path = parts.path.rstrip("/")
        self._base_path = self.base_path.encode()
        self._ssl = ssl_context if ssl_context is not None else (
            _ssl.create_default_context() if parts.scheme == "https" else None)
        default_port = 443 if parts.scheme == "https" else 80
        host_value = self.host if self.port == default_port else f"{self.host}:{self.port}"
        if ":" in self.host and not self.host.startswith("["):
            host_value = f"[{self.host}]" + ("" if self.port == default_port else f":{self.port}")
        self._host_header = b"host: " + host_value.encode("idna") + b"\r\n"
        extra = b"".join(n + b": " + v + b"\r\n" for n, v in (default_headers or []))
        self._fixed_headers = self._host_header + extra
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self.loop = asyncio.get_event_loop()
        self._idle: deque[_Connection] = deque()
        self._all: set[_Connection] = set()
        self.closed = False
        # Slots: connections open or being opened. A slot freed while requests wait is
        # handed to the first of them, never released, so a newcomer cannot jump the line.
        self._limit = sys.maxsize
        self._slots = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._abandoned = 0  # about how many waiters in the deque gave up (when to sweep them)
        self.max_connections = max_connections

    @property
    def max_connections(self) -> int | None:
        """The cap on connections to this upstream (None: no cap)."""
        return None if self._limit == sys.maxsize else self._limit

    @max_connections.setter
    def max_connections(self, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError("max_connections must be >= 1")
        self._limit = sys.maxsize if value is None else value

    @property
    def waiting(self) -> int:
        """Requests waiting for a connection (the cap is reached)."""
        return sum(not w.done() for w in self._waiters)

    @property
    def open_connections(self) -> int:
        return len(self._all)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    async def _connect(self, timeout: float | None) -> _Connection:
        """A new connection, in a slot the caller holds (freed here if the connect fails)."""
        conn = _Connection(self)
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
        # arrives as the connection completes, leaving the cancelled request running.
        try:
            async with asyncio.timeout(timeout):
                await self.loop.create_connection(lambda: conn, self.host, self.port, ssl=self._ssl,
                                                  server_hostname=self.host if self._ssl else None)
        except TimeoutError:
            self._free_slot()
            raise UpstreamError(f"connect to {self.url} timed out after {timeout:g} s", kind="connect") from None
        except OSError as exc:
            self._free_slot()
            kind = "local" if exc.errno in _LOCAL_ERRNOS else "connect"
            raise UpstreamError(f"cannot connect to {self.url}: {exc.strerror or exc}", kind=kind) from None
        except MemoryError:
            self._free_slot()
            raise UpstreamError(f"cannot connect to {self.url}: out of memory", kind="local") from None
        except BaseException:
            if conn.transport is not None:
                conn.transport.abort()
            self._free_slot()
            raise
        if self.closed:
            conn.transport.abort()
            raise UpstreamError("connection pool is closed", kind="connect")
        self._all.add(conn)  # the connection owns the slot until it is forgotten
        return conn

    async def _fresh(self, timeouts: TransportTimeouts, queue: bool = True) -> tuple[_Connection, bool]:
        """A connection for a request that found none idle: a new one if a slot is free
        (or the request may not queue), else whatever the line gives (a handed-back
        connection, or a slot). Returns the connection and whether it was reused."""
        if self._slots < self._limit or not queue:
            self._slots += 1
            return await self._connect(timeouts.connect), False
        got = await self._wait_turn(timeouts.headers)
        if got is not None:
            return got, True
        return await self._connect(timeouts.connect), False

    async def _wait_turn(self, timeout: float | None) -> _Connection | None:
        """Wait in line; returns a connection handed over, or None for a slot to fill."""
        fut = self.loop.create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except BaseException as exc:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Served just as we gave up: pass it on, never drop it.
                got = fut.result()
                if got is None:
                    self._free_slot()
                else:
                    self._release(got)
            else:
                fut.cancel()
                self._abandon()
            if isinstance(exc, TimeoutError):
                # The proxy's own limit, not the upstream's doing: "local", and no address
                # in the words (they may reach a client).
                raise UpstreamError(f"no connection free within {timeout:g} s, all {self._limit} in use "
                                    "(--max-upstream-connections)", kind="local") from None
            raise

    def _abandon(self) -> None:
        """A waiter left the line; drop the dead ones once they are half of it
        (removing each at once would be quadratic when a thousand leave together)."""
        self._abandoned += 1
        if self._abandoned * 2 > len(self._waiters):
            self._waiters = deque(w for w in self._waiters if not w.done())
            self._abandoned = 0

    def _next_waiter(self) -> asyncio.Future | None:
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                return fut
            if self._abandoned:
                self._abandoned -= 1
        return None

    def _free_slot(self) -> None:
        """A connection is gone (or was never made): its slot goes to the line first
        (unless it was one over the cap, opened by a request that may not queue)."""
        fut = self._next_waiter() if self._waiters and self._slots <= self._limit else None
        if fut is not None:
            fut.set_result(None)
        elif self._slots > 0:
            self._slots -= 1

    def _take_idle(self) -> _Connection | None:
        """The least recently used idle connection still within ``idle_timeout``. Taking the
        oldest first turns every idle connection over, so those a burst opened stay warm
        through the quieter stretch after it and the next burst finds them open; most
        recently used first would keep only the quiet stretch's few alive and reconnect the
        rest (docs/benchmarks.md, "Upstream connections under bursts"). The idle line is in
        release order, so the expired ones are at its head."""
        now = self.loop.time()
        while self._idle:
            conn = self._idle.popleft()
            if conn.closed:
                continue
            if now - conn.idle_since >= self.idle_timeout:
                conn.abort()
                continue
            return conn
        return None

    def _release(self, conn: _Connection) -> None:
        if self._slots > self._limit:
            conn.abort()  # one over the cap (a request that may not queue): not kept
            return
        if self._waiters and not self.closed and not conn.closed:
            fut = self._next_waiter()
            if fut is not None:
                fut.set_result(conn)  # straight to the first in line
                return
        if self.closed or len(self._idle) >= self.max_idle:
            conn.abort()
            return
        conn.idle_since = self.loop.time()
        self._idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        if conn in self._all:
            self._all.discard(conn)
            self._free_slot()
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    async def request(self, method: str, path: str, *, body: bytes = b"", headers: Headers | None = None,
                      timeouts: TransportTimeouts | None = None, queue: bool = True) -> Response:
        """Send a request; return once the status and headers have arrived.

        ``queue=False`` never waits in line at the connection cap (a health probe must
        measure the upstream, not this pool's queue): it opens a connection over the cap.
        """
        if self.closed:
            raise UpstreamError("connection pool is closed", kind="connect")
        timeouts = timeouts or _DEFAULT_TIMEOUTS
        # _head, inline (every upstream request).
        parts = [method.encode(), b" ", self._base_path + path.encode(), b" HTTP/1.1\r\n", self._fixed_headers]
        if headers:
            for name, value in headers:
                parts += (name, b": ", value, b"\r\n")
        if body or method in _WITH_BODY:
            parts.append(b"content-length: %d\r\n\r\n" % len(body))
        else:
            parts.append(b"\r\n")
        head = b"".join(parts)
        conn = None
        idle = self._idle
        if idle:  # _take_idle's common case, inline: the oldest idle connection, fresh
            conn = idle[0]
            if not conn.closed and self.loop.time() - conn.idle_since < self.idle_timeout:
                idle.popleft()
            else:
                conn = self._take_idle()
        reused = conn is not None
        if conn is None:
            conn, reused = await self._fresh(timeouts, queue)
        while True:  # the exchange, in this coroutine (none of its own: every upstream request)
            fut = conn.send(head, body, timeouts, method == "HEAD")
            try:
                return await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    # Cancelled after the head arrived: the response may be complete and its
                    # connection already back in the pool (maybe carrying another request).
                    # Close the response: that aborts only if its body is still running.
                    fut.result().close()
                else:
                    conn.abort()
                raise
            except UpstreamError as exc:
                conn.abort()
                if not (reused and not exc.response_started and exc.kind == "connection"):
                    raise
            # The server closed the idle connection as we reused it: once more, on a fresh one.
            conn, _ = await self._fresh(timeouts, queue)
            reused = False

    async def fetch(self, method: str, path: str, *, headers: Headers | None = None,
                    timeouts: TransportTimeouts | None = None, body: bytes = b"",
                    queue: bool = True) -> tuple[int, bytes | None, bytes]:
        """One whole exchange: send the request, read all of the answer, close it.

        Returns the status, the content type and the body; raises ``UpstreamError``
        (``UpstreamTimeout``) like ``request``. For the small answers read in one piece
        (models, health, metrics, admin calls); ``queue`` as for ``request``."""
        resp = await self.request(method, path, body=body, headers=headers, timeouts=timeouts, queue=queue)
        try:
            data = await resp.read()
        finally:
            resp.close()
        return resp.status, resp.content_type, data

    def fail_pending(self, error) -> int:
        """Fail every exchange still waiting for its answer: no headers yet, or a body
        being read rather than relayed (work before a response is committed). For an
        upstream that stopped answering, so its requests can be retried elsewhere
        instead of waiting for their timeouts. ``error()`` makes each exception; returns
        how many were failed."""
        n = 0
        for conn in list(self._all):
            resp = conn._response
            if conn._head_future is not None or (resp is not None and resp._sink is None and not resp.complete):
                conn._fail(error())
                conn.abort()
                n += 1
        return n

    async def close(self) -> None:
        self.closed = True
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()
        self._all.clear()
        waiters, self._waiters = self._waiters, deque()
        self._abandoned = 0
        for fut in waiters:
            if not fut.done():
                fut.set_exception(UpstreamError("connection pool is closed", kind="connect"))


_DEFAULT_TIMEOUTS = TransportTimeouts()
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})  # methods whose request says its length even when empty
# Connect failures that are this process's own shortage, not the upstream's.
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
