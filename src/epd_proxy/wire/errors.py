"""Errors the proxy answers with, in the OpenAI error envelope.

Every failure that reaches a client goes through :class:`ProxyError`, so the
status, the envelope and the in-band SSE form stay consistent everywhere.
"""

from __future__ import annotations

import msgspec

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type_for(status: int) -> str:
    """The OpenAI-style ``type`` name for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "BadRequestError" if 400 <= status < 500 else "InternalServerError"


class ProxyError(Exception):
    """A failure with the status and envelope the client should see.

    ``retryable`` marks failures a pipeline may retry before it has committed
    any byte to the client (connection errors, 5xx from a stage). ``unsent``
    marks an upstream that never received the request (it refused the
    connection): what the request carried, e.g. a prefill's KV parameters, is
    still unclaimed and may go to another instance.
    """

    unsent = False
    # The access log's word for a request this error ends (e.g. ``item_timeout``: its own
    # media item, not an instance, failed it).
    outcome = "error"

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: int | str | None = None,
        retryable: bool = False,
        upstream_body: bytes | None = None,
        upstream_content_type: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type_for(status)
        self.param = param
        self.code = status if code is None else code
        self.retryable = retryable
        # When set, the upstream's own error body is relayed as received
        # (e.g. vLLM's 400 for a validation error) instead of our envelope.
        self.upstream_body = upstream_body
        self.upstream_content_type = upstream_content_type

    def envelope(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        """The response body: the upstream's bytes if relayed, else our envelope."""
        if self.upstream_body is not None:
            return self.upstream_body
        return msgspec.json.encode(self.envelope())

    def content_type(self) -> bytes:
        if self.upstream_body is not None and self.upstream_content_type:
            return self.upstream_content_type
        return b"application/json"

    def sse_event(self) -> bytes:
        """The in-band form for a stream that is already committed."""
        return b"data: " + msgspec.json.encode(self.envelope()) + b"\n\ndata: [DONE]\n\n"

    def __repr__(self) -> str:
        return f"ProxyError({self.status}, {self.message!r})"


def error_body(status: int, message: str) -> bytes:
    """The envelope of an error the HTTP server answers by itself (its ``error_body``)."""
    return ProxyError(status, message).body()


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param)
