"""vLLM 0.32's request validation, with its error shapes.

Two kinds of 400, as vLLM answers them:

* request-schema (pydantic) errors, raised before vLLM looks at the request:
  ``"type": "Bad Request"``, ``param`` the cleaned location
  (``"body.stream_options.include_usage"``) and a message
  ``"1 validation error:\\n  {'type': 'bool_parsing', 'loc': ..., 'msg': ..., 'input': ...}"``.
  Values are converted as pydantic's lax mode does (``"yes"`` is a valid
  boolean, ``"10"`` a valid integer), so what vLLM accepts is accepted here.
* vLLM's own checks (``VLLMValidationError``): ``"type": "BadRequestError"``,
  the message followed by `` (parameter=X[, value=Y])`` when the check names a
  parameter, and ``param`` that parameter (else null).

:func:`check_request` runs them in vLLM's order: the ``stream_options``
model validator, the schema, then (after the model check, done by the
caller) :func:`check_lengths` for the token budget.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_MAX_REPORTED = 10
_MAX_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000
_INT_RE = re.compile(r"\s*[+-]?\d+\s*\Z")
_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))


class ApiError(Exception):
    """A request refused with vLLM's error envelope."""

    def __init__(self, status: int, message: str, etype: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.etype = etype
        self.param = param


def vllm_error(message: str, parameter: str | None = None, value: Any = None) -> ApiError:
    """A ``VLLMValidationError``: 400 ``BadRequestError``, `` (parameter=.., value=..)`` appended."""
    extras = []
    if parameter is not None:
        extras.append(f"parameter={parameter}")
    if value is not None:
        extras.append(f"value={value}")
    if extras:
        message = f"{message} ({', '.join(extras)})"
    return ApiError(400, message, "BadRequestError", parameter)


def _summarize(value: Any) -> Any:
    """What vLLM shows of a rejected value (its ``_summarize_error_input``)."""
    if isinstance(value, str):
        return value[:_MAX_INPUT_CHARS] + "...[truncated]" if len(value) > _MAX_INPUT_CHARS else value
    if isinstance(value, (list, tuple, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:_MAX_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_INPUT_CHARS else text


def schema_item(kind: str, loc: str, msg: str, value: Any, ctx: dict | None = None) -> dict:
    """One pydantic error as vLLM reports it (``loc`` already joined with dots)."""
    item = {"type": kind, "loc": loc, "msg": msg, "input": _summarize(value)}
    if ctx is not None:
        item["ctx"] = ctx
    return item


def schema_error(items: list) -> ApiError:
    """vLLM's answer to a ``RequestValidationError`` (items: dicts or plain strings)."""
    count = len(items)
    label = "error" if count == 1 else "errors"
    lines = []
    for item in items[:_MAX_REPORTED]:
        text = str(item)
        lines.append(f"  {text[:_MAX_ERROR_CHARS] + '...[truncated]' if len(text) > _MAX_ERROR_CHARS else text}\n")
    message = f"{count} validation {label}:\n" + "".join(lines)
    if count > _MAX_REPORTED:
        message += f"  ...and {count - _MAX_REPORTED} more {label}\n"
    first = items[0] if items else None
    param = first.get("loc") if isinstance(first, dict) else None
    return ApiError(400, message.rstrip(), "Bad Request", param)


UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"


def json_error(raw: bytes) -> ApiError:
    """FastAPI's answer to a body that is not JSON (position and reason from Python's json)."""
    if not raw:
        return schema_error([schema_item("missing", "body", "Field required", None)])
    try:
        json.loads(raw)
        pos, why = 0, "Invalid JSON"
    except json.JSONDecodeError as exc:
        pos, why = exc.pos, exc.msg
    except (UnicodeDecodeError, ValueError) as exc:
        pos, why = 0, str(exc)
    return schema_error([schema_item("json_invalid", f"body.{pos}", "JSON decode error", {}, {"error": why})])


# -- pydantic's lax conversions ----------------------------------------------------------

def _bool(body: dict, key: str, loc: str, errors: list, *, nullable: bool = True) -> Any:
    if key not in body:
        return None
    v = body[key]
    if v is None:
        if not nullable:
            errors.append(schema_item("bool_type", loc, "Input should be a valid boolean", v))
        return None
    if v is True or v is False:
        return v
    if isinstance(v, (int, float)):
        if v == 0 or v == 1:
            return bool(v)
    elif isinstance(v, str):
        low = v.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    else:
        errors.append(schema_item("bool_type", loc, "Input should be a valid boolean", v))
        return None
    errors.append(schema_item("bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", v))
    return None


def _int(body: dict, key: str, loc: str, errors: list, *, nullable: bool = True) -> Any:
    if key not in body:
        return None
    v = body[key]
    if v is None:
        if not nullable:
            errors.append(schema_item("int_type", loc, "Input should be a valid integer", v))
        return None
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if v == v and v not in (float("inf"), float("-inf")) and v.is_integer():
            return int(v)
        errors.append(schema_item("int_from_float", loc,
                                  "Input should be a valid integer, got a number with a fractional part", v))
        return None
    if isinstance(v, str):
        if _INT_RE.match(v):
            return int(v)
        errors.append(schema_item("int_parsing", loc,
                                  "Input should be a valid integer, unable to parse string as an integer", v))
        return None
    errors.append(schema_item("int_type", loc, "Input should be a valid integer", v))
    return None


def _str(body: dict, key: str, loc: str, errors: list) -> None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        errors.append(schema_item("string_type", loc, "Input should be a valid string", v))


def _dict(body: dict, key: str, loc: str, errors: list) -> None:
    v = body.get(key)
    if v is not None and not isinstance(v, dict):
        errors.append(schema_item("dict_type", loc, "Input should be a valid dictionary", v))


@dataclass(slots=True)
class Checked:
    """A request's fields after vLLM's schema validation (lax conversions applied)."""

    body: dict  # the body, with converted values written back when a conversion changed one
    stream: bool
    include_usage: bool
    continuous_usage: bool
    n: int


def check_request(body: Any, chat: bool) -> Checked:
    """Schema validation in vLLM's order; raises :class:`ApiError`."""
    cls = "ChatCompletionRequest" if chat else "CompletionRequest"
    if not isinstance(body, dict):
        raise schema_error([schema_item("model_type", "body", f"Input should be a valid dictionary or instance of "
                                        f"{cls}", body, {"class_name": cls})])
    # Model validators (mode="before") run first.
    if body.get("stream_options") and not body.get("stream"):
        raise vllm_error("Stream options can only be defined when `stream=True`.", "stream_options")
    if not chat:
        prompt = body.get("prompt")
        if (prompt is None or prompt == "") and not body.get("prompt_embeds"):
            raise vllm_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    errors: list = []
    changed: dict = {}

    def conv(key: str, value: Any) -> None:
        if key in body and value is not None and (value != body[key] or type(value) is not type(body[key])):
            changed[key] = value

    # Fields in the order ChatCompletionRequest / CompletionRequest declares them.
    if chat:
        if "messages" not in body:
            errors.append(schema_item("missing", "body.messages", "Field required", body))
        elif not isinstance(body["messages"], list):
            errors.append(schema_item("list_type", "body.messages", "Input should be a valid list", body["messages"]))
    _str(body, "model", "body.model", errors)
    if not chat:
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, (str, list)):
            errors += [schema_item("list_type", "body.prompt", "Input should be a valid list", prompt),
                       schema_item("list_type", "body.prompt", "Input should be a valid list", prompt),
                       schema_item("string_type", "body.prompt", "Input should be a valid string", prompt),
                       schema_item("list_type", "body.prompt", "Input should be a valid list", prompt)]
    conv("max_tokens", _int(body, "max_tokens", "body.max_tokens", errors))
    if chat:
        conv("max_completion_tokens", _int(body, "max_completion_tokens", "body.max_completion_tokens", errors))
    n = _int(body, "n", "body.n", errors, nullable=chat)
    conv("n", n)
    conv("seed", _int(body, "seed", "body.seed", errors))
    stream = _bool(body, "stream", "body.stream", errors)
    include_usage = continuous = None
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            errors.append(schema_item("model_type", "body.stream_options",
                                      "Input should be a valid dictionary or instance of StreamOptions", so,
                                      {"class_name": "StreamOptions"}))
        else:
            include_usage = _bool(so, "include_usage", "body.stream_options.include_usage", errors)
            continuous = _bool(so, "continuous_usage_stats", "body.stream_options.continuous_usage_stats", errors)
    conv("min_tokens", _int(body, "min_tokens", "body.min_tokens", errors, nullable=False))
    if chat:
        _dict(body, "mm_processor_kwargs", "body.mm_processor_kwargs", errors)
    _dict(body, "kv_transfer_params", "body.kv_transfer_params", errors)
    _dict(body, "ec_transfer_params", "body.ec_transfer_params", errors)
    if errors:
        raise schema_error(errors)
    if changed:
        body = dict(body, **changed)
    return Checked(body=body, stream=bool(stream), include_usage=bool(include_usage),
                   continuous_usage=bool(include_usage and continuous), n=1 if n is None else n)


def output_cap(body: dict, chat: bool) -> tuple[int | None, str, bool]:
    """(the request's output cap, the parameter that set it, whether it is only vLLM's
    protocol default). ``max_completion_tokens`` wins on chat. A completions request
    without ``max_tokens`` gets the protocol default of 16; ``null`` means no cap."""
    if chat:
        v = body.get("max_completion_tokens")
        if v is not None:
            return v, "max_completion_tokens", False
        return body.get("max_tokens"), "max_tokens", False
    if "max_tokens" not in body:
        return 16, "max_tokens", True
    return body.get("max_tokens"), "max_tokens", False


def plan_output(cap: int | None, implicit: bool, min_tokens: int, natural_len: int,
                room: float) -> tuple[int, bool]:
    """(output tokens, finished by length). An explicit cap is always reached (the
    simulated model never stops early); otherwise the model stops by itself after
    ``max(natural_len, min_tokens)`` tokens, unless the cap or the context comes first."""
    limit = room if cap is None else min(cap, room)
    if cap is not None and not implicit:
        return int(limit), True
    natural = max(natural_len, min_tokens)
    if natural >= limit:
        return int(limit), True
    return natural, False


def check_lengths(body: dict, chat: bool, prompt_tokens: int, max_model_len: int, n: int, *,
                  exact_prompt: bool, natural_len: int) -> tuple[int, bool]:
    """vLLM's token-budget checks, after the model check, in its order.

    Returns (output tokens, finished by length). A cap beyond the context left
    after the prompt is not an error: the output stops at the context length
    (``finish_reason: "length"``).
    """
    cap, cap_param, implicit = output_cap(body, chat)
    # TokenizeParams: max_output_tokens > max_model_len.
    if cap is not None and cap > max_model_len:
        raise vllm_error(f"{cap_param}={cap} cannot be greater than max_model_len={max_model_len}. "
                         "Please request fewer output tokens.", cap_param, cap)
    # Tokenization: a prompt longer than the context. A text prompt is tokenized with
    # truncation at max_model_len + 1, so vLLM only knows "at least" that many.
    if prompt_tokens > max_model_len:
        count = prompt_tokens if exact_prompt else max_model_len + 1
        qualifier = "at least " if count == max_model_len + 1 else ""
        raise vllm_error(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                         f"contains {qualifier}{count} input tokens, which exceeds this limit even without any "
                         "output tokens. Please reduce the length of the input prompt.", "input_tokens", count)
    # get_max_tokens(): the cap, limited by the context left.
    room = max_model_len - prompt_tokens
    max_tokens = room if cap is None else min(cap, room)
    # SamplingParams._verify_args.
    if n < 1:
        raise vllm_error(f"n must be at least 1, got {n}.")
    if max_tokens < 1:
        raise vllm_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    min_tokens = body.get("min_tokens") or 0
    if min_tokens < 0:
        raise vllm_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens > max_tokens:
        raise vllm_error(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    return plan_output(cap, implicit, min_tokens, natural_len, room)
