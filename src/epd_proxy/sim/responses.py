"""The bodies a simulated instance answers with, shaped field for field as vLLM 0.32's.

Pure functions over plain values: the generation code decides *what* to answer,
this module knows *how* vLLM spells it.
"""

from __future__ import annotations

import hashlib

import msgspec

from epd_proxy.sim.validation import ApiError

JSON = b"application/json"
SSE = b"text/event-stream; charset=utf-8"
VLLM_VERSION = "0.32.0"

_ERROR_TYPES = {
    400: "BadRequestError", 401: "UnauthorizedError", 403: "ForbiddenError", 404: "NotFoundError",
    408: "RequestTimeoutError", 413: "RequestEntityTooLargeError", 422: "UnprocessableEntityError",
    429: "TooManyRequestsError", 500: "InternalServerError", 501: "NotImplementedError",
    502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError",
}
_encode = msgspec.json.encode

# What vLLM says about any generation failure (GenerationError): the 500 body (JSONResponse,
# compact) and the in-band stream event (json.dumps, with its spacing).
GENERATION_ERROR_BODY = (b'{"error":{"message":"Internal server error","type":"InternalServerError",'
                         b'"param":null,"code":500}}')
STREAM_GENERATION_ERROR = (b'data: {"error": {"message": "Internal server error", "type": '
                           b'"InternalServerError", "param": null, "code": 500}}\n\n')


def error_type(status: int) -> str:
    """The ``type`` vLLM's ``ErrorResponse`` gives a status."""
    return _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def refusal(status: int, message: str, param: str | None = None) -> ApiError:
    """A refusal in vLLM's envelope, typed by its status."""
    return ApiError(status, message, error_type(status), param)


def api_error_body(exc: ApiError) -> bytes:
    """vLLM's ``ErrorResponse``."""
    return _encode({"error": {"message": exc.message, "type": exc.etype, "param": exc.param,
                              "code": exc.status}})


def server_error_body(status: int, message: str, path: str = "") -> bytes:
    """What vLLM's server answers to a request it cannot take (the HTTP server's ``error_body``)."""
    return api_error_body(refusal(status, message))


def system_fingerprint(mode: str, key: tuple, tp_size: int, pp_size: int) -> str | None:
    """vLLM's default ``system_fingerprint``: ``vllm-<version>[-tpN][-ppN]-<8 hex>``, the hex
    from its config hash. Here the hash covers ``key`` (what differs between the simulated
    instances' configurations), so instances of one role and config share it. ``mode`` other
    than ``"auto"`` is used as is (``""`` for none)."""
    if mode != "auto":
        return mode or None
    parts = [f"vllm-{VLLM_VERSION}"]
    if tp_size > 1:
        parts.append(f"tp{tp_size}")
    if pp_size > 1:
        parts.append(f"pp{pp_size}")
    parts.append(hashlib.sha256(repr(key).encode()).hexdigest()[:8])
    return "-".join(parts)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """A non-stream answer's ``usage``; ``prompt_tokens_details`` only when some were cached
    (and the caller reports them)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens} if cached_tokens else None,
            "completion_tokens_details": None}


def chat_response(*, resp_id: str, created: int, model: str, texts: list[str], finish_reason: str,
                  fingerprint: str | None, usage: dict, kv_out: dict | None, ec_out: dict | None) -> dict:
    """vLLM 0.32's ``ChatCompletionResponse``, dumped whole (``model.model_dump()``)."""
    choices = [{"index": c, "message": {
        "role": "assistant", "content": text, "refusal": None, "annotations": None,
        "audio": None, "function_call": None, "reasoning": None},
        "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
        "token_ids": None, "routed_experts": None} for c, text in enumerate(texts)]
    return {"id": resp_id, "object": "chat.completion", "created": created,
            "model": model, "choices": choices, "service_tier": None,
            "system_fingerprint": fingerprint, "usage": usage, "prompt_logprobs": None,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": kv_out,
            "ec_transfer_params": ec_out, "metrics": None}


def completion_response(*, resp_id: str, created: int, model: str, texts: list[str], finish_reason: str,
                        fingerprint: str | None, usage: dict, kv_out: dict | None,
                        ec_out: dict | None) -> dict:
    """vLLM 0.32's ``CompletionResponse``, dumped whole."""
    choices = [{"index": c, "text": text, "logprobs": None,
                "finish_reason": finish_reason, "stop_reason": None, "token_ids": None,
                "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}
               for c, text in enumerate(texts)]
    return {"id": resp_id, "object": "text_completion", "created": created,
            "model": model, "choices": choices, "service_tier": None,
            "system_fingerprint": fingerprint, "usage": usage,
            "kv_transfer_params": kv_out, "ec_transfer_params": ec_out, "metrics": None}


def stream_head(resp_id: str, chat: bool, created: bytes, model: str) -> bytes:
    """What every stream chunk starts with, up to the choice's index:
    ``data: {"id":..,"object":..,"created":..,"model":..,"choices":[{"index":``."""
    return (b'data: {"id":' + _encode(resp_id) + b',"object":"'
            + (b"chat.completion.chunk" if chat else b"text_completion")
            + b'","created":' + created + b',"model":' + _encode(model)
            + b',"choices":[{"index":')

