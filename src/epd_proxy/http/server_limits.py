"""What clients may send, how slowly, and how many may be connected; the request bodies
a server holds at once.

Apart from the server and its connection protocol because both read them: the listener
counts connections against the cap, each connection applies the limits and charges the
body budget as it parses.
"""

from __future__ import annotations

from typing import Callable


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
# the heap is trimmed (see ``http/heap.py``) a moment later (``HttpServer``), once they
# are freed.
_LARGE_BODY = 1 << 20
_TRIM_AFTER = 32 << 20
