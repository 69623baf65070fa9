"""What an exchange with an upstream may raise, and its bounds.

``UpstreamError`` (and ``UpstreamTimeout``) are what ``client.ConnectionPool`` raises;
``TransportTimeouts`` bound each phase of one exchange; ``BodySink`` receives a
relayed body (``Response.relay``).
"""

from __future__ import annotations

from typing import Protocol


class UpstreamError(Exception):
    """Transport-level failure talking to an upstream (connect, reset, timeout)."""

    def __init__(self, message: str, *, kind: str = "connection", response_started: bool = False) -> None:
        super().__init__(message)
        # "connect", "connection", "timeout", "protocol"; "local" when this process ran out of
        # something (descriptors, buffers, memory): not the upstream's fault; "ejected" when
        # the pool gave up on a pending exchange (``ConnectionPool.fail_pending``).
        self.kind = kind
        self.response_started = response_started


class UpstreamTimeout(UpstreamError):
    def __init__(self, message: str, *, response_started: bool = False) -> None:
        super().__init__(message, kind="timeout", response_started=response_started)


class BodySink(Protocol):
    """Receives a relayed body. Called from the protocol callback: must not block."""

    def on_data(self, data: bytes) -> None: ...

    def on_end(self) -> None: ...

    def on_error(self, exc: Exception) -> None: ...


class TransportTimeouts:
    """How long to wait for each phase of one upstream exchange (seconds; None = forever).

    The transport's bounds; the operator's per-stage ones are ``config.StageTimeouts``,
    from which the stages build these."""

    __slots__ = ("connect", "headers", "idle")

    def __init__(self, connect: float | None = 10.0, headers: float | None = 600.0,
                 idle: float | None = 600.0) -> None:
        self.connect = connect
        self.headers = headers  # until the status line and headers arrive
        self.idle = idle  # longest silence between body pieces
