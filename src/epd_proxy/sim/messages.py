"""``POST /v1/messages``: the Anthropic Messages API, as vLLM 0.32 serves it.

vLLM turns the request into a chat request (``anthropic/serving.py``) and the chat
answer back into Anthropic's shapes, so the answer's id is the chat id
(``chatcmpl-<X-Request-Id>``), the text is the chat text of the converted messages,
and ``kv_transfer_params`` travel as on chat. Non-stream answers are dumped with
``exclude_none``: a decode's answer has no ``kv_transfer_params`` key at all.
"""

from __future__ import annotations

from typing import Any

import msgspec

from epd_proxy.sim.api_format import ApiFormat
from epd_proxy.sim.engine import Sequence
from epd_proxy.sim.responses import api_error_body
from epd_proxy.sim.tokens import VOCAB_JSON, PromptError, analyze
from epd_proxy.sim.validation import ApiError, json_error, schema_error, schema_item

_encode = msgspec.json.encode

# What vLLM's stream converter sends when the chat stream fails: it cannot parse the
# chat stream's in-band error as a chunk, and reports pydantic's complaint.
STREAM_ERROR_EVENT = (
    b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"2 validation errors '
    b"for ChatCompletionStreamResponse\\nmodel\\n  Field required [type=missing, input_value={'error': "
    b"{'message': 'In...am': None, 'code': 500}}, input_type=dict]\\n    For further information visit "
    b"https://errors.pydantic.dev/2.14/v/missing\\nchoices\\n  Field required [type=missing, "
    b"input_value={'error': {'message': 'In...am': None, 'code': 500}}, input_type=dict]\\n    For further "
    b'information visit https://errors.pydantic.dev/2.14/v/missing"}}\n\n')
_DELTA_HEAD = (b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delta",'
               b'"text":')
_DELTA_TAIL = b'},"index":0}\n\n'
_BLOCK_START = (b'event: content_block_start\ndata: {"type":"content_block_start","content_block":'
                b'{"type":"text","text":""},"index":0}\n\n')
_BLOCK_STOP = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
_MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


def image_url(source: Any) -> str:
    """An image block's source as the URL vLLM hands to chat (a ``data:`` URL for base64)."""
    if not isinstance(source, dict):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text") or "" for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _part(block: Any) -> Any:
    if not isinstance(block, dict):
        return block  # refused by the prompt analysis
    if block.get("type") == "text":
        return {"type": "text", "text": block.get("text")}
    if block.get("type") == "image":
        # vLLM's AnthropicContentBlock ignores unknown keys (a ``uuid`` too): the image is
        # keyed by its content.
        return {"type": "image_url", "image_url": {"url": image_url(block.get("source"))}}
    return block  # tool use, tool results, thinking: one token each, as any other part


def to_chat(body: Any, *, count_only: bool = False) -> dict:
    """The chat request vLLM makes of a Messages request (``max_tokens`` is required, but
    for counting tokens, and becomes both chat caps); raises the schema error FastAPI
    answers for a malformed one."""
    cls = "AnthropicCountTokensRequest" if count_only else "AnthropicMessagesRequest"
    if not isinstance(body, dict):
        raise schema_error([schema_item("model_type", "body", f"Input should be a valid dictionary or instance of "
                                        f"{cls}", body, {"class_name": cls})])
    required = ("model", "messages") if count_only else ("model", "messages", "max_tokens")
    missing = [schema_item("missing", f"body.{k}", "Field required", body) for k in required if k not in body]
    if missing:
        raise schema_error(missing)
    if not isinstance(body["messages"], list):
        raise schema_error([schema_item("list_type", "body.messages", "Input should be a valid list",
                                        body["messages"])])
    messages: list = []
    system = _text_of(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for msg in body["messages"]:
        if not isinstance(msg, dict):
            messages.append(msg)
            continue
        content = msg.get("content")
        if msg.get("role") == "system":
            text = _text_of(content)
            if text:
                messages.append({"role": "system", "content": text})
            continue
        if isinstance(content, list):
            content = [_part(b) for b in content]
        messages.append({"role": msg.get("role"), "content": content})
    chat = {"model": body["model"], "messages": messages, "max_tokens": body.get("max_tokens"),
            "max_completion_tokens": body.get("max_tokens")}
    for key in ("stream", "kv_transfer_params", "ec_transfer_params", "sim_fault"):
        if key in body:
            chat[key] = body[key]
    return chat


def stop_reason(finish_reason: str) -> str:
    return "max_tokens" if finish_reason == "length" else "end_turn"


def usage(prompt_tokens: int, output_tokens: int, cached: int, details: bool = False) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from a cache;
    ``cache_read_input_tokens`` whenever the instance reports prompt details
    (``--enable-prompt-tokens-details``: vLLM 0.32 writes it even when it is 0)."""
    out = {"input_tokens": max(prompt_tokens - cached, 0), "output_tokens": output_tokens}
    if cached or details:
        out["cache_read_input_tokens"] = cached
    return out


class MessagesFormat(ApiFormat):
    """``/v1/messages`` on one instance."""

    merges = True  # its deltas are the chat stream's, merged as they are

    def __init__(self, details: bool = False) -> None:
        self.details = details  # the instance's prompt_tokens_details

    def count_tokens(self, raw: bytes) -> tuple[int, bytes]:
        """``POST /v1/messages/count_tokens``: (status, body) with the prompt's ``input_tokens``."""
        try:
            try:
                body = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                raise json_error(raw) from None
            try:
                n = analyze(to_chat(body, count_only=True), True).tokens
            except PromptError as exc:
                raise ApiError(400, str(exc), "BadRequestError") from None
        except ApiError as exc:
            return exc.status, self.error_body(exc)
        return 200, _encode({"input_tokens": n})

    def translate(self, body: Any) -> dict:
        return to_chat(body)

    def ids(self, base: str, suffix: str, body: dict) -> tuple[str, str]:
        return "chatcmpl-" + base, f"chatcmpl-{base}-{suffix}"

    def error_body(self, exc: ApiError) -> bytes:
        if exc.etype == "Bad Request":
            # A schema error is answered by vLLM's handler for every route, before the API's own.
            return api_error_body(exc)
        return _encode({"type": "error", "error": {"type": exc.etype, "message": exc.message}})

    def generation_error_body(self) -> bytes:
        return self.error_body(ApiError(500, "Internal server error", "InternalServerError"))

    def body(self, g, seq: Sequence, kv_out: dict | None, ec_out: dict | None) -> dict:
        out = {"id": g.resp_id, "type": "message", "role": "assistant",
               "content": [{"type": "text", "text": seq.text(0)}], "model": g.model,
               "stop_reason": stop_reason(seq.finish_reason),
               "usage": usage(seq.prompt_tokens, seq.n, seq.cached_tokens, self.details)}
        if kv_out is not None:
            out["kv_transfer_params"] = kv_out
        if ec_out is not None:
            out["ec_transfer_params"] = ec_out
        return out

    def _message_start(self, seq: Sequence) -> bytes:
        g = seq.ctx
        message = {"id": g.resp_id, "type": "message", "role": "assistant", "content": [], "model": g.model,
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": seq.prompt_tokens, "output_tokens": 0}}
        return (b'event: message_start\ndata: {"type":"message_start","message":' + _encode(message)
                + b"}\n\n")

    def first_events(self, seq: Sequence, choice: int) -> bytes:
        return self._message_start(seq) + _BLOCK_START

    def token_event(self, seq: Sequence, choice: int, i: int, tok: int) -> tuple[bytes, bytes, bytes]:
        return _DELTA_HEAD, VOCAB_JSON[tok], _DELTA_TAIL

    def stream_tail(self, seq: Sequence) -> bytes:
        head = self._message_start(seq) if seq.n == 0 else _BLOCK_STOP
        delta = {"type": "message_delta", "delta": {"stop_reason": stop_reason(seq.finish_reason),
                                                    "stop_sequence": None},
                 "usage": usage(seq.prompt_tokens, seq.n, seq.cached_tokens, self.details)}
        return head + b"event: message_delta\ndata: " + _encode(delta) + b"\n\n" + _MESSAGE_STOP

    def stream_error(self, seq: Sequence) -> bytes | None:
        # The chat stream's first output (even a failure) carries the role chunk: message_start.
        return (b"" if seq.emitted else self._message_start(seq)) + STREAM_ERROR_EVENT
