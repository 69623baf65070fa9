"""The end-of-request record: one generation request as it ends, what the metrics, the access
log and the trace are told about it. The pipeline fills it as the request goes; the stages'
timings and the instances used are the request context's, read once at the end."""

from __future__ import annotations

from typing import Any


class RequestRecord:
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
    ``tokens``: the answer's tokens, when read before the end."""

    __slots__ = ("start", "request_id", "method", "path", "stream", "outcome", "answer", "ctx", "peer",
                 "headers", "key", "model", "series", "hide_usage", "first_byte", "gap", "items",
                 "ticket", "moves", "tokens")

    def __init__(self, request_id: str, method: str, path: str, start: float, peer=None, headers=None,
                 key: str | None = None, series: Any = None) -> None:
        self.start = start  # perf_counter at arrival
        self.request_id = request_id
        self.method = method
        self.path = path
        self.stream = False
        self.outcome = "error"
        self.answer: bytes | None = None
        self.ctx: Any = None  # the RequestContext, once the body is parsed (legs, timings, trace)
        self.peer = peer
        self.headers = headers
        self.key = key
        self.model: str | None = None
        self.series = series
        self.hide_usage = False
        self.first_byte: float | None = None
        self.gap: float | None = None
        self.items = 0
        self.ticket: Any = None
        # A stream continued on another decode: (reason, result, from, to, seconds) per move
        # (request/migration.py); None: never moved.
        self.moves: list | None = None
        # The answer's tokens (observe/tokens.py), when the client's usage rewrite read them on the
        # way (request/answer.py); None: read from ``answer`` at the end.
        self.tokens: tuple | None = None
