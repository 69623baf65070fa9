"""The ``Server-Timing`` header of a generation answer: the stages' times, the model that
answered and, for a multi-turn turn, its reuse outcome. Pure, but for one small cache: a
model's part is made once and kept, as clients name few models (and may name anything, so
the cache is bounded)."""

from __future__ import annotations

from urllib.parse import quote

from epd_proxy.http import Headers

_DESCRIBED = 1024  # models whose Server-Timing part is kept


class ServerTiming:
    """Builds the header; keeps each model's ``model;desc=...`` part for the next request."""

    __slots__ = ("_described",)

    def __init__(self) -> None:
        self._described: dict[str, bytes] = {}

    def header(self, timings: dict, model: str | None, kv_outcome: str | None) -> Headers:
        desc = None
        if model is not None:
            desc = self._described.get(model)
            if desc is None:
                if len(self._described) >= _DESCRIBED:
                    self._described.clear()
                desc = self._described[model] = model_timing(model)
        if kv_outcome is not None:  # the turn's reuse outcome (request/turns/outcomes.py)
            desc = (desc or b"") + b', kv;desc="%s"' % kv_outcome.encode()
        return server_timing(timings, desc)


def model_timing(model: str) -> bytes:
    """``, model;desc="<model>"``: a name outside printable ASCII, or with a quote or a
    backslash, percent-encoded, so the header stays one safe line."""
    if not (model.isascii() and model.isprintable()) or '"' in model or "\\" in model:
        model = quote(model, safe="")
    return b', model;desc="%s"' % model.encode()


def server_timing(timings: dict, model: bytes | None) -> Headers:
    """The stages' times and the model that answered (``model``: its ``model_timing``),
    e.g. ``prefill;dur=12.0, decode_first;dur=3.1, model;desc="llama"``."""
    # %-formatting of bytes: this runs once per request, and an f-string per stage, joined
    # and encoded, cost twice as much; a loop, not a list comprehension (its own frame).
    parts = []
    for k, v in timings.items():
        parts.append(b"%s;dur=%.1f" % (k.encode(), v * 1000))
    value = b", ".join(parts)
    if model is not None:
        value = value + model if value else model[2:]
    return [(b"server-timing", value)] if value else []
