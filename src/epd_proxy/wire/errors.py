"""Errors the proxy answers with, in the envelope of the API the client speaks.

Every failure that reaches a client goes through :class:`ProxyError`, so the
status, the envelope and the in-band SSE form stay consistent everywhere. Two
envelopes exist: OpenAI's (vLLM's ``ErrorResponse``: chat, completions,
Responses, generate and the routed endpoints) and Anthropic's (``/v1/messages``
and its ``count_tokens``), whose ``error.type`` is what Anthropic clients decide
retries by. Which one a request gets is its path's (``request/apis.py``); the
body is built only when an error is answered, never on the success path.
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


# Anthropic's ``error.type`` per status (its API reference, "HTTP errors"): every other 4xx is
# ``invalid_request_error``, every other 5xx ``api_error``. The proxy keeps its own statuses
# (503, not Anthropic's 529: load balancers, dashboards and the proxy's metrics read 503, and
# the anthropic SDKs retry both alike) and says "overloaded" with the type.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_type_for(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status."""
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def anthropic_body(status: int, message: str) -> bytes:
    """Anthropic's error envelope: ``{"type": "error", "error": {"type", "message"}}``."""
    return msgspec.json.encode({"type": "error", "error": {"type": anthropic_type_for(status), "message": message}})


# Every type Anthropic's API reference lists: a relayed body already typed with one passes as is.
_ANTHROPIC_KNOWN = frozenset(_ANTHROPIC_TYPES.values()) | {"invalid_request_error", "api_error", "billing_error",
                                                          "timeout_error"}


class _OpenAIError(msgspec.Struct):
    message: str | None = None
    type: str | None = None


class _OpenAIEnvelope(msgspec.Struct):
    error: _OpenAIError | str | None = None
    type: str | None = None
    object: str | None = None  # older vLLM's flat ErrorResponse: ``{"object": "error", "message", ...}``
    message: str | None = None


def as_anthropic(status: int, body: bytes) -> bytes:
    """An upstream's error body for an Anthropic client: Anthropic's envelope with one of
    Anthropic's types as received; otherwise rewritten to Anthropic's envelope with its message,
    typed by ``status``. vLLM 0.32 needs both: its request-schema handler answers in OpenAI's
    envelope on every route, ``/v1/messages`` included, and its Messages handler puts its own
    type names (``NotFoundError``, ``BadRequestError``) in Anthropic's envelope, which Anthropic's
    clients, deciding by ``error.type``, do not know. Only error answers pay for the reading."""
    try:
        doc = msgspec.json.decode(body, type=_OpenAIEnvelope)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return body  # not JSON we know: as received
    err = doc.error
    if doc.type == "error" and isinstance(err, _OpenAIError) and err.type in _ANTHROPIC_KNOWN:
        return body  # already Anthropic's
    if err is not None:
        message = err if isinstance(err, str) else err.message
    elif doc.object == "error":
        message = doc.message
    else:
        return body  # no error we know of
    return anthropic_body(status, message if message else f"HTTP {status}")


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
        headers: list[tuple[bytes, bytes]] | None = None,
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
        # Response headers of its own (a 429's Retry-After and rate-limit headers), sent with it.
        self.headers = headers

    def envelope(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self, anthropic: bool = False) -> bytes:
        """The response body: the upstream's bytes if relayed, else our envelope; with
        ``anthropic``, Anthropic's envelope (an upstream's OpenAI-shaped one rewritten)."""
        if self.upstream_body is not None:
            return as_anthropic(self.status, self.upstream_body) if anthropic else self.upstream_body
        if anthropic:
            return anthropic_body(self.status, self.message)
        return msgspec.json.encode(self.envelope())

    def content_type(self) -> bytes:
        if self.upstream_body is not None and self.upstream_content_type:
            return self.upstream_content_type
        return b"application/json"

    def sse_event(self) -> bytes:
        """The in-band form for a chat, completions or generate stream that is already
        committed: the envelope as one ``data:`` event, then ``[DONE]``."""
        return b"data: " + msgspec.json.encode(self.envelope()) + b"\n\ndata: [DONE]\n\n"

    def anthropic_event(self) -> bytes:
        """The in-band form for a committed Messages stream: Anthropic's ``error`` event
        (the anthropic SDKs raise on it), no ``message_stop``."""
        return b"event: error\ndata: " + anthropic_body(self.status, self.message) + b"\n\n"

    def __repr__(self) -> str:
        return f"ProxyError({self.status}, {self.message!r})"


def error_body(status: int, message: str, anthropic: bool = False) -> bytes:
    """The envelope of an error answered before any handler ran (the HTTP server's own, a
    refused client key, admission)."""
    return anthropic_body(status, message) if anthropic else ProxyError(status, message).body()


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param)


def drop_traceback(err: BaseException) -> None:
    """An answered error's traceback is of no further use, and its frames often hold the
    error itself (``err = ...; raise err``) or a group containing it: a reference cycle
    that would keep the request's objects alive until a full collection."""
    err.__traceback__ = None
    err.__context__ = None
    err.__cause__ = None
