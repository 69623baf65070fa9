"""A small HTTP/1.1 server at the asyncio protocol level: the listener.

Why not a framework: the proxy's cost per streamed request is dominated by
per-chunk ``await``s and per-request framework set-up (see
docs/architecture.md for the measurements). Here a response chunk is one
``transport.write`` from whatever callback produced it (``http/response.py``), and
back-pressure is the transport's own pause/resume signal.

The server says nothing of its own in any particular error format: whoever builds
it passes ``error_body(status, message, path) -> bytes`` (the proxy the envelope of
the path's API, the simulator vLLM's), used for the errors it answers itself
(unparsable or oversized requests, timeouts, a handler that fails); ``path`` is ""
when no request line was read.

Each client connection is an ``HttpServerProtocol`` (``http/protocol.py``); the limits
and the body budget they share are in ``http/server_limits.py``.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from epd_proxy.http.protocol import ErrorBody, Handler, HttpServerProtocol
from epd_proxy.http.server_limits import BodyBudget, ServerLimits

# Once released bodies call for it (``BodyBudget``), the heap is trimmed this long after.
_TRIM_DELAY = 0.5


def _refusal(error_body: ErrorBody) -> bytes:
    """The whole answer to a connection beyond the cap, written once without reading."""
    body = error_body(503, "the proxy has too many client connections; retry shortly", "")
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)


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
