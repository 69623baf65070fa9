"""Relaying decode's SSE stream to the client, from the upstream protocol callback.

Bytes go out as they arrive, with one exception: a trailing partial event is
held back until its end arrives (usually in the next TCP read). The byte
stream is unchanged, but a failure can then always be reported as a clean,
separate error event in the API's form (``data: {"error": ...}`` and ``data: [DONE]``
for chat; ``apis.py`` for the others) instead of being glued to half an event.
"""

from __future__ import annotations

import asyncio
from collections import deque
from time import perf_counter
from typing import Callable, TypeVar

import msgspec

from epd_proxy.http import Headers
from epd_proxy.http.client import Response
from epd_proxy.http.response import FlowListener, ResponseWriter
from epd_proxy.request.apis import GenerationApi
from epd_proxy.request.turns.answers import strip_token_ids
from epd_proxy.request.turns.streams import MARK, strip_stream_params
from epd_proxy.request.usage.hidden import FINISHED, HiddenUsage
from epd_proxy.request.usage.rewrite import rewrite_final_usage_events
from epd_proxy.wire.errors import ProxyError

# A "partial event" larger than this is not SSE framing we understand: pass it on.
_MAX_HELD = 1 << 20
# What a relay keeps of the reads it relayed when its stream is not continued elsewhere
# (``migration.py``): nothing (appending to it is a no-op).
NOWHERE: deque = deque(maxlen=0)
# Where decode's own named error event is looked for in a read of a stream that may move: the
# read's last bytes (the event ends decode's stream).
_ERROR_TAIL = 4096
# The start of decode's own in-band error event in a chat or completions stream.
ERROR_EVENT = b'data: {"error"'
# How vLLM ends a chat or completions event whose choice has not finished (pydantic with
# ``exclude_unset``: nothing is set after ``finish_reason`` until the finish).
_UNFINISHED_ENDS = (b'"finish_reason":null}]}\n\n', b'"finish_reason":null,"token_ids":null}]}\n\n',
                    b'"finish_reason":null,"stop_reason":null}]}\n\n')


class StreamRelay(FlowListener):
    """Upstream body sink + client flow listener for one committed stream."""

    __slots__ = ("writer", "resp", "_tail", "error", "ended", "events", "first_at", "last_at", "prev",
                 "last", "sent", "migrate", "broken", "said")

    def __init__(self, writer: ResponseWriter, resp: Response) -> None:
        self.writer = writer
        self.resp: Response | None = resp
        self._tail = b""
        self.error: ProxyError | None = None
        self.ended = False
        # For the inter-token histogram: reads relayed after the first, and when. Reads, not
        # events: counting the events of each read costs a bytes.count() call per chunk, and
        # events that arrive in one read reach the client together anyway.
        self.events = 0
        self.first_at = self.last_at = 0.0
        self.prev = self.last = b""  # the last two reads: where the final usage event is
        # A stream that may be continued elsewhere (migration.py): the reads relayed, kept by
        # reference (parsed only if it breaks), and why it broke (then the relay ends nothing:
        # the continuation does). Otherwise a sink that keeps nothing.
        self.sent: list[bytes] | deque = NOWHERE
        self.migrate = False
        self.broken: str | None = None
        self.said: str | None = None  # decode's own error message, when that broke the stream

    def final_bytes(self) -> bytes:
        return self.prev + self.last

    def gap(self) -> float | None:
        """The mean time between the reads relayed after the first (None with fewer than two)."""
        return (self.last_at - self.first_at) / self.events if self.events else None

    # -- BodySink ---------------------------------------------------------------------
    def on_data(self, data: bytes) -> None:
        self.events += 1
        self.prev, self.last = self.last, data
        if self._tail:
            data = self._tail + data
            self._tail = b""
        if data.endswith(b"\n\n"):
            self.writer.write(data)
            return
        self._write_whole(data)

    def _write_whole(self, data: bytes) -> None:
        """The whole events of ``data`` out; a partial last event kept for the next read."""
        events = self._whole_events(data)
        if events:
            self.writer.write(events)

    def _whole_events(self, data: bytes) -> bytes:
        """The whole events of ``data``, its partial last event kept as the tail for the next
        read (b"" when there is none whole; an oversized partial event goes out as it is)."""
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if len(data) > _MAX_HELD:
                self.writer.write(data)
            else:
                self._tail = data
            return b""
        self._tail = data[cut + 2:]
        return data[: cut + 2]

    def on_end(self) -> None:
        if self.broken is not None:
            return
        if self.migrate:  # the body ended cleanly without its terminator (vLLM always sends one)
            self.broken = "eof"
            return
        self.ended = True
        tail, self._tail = self._tail, b""
        self.writer.end(tail)

    def on_error(self, exc: Exception) -> None:
        if self.migrate or self.broken is not None:
            if self.broken is None:
                self.broken = "reset"
            return
        self.fail(ProxyError(502, f"decode stream broke off: {exc}"))

    def break_off(self, reason: str) -> None:
        """The stream is broken (``reason``): decode's response closed, the client told nothing
        (the continuation goes on from what it has)."""
        if self.broken is None and not self.ended:
            self.broken = reason
            self._tail = b""
            if self.resp is not None:
                self.resp.close()

    def fail(self, error: ProxyError) -> None:
        """End a committed stream with an in-band error event (the partial event is dropped)."""
        if self.ended:
            return
        self.ended = True
        self.error = error
        self._tail = b""
        self.writer.end(self.error_event(error))

    def error_event(self, error: ProxyError) -> bytes:
        return error.sse_event()

    # -- FlowListener: a slow client throttles the upstream read ----------------------------
    def pause(self) -> None:
        if self.resp is not None:
            self.resp.pause_reading()

    def resume(self) -> None:
        if self.resp is not None:
            self.resp.resume_reading()


class ApiRelay(StreamRelay):
    """A relay whose in-band error is another API's form (apis.py: Anthropic's ``event:
    error``, the Responses ``error`` event); with ``ctx`` (P/D) the usage of the API's final
    usage event is the client's (usage/api_fields.py), every other byte as received."""

    __slots__ = ("api", "ctx", "plain", "head")

    def __init__(self, writer: ResponseWriter, resp: Response, api: GenerationApi, ctx=None,
                 head: bytes = b"") -> None:
        super().__init__(writer, resp)
        self.api = api
        self.ctx = ctx  # its prefill_report may arrive while streaming (push mode's prefill)
        self.plain = api.text_delta_ends
        self.head = head  # the stream's first read: the response an in-band error ends (Responses)

    def error_event(self, error: ProxyError) -> bytes:
        return self.api.in_band_error(error, self.final_bytes(), self.head)

    def on_data(self, data: bytes) -> None:
        # StreamRelay's, with decode's parameters taken out of the event that carries them
        # (vLLM 0.32's Responses stream ends with the whole answer, parameters included), and
        # with ``ctx`` the usage event's usage the client's.
        self.events += 1
        self.prev, self.last = self.last, data
        if self._tail:
            data = self._tail + data
            self._tail = b""
        elif data.endswith(self.plain):  # most reads: a text delta; the last event is still to come
            self.writer.write(data)
            return
        events = data if data.endswith(b"\n\n") else self._whole_events(data)
        if not events:
            return
        if events.find(MARK) >= 0:
            events = strip_stream_params(events)[0]
        foreign = self.api.foreign_error
        if foreign and events.find(foreign) >= 0:  # decode's own in-band error, in the API's types
            events = self.api.own_error_event(events)
        if self.ctx is not None and events.find(b'"usage":{') >= 0:
            report = self.ctx.prefill_report
            if report is not None:
                events = self.api.client_events(events, report)
        self.writer.write(events)


class MovingApiRelay(ApiRelay):
    """An ApiRelay for a stream continued elsewhere when its decode breaks off (migration.py:
    Messages, Responses): every read kept by reference in ``sent`` in place of the two-read
    window (the same work per read: a stream that never breaks pays no more per event), decode's
    own error event a break, the final usage event the end of what may move. ``ctx`` is the
    request's context."""

    __slots__ = ()

    def final_bytes(self) -> bytes:
        sent = self.sent  # the last two reads only once the stream was let go (too long to keep)
        if isinstance(sent, list):
            return b"".join(sent[-2:])
        return b"".join(sent) or self.prev + self.last

    def on_data(self, data: bytes) -> None:
        # ApiRelay's (kept in step with it), with the reads kept and the two checks of a stream
        # that may move where a read is looked at anyway (not a text delta).
        self.events += 1
        self.sent.append(data)
        if self._tail:
            data = self._tail + data
            self._tail = b""
        elif data.endswith(self.plain):
            self.writer.write(data)
            return
        events = data if data.endswith(b"\n\n") else self._whole_events(data)
        if not events:
            return
        if events.find(MARK) >= 0:
            events = strip_stream_params(events)[0]
        # Decode's own in-band error ends decode's stream: it is in the read's last bytes (a
        # bounded search, not the whole read).
        if self.migrate and events.find(b"event: error\n", max(len(events) - _ERROR_TAIL, 0)) >= 0:
            self._errored_named(events)
            return
        foreign = self.api.foreign_error
        if foreign and events.find(foreign) >= 0:
            events = self.api.own_error_event(events)
        if events.find(b'"usage":{') >= 0:
            if self.migrate and events.find(self.api.ending) >= 0:  # the final usage event
                self.migrate = False  # the answer is whole: nothing is left to continue
            report = self.ctx.prefill_report
            if report is not None:
                events = self.api.client_events(events, report)
        self.writer.write(events)

    def _errored_named(self, events: bytes) -> None:
        """Decode's own in-band error among named events: the events before it out, the stream
        broken."""
        cut = events.find(b"event: error\n")
        if cut > 0:
            self.writer.write(events[:cut])
        self.said = error_message(events[max(cut, 0):])
        self.break_off("error")


class UsageRelay(StreamRelay):
    """A relay that rewrites the usage of decode's final usage event (usage/rewrite.py), for a P/D
    stream, and with ``hidden`` takes that event out (usage/hidden.py: the client did not
    ask for it); every other byte goes out as received."""

    __slots__ = ("ctx", "hidden", "ending", "plain")

    # What the first event this relay may change carries: the usage event and the events
    # whose fingerprint moves (usage/hidden.py) all come at or after a choice's finish.
    ENDING = FINISHED

    def __init__(self, writer: ResponseWriter, resp: Response, ctx, hidden: HiddenUsage | None = None,
                 single_choice: bool = False) -> None:
        super().__init__(writer, resp)
        self.ctx = ctx  # its prefill_report may arrive while streaming (push mode's prefill)
        self.hidden = hidden
        self.ending = False  # a choice has finished: every event from here on is looked at
        # With one choice nothing follows its finishing event but the usage event and
        # [DONE], so a read that ends with an unfinished choice holds no finish: one
        # endswith instead of a search per read (any other ending is searched).
        self.plain = _UNFINISHED_ENDS if single_choice else ()

    def on_data(self, data: bytes) -> None:
        self.events += 1
        self.sent.append(data)  # the reads as received (a no-op unless the stream may move)
        if self._tail:
            data = self._tail + data
            self._tail = b""
        if not self.ending:
            if data.endswith(self.plain):
                self.writer.write(data)
                return
            if data.find(self.ENDING) < 0:
                # Until a choice finishes, nothing here changes an event: out as received, as
                # StreamRelay does (inline: this runs for every read of the stream).
                if self.migrate and data.find(ERROR_EVENT) >= 0:
                    self._errored(data)
                    return
                if data.endswith(b"\n\n"):
                    self.writer.write(data)
                else:
                    self._write_whole(data)
                return
            self.ending = True
            self.migrate = False  # the choice has finished: nothing is left to continue
        # From the first finish on (the stream's last few reads): whole events, looked at.
        events = self._whole_events(data)
        if not events:
            return
        report = self.ctx.prefill_report
        if report is not None and events.find(b'"usage"') >= 0:
            events = rewrite_final_usage_events(events, report)
        # What the client got, or with ``hidden`` what decode sent: its usage for the access
        # log (and decode's parameters, if it sent them: turns/streams.py).
        self.prev, self.last = self.last, events
        if events.find(MARK) >= 0:  # never a client's
            events = strip_stream_params(events)[0]
        if self.hidden is not None:
            events = self.hidden.feed(events)
            if not events:
                return
        self.writer.write(events)

    def _errored(self, data: bytes) -> None:
        """Decode's own in-band error event: the whole events before it out, the stream broken."""
        cut = data.find(ERROR_EVENT)
        if cut:
            self._write_whole(data[:cut])
        self.said = error_message(data[cut:])
        self.break_off("error")

    def on_end(self) -> None:
        self._flush_held()
        super().on_end()

    def fail(self, error: ProxyError) -> None:
        self._flush_held()
        super().fail(error)

    def _flush_held(self) -> None:
        """Events held for a usage event that did not come go out as received."""
        if self.hidden is not None and not self.ended:
            held = self.hidden.flush()
            if held:
                self.writer.write(held)


def error_message(events: bytes) -> str | None:
    """The message of the error event that starts ``events`` (vLLM's ``{"error": {"message"}}``
    or Anthropic's ``{"type": "error", "error": {"message"}}``), if it says one."""
    start = events.find(b"data: ")
    end = events.find(b"\n", start)
    try:
        event = msgspec.json.decode(events[start + 6:end if end >= 0 else len(events)])
    except msgspec.DecodeError:
        return None
    err = event.get("error") if isinstance(event, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    return message if isinstance(message, str) else None


_OnData = TypeVar("_OnData", bound=Callable)


class Keeping:
    """What makes a relay keep what decode sent (up to ``MAX_KEPT`` bytes), for the
    parameters of a stream's last event and the answer they hold (turns/streams.py): first
    among the bases of a relay class that names the slots ``reads`` and ``size`` and takes
    its ``on_data`` from :func:`keeping_on_data`."""

    __slots__ = ()
    reads: list[bytes] | None
    size: int

    def __init__(self, *args) -> None:
        super().__init__(*args)  # the relay's, next in the class's order
        # The slots are the relay class's (a mixin's own would clash with the relay's layout).
        self.reads = []  # type: ignore[misc]
        self.size = 0  # type: ignore[misc]


def keeping_on_data(relay_data: _OnData) -> _OnData:
    """A relay's ``on_data`` (``relay_data``) that keeps each read first. The relay's own is
    called through this closure, as directly as a call naming its class: nothing added per read."""
    def on_data(self, data: bytes) -> None:
        keep(self, data)
        relay_data(self, data)
    return on_data  # type: ignore[return-value]  # the same signature


class KeepingUsageRelay(Keeping, UsageRelay):
    """A UsageRelay that also keeps what decode sent."""

    __slots__ = ("reads", "size")
    on_data = keeping_on_data(UsageRelay.on_data)


class KeepingApiRelay(Keeping, ApiRelay):
    """An ApiRelay that also keeps what decode sent."""

    __slots__ = ("reads", "size")
    on_data = keeping_on_data(ApiRelay.on_data)


class KeepingMovingApiRelay(Keeping, MovingApiRelay):
    """A MovingApiRelay that also keeps what decode sent."""

    __slots__ = ("reads", "size")
    on_data = keeping_on_data(MovingApiRelay.on_data)


class IdStrippingRelay(KeepingUsageRelay):
    """A KeepingUsageRelay for a chat or completions stream whose decode the proxy asked for
    token ids the client did not ask for (``return_token_ids``: a decode that sends its
    parameters in a stream, turns/reuse.py). What decode sent is kept, ids and all, for the
    next turn; the client gets each event with the id lists as vLLM writes them when not
    asked (``null``: answers.strip_token_ids, two byte searches a read, no JSON decode), so
    it receives the bytes it would have had without them. Reads are cut at event ends first:
    a list may straddle two reads."""

    __slots__ = ("pending",)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.pending = b""

    def on_data(self, data: bytes) -> None:
        keep(self, data)
        if self.pending:
            data = self.pending + data
            self.pending = b""
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if len(data) <= _MAX_HELD:
                self.pending = data
                return
        elif cut + 2 < len(data):
            self.pending = data[cut + 2:]
            data = data[:cut + 2]
        UsageRelay.on_data(self, strip_token_ids(data))

    def on_end(self) -> None:
        pending, self.pending = self.pending, b""
        if pending and not self.ended:
            UsageRelay.on_data(self, strip_token_ids(pending))
        super().on_end()

    def fail(self, error: ProxyError) -> None:
        self.pending = b""
        super().fail(error)


# What a keeping relay holds of one stream at most (a longer answer is not kept for reuse).
MAX_KEPT = 8 << 20


def keep(relay, data: bytes) -> None:
    reads = relay.reads
    if reads is not None:
        relay.size += len(data)
        if relay.size > MAX_KEPT:
            relay.reads = None
        else:
            reads.append(data)


def kept_bytes(relay: StreamRelay) -> bytes | None:
    """What a keeping relay kept of decode's stream (None: not a keeping relay, or too long)."""
    reads = getattr(relay, "reads", None)
    return None if reads is None else b"".join(reads)


async def relay_stream(writer: ResponseWriter, relay: StreamRelay, first: bytes, headers: Headers,
                       companion: asyncio.Future | None = None) -> StreamRelay:
    """Commit the stream and relay it to the end through ``relay`` (composed for the request:
    ``answer.py``); returns it (``.error`` if it failed). ``companion``: the other leg still
    running (push connectors' prefill): its failure ends the stream in-band."""
    resp = relay.resp
    assert resp is not None
    # The head goes out with the first event, in one write (see ResponseWriter.start).
    writer.start(200, resp.content_type or b"text/event-stream", headers, hold=True)
    writer.flow = relay
    if writer.writing_paused:
        relay.pause()  # the client was already behind before the relay attached
    if first:
        relay.on_data(first)
    relay.events, relay.first_at = 0, perf_counter()
    writer.flush()  # the head, if the first event was held back whole
    if companion is not None:
        def companion_done(task: asyncio.Future) -> None:
            if task.cancelled() or relay.ended:
                return
            exc = task.exception()
            if exc is not None:
                # The other leg failed mid-stream: say so in-band, and stop decode.
                msg = exc.message if isinstance(exc, ProxyError) else str(exc)
                relay.fail(ProxyError(502, f"prefill failed after the stream started: {msg}"))
                resp.close()
        companion.add_done_callback(companion_done)
    try:
        resp.relay(relay)
        await resp.wait()
    except Exception:
        pass  # on_error has already ended the stream in-band
    finally:
        relay.last_at = perf_counter()
        # Cancelled (client gone) or done: nothing more to continue elsewhere (a break has been
        # seen by now); an unfinished upstream is aborted, so vLLM stops.
        relay.migrate = False
        resp.close()
        # The response holds the relay as its sink: without this link back the pair is no
        # reference cycle, and is freed with the request instead of by the collector.
        relay.resp = None
    return relay


class BodyRelay(FlowListener):
    """Upstream body sink + client flow listener for an answer passed on as it comes (no
    ``Content-Length``: e.g. a streamed transcription): every byte as received, and a broken
    upstream cuts the client's connection (the body's format is not ours to add an error to)."""

    __slots__ = ("writer", "resp", "error")

    def __init__(self, writer: ResponseWriter, resp: Response) -> None:
        self.writer = writer
        self.resp: Response | None = resp
        self.error: Exception | None = None

    def on_data(self, data: bytes) -> None:
        self.writer.write(data)

    def on_end(self) -> None:
        self.writer.end()

    def on_error(self, exc: Exception) -> None:
        self.error = exc
        self.writer.abort()

    def pause(self) -> None:
        if self.resp is not None:
            self.resp.pause_reading()

    def resume(self) -> None:
        if self.resp is not None:
            self.resp.resume_reading()


async def relay_body(writer: ResponseWriter, resp: Response, headers: Headers) -> BodyRelay:
    """Commit the instance's status and content type and relay its body to the end."""
    writer.start(resp.status, resp.content_type, headers, hold=True)
    relay = BodyRelay(writer, resp)
    writer.flow = relay
    if writer.writing_paused:
        relay.pause()
    try:
        resp.relay(relay)
        await resp.wait()
    except Exception:
        pass  # on_error has cut the connection
    finally:
        resp.close()
        relay.resp = None
        writer.flow = None
    return relay
