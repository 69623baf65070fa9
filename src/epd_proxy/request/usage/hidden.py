"""A stream's usage event the proxy asked for and the client did not.

The proxy counts the tokens of every stream (access log, token metrics), so a stream
whose client did not ask for usage is sent to decode with ``stream_options.include_usage``
(stage_bodies.py ``stream_options_with_usage``), and the usage-only event that brings,
``data: {... "choices":[],"usage":{...}}`` before ``data: [DONE]``, is taken out here.
The client's bytes are then the ones vLLM would have sent without the option, which
differ in one more place: with ``include_usage`` vLLM stamps ``system_fingerprint`` on
the usage event instead of on the events that carry a ``finish_reason``. So from the
first finishing event on, events are held until the usage event arrives, and the
fingerprint it carries is put back on them, where vLLM would have written it (the last
key: ``...,"system_fingerprint":"..."}``). With ``n`` > 1 the choices still running after
the first one finishes reach the client with the usage event; with ``n`` = 1 the finishing
event is the last but one, so nothing is delayed but that event, by the usage event's gap.
Pure: the relay feeds it whole events.
"""

from __future__ import annotations

import msgspec

_USAGE_EVENT = b'"choices":[],"usage":'
FINISHED = b'"finish_reason":"'  # a string value: a quote in generated text is escaped


class _Fingerprint(msgspec.Struct):
    system_fingerprint: msgspec.Raw = msgspec.Raw(b"")


def _fingerprint(event: bytes) -> bytes:
    """The raw JSON string of the usage event's ``system_fingerprint`` (b"" when absent)."""
    if event.find(b'"system_fingerprint":') < 0:
        return b""
    try:
        raw = bytes(msgspec.json.decode(event[6:].rstrip(), type=_Fingerprint).system_fingerprint)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return b""
    return raw if raw.startswith(b'"') else b""


def stamp_fingerprint(events: bytes, fingerprint: bytes) -> bytes:
    """``events`` with ``"system_fingerprint":FINGERPRINT`` added as the last key of each
    event that carries a finish_reason (what vLLM writes without ``include_usage``)."""
    if not fingerprint or events.find(FINISHED) < 0:
        return events
    out = []
    for event in events.split(b"\n\n"):
        if event.startswith(b"data: {") and event.endswith(b"}") and event.find(FINISHED) >= 0:
            event = event[:-1] + b',"system_fingerprint":' + fingerprint + b"}"
        out.append(event)
    return b"\n\n".join(out)


def split_usage_event(events: bytes) -> tuple[bytes, bytes]:
    """``(events without the usage-only event, that event)``; ``(events, b"")`` without one."""
    at = events.find(_USAGE_EVENT)
    if at < 0:
        return events, b""
    start = events.rfind(b"\n\n", 0, at)
    start = 0 if start < 0 else start + 2
    if not events.startswith(b"data: {", start):
        return events, b""
    end = events.find(b"\n\n", at)
    end = len(events) if end < 0 else end + 2
    return events[:start] + events[end:], events[start:end]


class HiddenUsage:
    """Takes the usage event out of one stream, and puts the fingerprint back (see above)."""

    __slots__ = ("held", "usage")

    def __init__(self) -> None:
        self.held = b""  # events from the first finishing one on, until the usage event
        self.usage = b""  # the usage event, once seen

    def feed(self, events: bytes) -> bytes:
        """Whole events from decode in; what the client gets now out."""
        if self.usage:
            return events  # [DONE] after it
        if self.held:
            events, self.held = self.held + events, b""
        elif events.find(FINISHED) < 0 and events.find(_USAGE_EVENT) < 0:
            return events  # every event but the last few
        if events.find(_USAGE_EVENT) >= 0:
            kept, usage = split_usage_event(events)
            if usage:
                self.usage = usage
                return stamp_fingerprint(kept, _fingerprint(usage))
        at = events.find(FINISHED)
        cut = events.rfind(b"\n\n", 0, at)
        cut = 0 if cut < 0 else cut + 2
        self.held = events[cut:]
        return events[:cut]

    def flush(self) -> bytes:
        """The stream ended without a usage event: what is held goes out as received."""
        held, self.held = self.held, b""
        return held
