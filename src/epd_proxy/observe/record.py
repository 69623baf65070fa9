"""The end-of-request record: one generation request as it ends, what the metrics, the access
log and the trace are told about it. The pipeline fills it as the request goes; the stages'
timings and the instances used are the request context's, read once at the end."""

from __future__ import annotations

from typing import Any

import msgspec


class RequestRecord(msgspec.Struct, eq=False):
    """One generation request: its id, what it asked (``path``, ``stream``), how it ended
    (``outcome``: ok, in_band_error, client_gone, shutdown, error) and ``answer``, the bytes
    holding the usage object (a whole answer or a stream's last reads). Who asked: ``peer``
    (the transport's peername) and ``headers`` (for X-Forwarded-For), read only when an
    access-log line is written; ``key``, the name of the client key it presented; ``model``,
    the body's; ``series``, the metrics' series of its model (``ProxyMetrics.model``), set once the
    cluster's catalog accepted the model (until then, and for a refused one, the no-model
    series). ``hide_usage``: the proxy asked decode for a usage event the client did not.
    ``first_byte``: seconds from arrival to the commit (None: never committed); ``gap``: a
    stream's mean gap between events; ``items``: its media items (the console's, recent.py);
    ``ticket``: its key's tenancy (tenants/limiter.py: the class the access log shows), if any;
    ``tokens``: the answer's tokens, when read before the end. A ``msgspec.Struct``: built in C,
    without the ``__init__`` frame a class pays on every request."""

    request_id: str
    method: str
    path: str
    start: float  # perf_counter at arrival
    peer: Any = None
    headers: Any = None
    key: str | None = None
    series: Any = None
    stream: bool = False
    outcome: str = "error"
    answer: bytes | None = None
    ctx: Any = None  # the RequestContext, once the body is parsed (legs, timings, trace)
    model: str | None = None
    hide_usage: bool = False
    first_byte: float | None = None
    gap: float | None = None
    items: int = 0
    ticket: Any = None
    # A stream continued on another decode: (reason, result, from, to, seconds) per move
    # (request/migration.py); None: never moved.
    moves: list | None = None
    # The answer's tokens (observe/tokens.py), when the client's usage rewrite read them on the
    # way (request/answer.py); None: read from ``answer`` at the end.
    tokens: tuple | None = None
