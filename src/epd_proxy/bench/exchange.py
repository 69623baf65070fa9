"""One request and its answer: send it, read the answer (an SSE stream or one JSON
body), time it and verify its text. :class:`Outcome` is what a request turned into.

A streamed body is taken in relay mode: the sink only appends
``(perf_counter(), bytes)`` per received piece, with no ``await`` per chunk; the
SSE events are parsed once, after the stream ended, to timestamp each token (the
time of the piece that completed its event) and to verify the text against the
simulator's deterministic output. The load generator (:mod:`epd_proxy.bench.loadgen`)
and the clients (:mod:`epd_proxy.bench.clients`) both build on this.
"""

from __future__ import annotations

import time
from typing import Sequence

import msgspec

from epd_proxy.bench.workloads import Prepared
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts, UpstreamError

perf = time.perf_counter
_JSON_HEADERS = [(b"content-type", b"application/json")]


class _Delta(msgspec.Struct):
    content: str | None = None


class _Message(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    message: _Message | None = None
    text: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    error: object = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _content(chunk: _Chunk) -> str | None:
    for c in chunk.choices:
        if c.index != 0:
            continue
        if c.delta is not None:
            return c.delta.content
        if c.message is not None:
            return c.message.content
        return c.text
    return None


class _TextDelta(msgspec.Struct):
    text: str | None = None


class _MessagesDelta(msgspec.Struct):
    delta: _TextDelta | None = None


class _ResponsesDelta(msgspec.Struct):
    delta: str | None = None


class _Text(msgspec.Struct):
    text: str | None = None


class _MessagesAnswer(msgspec.Struct):
    content: list[_Text] = []


class _OutputItem(msgspec.Struct):
    content: list[_Text] = []


class _ResponsesAnswer(msgspec.Struct):
    output: list[_OutputItem] = []


# Per named-event API (the workload kind): the event carrying text, its decoder and reader,
# the event that ends a stream, the events that are failures, and the whole answer's text.
_NAMED = {
    "messages": (b"content_block_delta", msgspec.json.Decoder(_MessagesDelta).decode,
                 lambda e: e.delta.text if e.delta is not None else None, b"message_stop", (b"error",),
                 lambda data: "".join(c.text or "" for c in msgspec.json.decode(data, type=_MessagesAnswer).content)),
    "responses": (b"response.output_text.delta", msgspec.json.Decoder(_ResponsesDelta).decode,
                  lambda e: e.delta, b"response.completed", (b"error", b"response.failed"),
                  lambda data: "".join(c.text or "" for item in msgspec.json.decode(data, type=_ResponsesAnswer).output
                                       for c in item.content)),
}


def parse_named_sse(pieces: Sequence[tuple[float, bytes]], kind: str) -> tuple[list[tuple[float, str]], bool,
                                                                                 str | None]:
    """:func:`parse_sse` for a stream of named events (Messages, Responses): the text events,
    whether the API's last event came, and an in-band error."""
    text_event, decode, text_of, last, failures = _NAMED[kind][:5]
    out: list[tuple[float, str]] = []
    done = False
    error: str | None = None
    events, cut = sse_events(pieces)
    for t, event in events:
        head, _, payload = event.partition(b"\n")
        name = head[6:].strip() if head.startswith(b"event:") else b""
        if name == text_event:
            try:
                text = text_of(decode(payload[5:].lstrip(b" ")))
            except (msgspec.DecodeError, msgspec.ValidationError):
                error = error or "undecodable SSE event"
                continue
            if text:
                out.append((t, text))
        elif name == last:
            done = True
        elif name in failures:
            error = error or f"in-band error: {payload[5:205].decode('utf-8', 'replace')}"
    if cut:
        error = error or "stream ended inside an event"
    return out, done, error


def sse_events(pieces: Sequence[tuple[float, bytes]]) -> tuple[list[tuple[float, bytes]], bool]:
    """The whole events of an SSE body received in ``pieces``, each with the time of the piece
    that completed it, and whether the body ended inside an event."""
    events: list[tuple[float, bytes]] = []
    buf = b""
    for t, data in pieces:
        buf = buf + data if buf else data
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            events.append((t, buf[start:end]))
            start = end + 2
        buf = buf[start:]
    return events, bool(buf.strip())


class Outcome:
    """What one request turned into."""

    __slots__ = ("kind", "t_send", "t_end", "ttft", "itl", "tokens", "error", "verify_error", "nbytes",
                 "server_timing", "status", "text")

    def __init__(self, kind: str, t_send: float) -> None:
        self.kind = kind
        self.t_send = t_send
        self.t_end = t_send
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.tokens = 0
        self.error: str | None = None  # None = success
        self.verify_error = False  # the text differs from the expected one
        self.nbytes = 0
        self.server_timing: bytes | None = None
        self.status = 0
        self.text: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e(self) -> float:
        return self.t_end - self.t_send


def parse_sse(pieces: Sequence[tuple[float, bytes]]) -> tuple[list[tuple[float, str]], bool, str | None]:
    """(content events as (time, text), saw ``[DONE]``, in-band error) of a relayed SSE body.

    An event's time is that of the piece that completed it. Events without
    content (the role event, a usage chunk) are not listed."""
    out: list[tuple[float, str]] = []
    done = False
    error: str | None = None
    events, cut = sse_events(pieces)
    for t, event in events:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].lstrip(b" ")
            if payload == b"[DONE]":
                done = True
                continue
            try:
                chunk = _decode_chunk(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                error = error or "undecodable SSE event"
                continue
            if chunk.error is not None:
                error = error or f"in-band error: {str(chunk.error)[:200]}"
                continue
            text = _content(chunk)
            if text:
                out.append((t, text))
    if cut:
        error = error or "stream ended inside an event"
    return out, done, error


class _Sink:
    """Relay-mode body sink: timestamps each received piece, nothing else."""

    __slots__ = ("pieces",)

    def __init__(self) -> None:
        self.pieces: list[tuple[float, bytes]] = []

    def on_data(self, data: bytes) -> None:
        self.pieces.append((perf(), data))

    def on_end(self) -> None:
        pass

    def on_error(self, exc: Exception) -> None:
        pass


async def send(pool: ConnectionPool, prep: Prepared, timeouts: TransportTimeouts, *, verify: bool = True,
               keep_text: bool = False, headers: list | None = None) -> Outcome:
    """One request; never raises except on cancellation."""
    out = Outcome(prep.kind, perf())
    try:
        resp = await pool.request("POST", prep.path, body=prep.body, headers=headers or _JSON_HEADERS,
                                  timeouts=timeouts)
    except UpstreamError as exc:
        out.t_end = perf()
        out.error = f"{exc.kind}: {exc}"[:200]
        return out
    out.status = resp.status
    out.server_timing = resp.headers.get(b"server-timing")
    try:
        if resp.status != 200:
            try:
                data = await resp.read()
            except UpstreamError:
                data = b""
            out.t_end = perf()
            out.error = f"HTTP {resp.status}: {data[:160].decode('utf-8', 'replace')}"
            return out
        ctype = resp.content_type or b""
        if prep.stream and ctype.startswith(b"text/event-stream"):
            sink = _Sink()
            resp.relay(sink)
            try:
                await resp.wait()
            except UpstreamError as exc:
                out.t_end = perf()
                out.error = f"stream broke off: {exc}"[:200]
                return out
            out.t_end = perf()
            named = prep.kind in _NAMED
            events, done, error = parse_named_sse(sink.pieces, prep.kind) if named else parse_sse(sink.pieces)
            out.nbytes = sum(len(d) for _, d in sink.pieces)
            if events:
                out.ttft = events[0][0] - out.t_send
                prev = events[0][0]
                itl = out.itl
                for t, _ in events[1:]:
                    itl.append(t - prev)
                    prev = t
            out.tokens = len(events)
            if error is not None:
                out.error = error
            elif not done:
                out.error = "stream ended without its last event" if named else "stream ended without [DONE]"
            text = "".join(t for _, t in events)
        else:
            try:
                data = await resp.read()
            except UpstreamError as exc:
                out.t_end = perf()
                out.error = f"body broke off: {exc}"[:200]
                return out
            out.t_end = perf()
            out.nbytes = len(data)
            if prep.stream:
                out.error = f"expected an event stream, got {ctype.decode('latin-1')!r}"
                return out
            try:
                text = _NAMED[prep.kind][5](data) if prep.kind in _NAMED else _content(_decode_chunk(data)) or ""
            except (msgspec.DecodeError, msgspec.ValidationError):
                out.error = "undecodable JSON answer"
                return out
            out.ttft = out.e2e
            out.tokens = 1
        if keep_text:
            out.text = text
        if verify and prep.expected is not None and out.error is None and text != prep.expected:
            out.verify_error = True
            out.error = "verification: text differs from the simulator's"
            out.text = text
        return out
    finally:
        resp.close()
