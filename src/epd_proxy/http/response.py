"""Requests and responses as the handler sees them.

A response chunk is one ``transport.write`` from whatever callback produced it, with no
``await``; back-pressure is the transport's own pause/resume signal, passed on to a
``FlowListener``.
"""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate
from typing import Any, Protocol

import msgspec

from epd_proxy.http import Headers

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


class DateCache:
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


date_cache = DateCache()


class Request(msgspec.Struct, eq=False):
    """One parsed request; the body is fully buffered before the handler runs. Made by
    :func:`parsed_request` (a ``msgspec.Struct``: no ``__init__`` frame on every request)."""

    method: str
    target: bytes
    path: str
    query: str
    headers: dict[bytes, bytes]  # lower-case names
    body: bytes
    keep_alive: bool
    peer: Any
    http_version: str = "1.1"  # or "1.0"

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        return self.headers.get(name, default)


def parsed_request(method: str, target: bytes, headers: dict[bytes, bytes], body: bytes, keep_alive: bool, peer,
                   http_version: str = "1.1") -> Request:
    """The request for ``target`` (its path and query split apart, as text)."""
    path, _, query = target.partition(b"?")
    return Request(method, target, path.decode("latin-1"), query.decode("latin-1"), headers, body, keep_alive, peer,
                   http_version)


class FlowListener:
    """Told when the client's socket buffer is full or drained (relay back-pressure)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class ResponseChannel(Protocol):
    """What a response needs of its client connection (``HttpServerProtocol``): kept
    narrow so that this module does not import the protocol that imports it."""

    transport: asyncio.Transport
    closed: bool
    writing_paused: bool

    def response_finished(self, writer: ResponseWriter) -> None: ...

    def abort(self) -> None: ...

    async def drain(self) -> None: ...


class ResponseWriter:
    """Writes one response to the client connection.

    ``send`` writes a complete response. ``start`` / ``write`` / ``end`` write a
    chunked one, each call a single ``transport.write`` with no ``await``. (To an
    HTTP/1.0 client, which cannot parse chunked framing, the streamed body is sent
    as is and ends when the connection closes.) A class with slots, not a ``msgspec.Struct``
    as the other per-request records: a stream writes its attributes on every event, and a
    slot's store is specialised by the interpreter where a Struct's is not.
    """

    __slots__ = ("_conn", "_transport", "started", "finished", "status", "bytes_sent",
                 "keep_alive", "flow", "_head_only", "_chunked", "_held")

    def __init__(self, conn: ResponseChannel, keep_alive: bool, head_only: bool = False,
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
        parts = [status_line(status), date_cache.get()]
        if headers:
            for name, value in headers:
                parts += (name, b": ", value, b"\r\n")
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
            extra += b"content-length: %d\r\n\r\n" % len(body)
        else:
            body = b""
            extra += b"\r\n"
        # _head's, inline: every whole answer.
        parts = [_STATUS_LINES.get(status) or status_line(status), date_cache.get()]
        if headers:
            for name, value in headers:
                parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(extra)
        data = b"".join(parts)
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
