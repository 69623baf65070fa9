"""Test peers for the HTTP layer: a raw asyncio server and a strict, independent
HTTP/1.1 message reader (so the layer is never checked against itself)."""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass, field


class Incomplete(Exception):
    """The peer closed the connection before the message was complete."""

    def __init__(self, message: str, partial: bytes = b"") -> None:
        super().__init__(message)
        self.partial = partial


# -- building requests -----------------------------------------------------------------
def request_bytes(method: str = "GET", target: str = "/", *, headers=(), body: bytes = b"",
                  version: str = "HTTP/1.1", host: bool = True, length: bool | None = None) -> bytes:
    lines = [f"{method} {target} {version}".encode()]
    if host:
        lines.append(b"Host: test")
    for name, value in headers:
        lines.append(_b(name) + b": " + _b(value))
    if length or (length is None and (body or method in ("POST", "PUT"))):
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"


def _b(v) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


# -- reading messages ------------------------------------------------------------------
@dataclass
class RawMessage:
    start_line: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    chunks: list[bytes] = field(default_factory=list)  # chunked framing, as sent
    raw_head: bytes = b""

    def header(self, name: bytes) -> bytes | None:
        name = name.lower()
        values = [v for n, v in self.headers if n == name]
        return b", ".join(values) if values else None

    def header_names(self) -> list[bytes]:
        return [n for n, _ in self.headers]

    @property
    def status(self) -> int:
        return int(self.start_line.split(b" ", 2)[1])

    @property
    def method(self) -> str:
        return self.start_line.split(b" ", 1)[0].decode()

    @property
    def target(self) -> str:
        return self.start_line.split(b" ", 2)[1].decode()


async def read_head(reader: asyncio.StreamReader) -> RawMessage | None:
    """A start line and headers; ``None`` on a clean EOF before any byte."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise Incomplete("EOF inside the head", exc.partial) from None
    lines = raw[:-4].split(b"\r\n")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        assert sep, f"bad header line {line!r}"
        headers.append((name.strip().lower(), value.strip()))
    return RawMessage(lines[0], headers, raw_head=raw)


async def _read_chunked(reader: asyncio.StreamReader, msg: RawMessage) -> None:
    body = bytearray()
    try:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line[:-2].split(b";")[0], 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers
                break
            data = await reader.readexactly(size)
            crlf = await reader.readexactly(2)
            assert crlf == b"\r\n", f"chunk not followed by CRLF: {crlf!r}"
            msg.chunks.append(data)
            body += data
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise Incomplete(f"chunked body cut short: {exc!r}", bytes(body)) from None
    msg.body = bytes(body)


async def read_body(reader: asyncio.StreamReader, msg: RawMessage, *, no_body: bool = False) -> None:
    if no_body:
        return
    te = (msg.header(b"transfer-encoding") or b"").lower()
    cl = msg.header(b"content-length")
    if b"chunked" in te:
        await _read_chunked(reader, msg)
    elif cl is not None:
        try:
            msg.body = await reader.readexactly(int(cl))
        except asyncio.IncompleteReadError as exc:
            raise Incomplete("content-length body cut short", exc.partial) from None
    elif msg.start_line.startswith(b"HTTP/"):
        msg.body = await read_to_eof(reader)  # close-delimited response


async def read_request(reader: asyncio.StreamReader) -> RawMessage | None:
    msg = await read_head(reader)
    if msg is None:
        return None
    await read_body(reader, msg)
    return msg


async def read_response(reader: asyncio.StreamReader, *, head: bool = False,
                        interim: bool = False) -> RawMessage:
    """The next response. 1xx interim responses are skipped unless ``interim``."""
    while True:
        msg = await read_head(reader)
        if msg is None:
            raise Incomplete("EOF before a response")
        if 100 <= msg.status < 200 and not interim:
            continue
        break
    await read_body(reader, msg, no_body=head or msg.status in (204, 304) or msg.status < 200)
    return msg


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        try:
            data = await reader.read(65536)
        except ConnectionError:
            break
        if not data:
            break
        out += data
    return bytes(out)


async def wait_disconnect(reader: asyncio.StreamReader, timeout: float = 2.0) -> bytes:
    """Read until the peer closes or resets; returns what arrived meanwhile. Fails on timeout."""
    return await asyncio.wait_for(read_to_eof(reader), timeout)


async def connect(port: int, **kw):
    return await asyncio.open_connection("127.0.0.1", port, **kw)


async def exchange(port: int, data: bytes, *, n: int = 1, head: bool = False):
    """Send ``data`` on a fresh connection and read ``n`` responses."""
    r, w = await connect(port)
    w.write(data)
    out = [await asyncio.wait_for(read_response(r, head=head), 2) for _ in range(n)]
    return out, r, w


def send_fin_now(writer: asyncio.StreamWriter) -> None:
    """Half-close the socket synchronously (``write_eof`` may defer the FIN a loop round)."""
    fd = writer.get_extra_info("socket").fileno()
    s = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)  # a dup: shutdown acts on the socket
    try:
        s.shutdown(socket.SHUT_WR)
    finally:
        s.close()


def set_rst_on_close(writer: asyncio.StreamWriter) -> None:
    """Make ``close()`` send a TCP RST instead of a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# -- a raw server ----------------------------------------------------------------------
class RawConn:
    def __init__(self, index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.index = index
        self.reader = reader
        self.writer = writer
        self.peer = writer.get_extra_info("peername")
        self.requests: list[RawMessage] = []
        self.closed = asyncio.Event()  # set when the handler returned

    async def request(self) -> RawMessage | None:
        msg = await read_request(self.reader)
        if msg is not None:
            self.requests.append(msg)
        return msg

    def send(self, data: bytes) -> None:
        self.writer.write(data)


class RawServer:
    """``asyncio.start_server`` with a per-connection handler ``async def h(conn: RawConn)``.

    Records every accepted connection so tests can count them and check reuse.
    """

    def __init__(self, handler) -> None:
        self.handler = handler
        self.conns: list[RawConn] = []
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._changed = asyncio.Event()

    async def start(self) -> "RawServer":
        self._server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _on_conn(self, reader, writer) -> None:
        conn = RawConn(len(self.conns), reader, writer)
        self.conns.append(conn)
        self._changed.set()
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self.handler(conn)
        except (ConnectionError, asyncio.IncompleteReadError, Incomplete, asyncio.CancelledError):
            pass  # cancelled by close(): end quietly
        finally:
            self._tasks.discard(task)
            conn.closed.set()
            writer.close()

    async def wait_conns(self, n: int, timeout: float = 2.0) -> None:
        async def _wait():
            while len(self.conns) < n:
                self._changed.clear()
                await self._changed.wait()
        await asyncio.wait_for(_wait(), timeout)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for c in self.conns:
            c.writer.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1)
        self._server = None


def all_requests(server: RawServer) -> list[tuple[int, str]]:
    """(connection index, target) of every request the raw server read, in order per connection."""
    return [(c.index, r.target) for c in server.conns for r in c.requests]


class Recorder:
    """A BodySink that records what it is told, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self.done = asyncio.Event()

    def on_data(self, data: bytes) -> None:
        assert not self.done.is_set(), "on_data after the end"
        self.events.append(("data", bytes(data)))

    def on_end(self) -> None:
        assert not self.done.is_set(), "on_end after the end"
        self.events.append(("end", None))
        self.done.set()

    def on_error(self, exc: Exception) -> None:
        assert not self.done.is_set(), "on_error after the end"
        self.events.append(("error", exc))
        self.done.set()

    @property
    def data(self) -> bytes:
        return b"".join(d for k, d in self.events if k == "data")

    @property
    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]
