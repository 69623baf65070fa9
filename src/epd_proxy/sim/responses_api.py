"""``/v1/responses``: the OpenAI Responses API, as vLLM 0.32 serves it without a harmony
model: ``POST /v1/responses``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``.

The request becomes a chat request (``instructions`` as the system message, the
stored conversation of ``previous_response_id``, then ``input``), so its text is
the chat text of those messages. vLLM keeps responses in memory only with
``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``SimConfig.responses_store``, on here):
each instance has its own store, so a follow-up must reach the instance that
answered the turn before, as with vLLM, and a crash empties it.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import msgspec

from epd_proxy.sim.api_format import ApiFormat
from epd_proxy.sim.engine import Sequence
from epd_proxy.sim.responses import api_error_body
from epd_proxy.sim.tokens import VOCAB_JSON
from epd_proxy.sim.validation import ApiError, schema_error, schema_item

_encode = msgspec.json.encode
_REQUEST = "_responses_request"  # where the translated body keeps the original request


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id")


def _part(part: Any) -> Any:
    if not isinstance(part, dict):
        return part  # refused by the prompt analysis
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        out: dict = {"type": "image_url", "image_url": {"url": part.get("image_url")}}
        if isinstance(part.get("uuid"), str):
            out["uuid"] = part["uuid"]
        return out
    return part


def input_messages(inp: Any) -> list:
    """``input`` (a string or a list of items) as chat messages."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list):
        raise schema_error([schema_item("string_type", "body.input", "Input should be a valid string", inp)])
    out = []
    for item in inp:
        if isinstance(item, dict) and "role" in item:
            content = item.get("content")
            if isinstance(content, list):
                content = [_part(p) for p in content]
            out.append({"role": item["role"], "content": content})
        else:
            out.append({"role": "user", "content": [item]})  # a tool output or another item: one part
    return out


def to_chat(body: Any, history: list | None = None) -> dict:
    """The chat request a Responses request runs as; ``history`` is the stored conversation
    of ``previous_response_id`` (its messages and its answer)."""
    if not isinstance(body, dict):
        raise schema_error([schema_item("model_type", "body", "Input should be a valid dictionary or instance of "
                                        "ResponsesRequest", body, {"class_name": "ResponsesRequest"})])
    if "input" not in body:
        raise schema_error([schema_item("missing", "body.input", "Field required", body)])
    messages: list = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    messages += [m for m in history or () if m.get("role") != "system"]
    messages += input_messages(body["input"])
    chat: dict = {"messages": messages, "max_tokens": body.get("max_output_tokens")}
    for key in ("model", "stream", "kv_transfer_params", "ec_transfer_params", "mm_processor_kwargs", "sim_fault"):
        if key in body:
            chat[key] = body[key]
    return chat


def _event(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n"


def _text_part(text: str, logprobs: Any) -> dict:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


class ResponsesFormat(ApiFormat):
    """``/v1/responses`` on one instance, and that instance's store."""

    always_cached = True

    def __init__(self, created: int, max_model_len: int, store: bool) -> None:
        self.created = created
        self.max_model_len = max_model_len
        self.enable_store = store
        # id -> (the response, the conversation so far: its messages and its answer)
        self.store: dict[str, tuple[dict, list]] = {}
        self.tasks: dict[str, asyncio.Task] = {}  # background responses still generating

    def clear(self) -> None:
        """vLLM's store is in memory: a restarted instance has forgotten every response."""
        self.store.clear()
        self.tasks.clear()

    # -- the request -----------------------------------------------------------------------
    def translate(self, body: Any) -> dict:
        history = None
        if isinstance(body, dict) and body.get("background") and body.get("stream"):
            raise ApiError(400, "sim: background streams are not simulated", "BadRequestError", "background")
        prev = body.get("previous_response_id") if isinstance(body, dict) else None
        if prev is not None:
            stored = self.store.get(prev)
            if stored is None:
                raise not_found(str(prev))
            history = stored[1]
        chat = to_chat(body, history)
        chat[_REQUEST] = body
        return chat

    def ids(self, base: str, suffix: str, body: dict) -> tuple[str, str]:
        rid = body[_REQUEST].get("request_id")
        if not isinstance(rid, str) or not rid:
            rid = "resp_" + base
        return rid, rid

    def generation_error_body(self) -> bytes:
        return api_error_body(ApiError(500, "Internal server error", "InternalServerError"))

    # -- the answer ------------------------------------------------------------------------
    def _response(self, g, status: str, output: list, usage: dict | None, kv_out: dict | None,
                  ec_out: dict | None) -> dict:
        """vLLM's ``ResponsesResponse.from_request(...)``, dumped whole."""
        req = g.body[_REQUEST]
        max_out = req.get("max_output_tokens")
        tools = req.get("tools") or []
        return {
            "id": g.resp_id, "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.get("instructions"), "metadata": req.get("metadata"), "model": g.model,
            "object": "response", "output": output, "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "temperature": req.get("temperature") or 1.0,
            "tool_choice": req.get("tool_choice", "auto") if tools else "none", "tools": tools,
            "top_p": req.get("top_p") or 1.0, "background": bool(req.get("background", False)),
            "max_output_tokens": max_out if max_out is not None else self.max_model_len - g.prompt.tokens,
            "max_tool_calls": req.get("max_tool_calls"), "previous_response_id": req.get("previous_response_id"),
            "prompt": req.get("prompt"), "reasoning": req.get("reasoning"),
            "service_tier": req.get("service_tier", "auto"), "status": status, "text": req.get("text"),
            "top_logprobs": None, "truncation": req.get("truncation", "disabled"), "usage": usage,
            "user": req.get("user"), "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "kv_transfer_params": kv_out, "ec_transfer_params": ec_out, "input_messages": None,
            "output_messages": None}

    @staticmethod
    def _item_id(g) -> str:
        return "msg_" + hashlib.sha256(g.resp_id.encode()).hexdigest()[:16]

    def body(self, g, seq: Sequence, kv_out: dict | None, ec_out: dict | None) -> dict:
        text = seq.text(0)
        if seq.stream:
            # Only the items the stream opened. The final response object is the whole answer,
            # as vLLM 0.32 builds it (responses_full_generator): a bidirectional decode's
            # parameters included (``response.completed``).
            parts = [_text_part(text, None)] if seq.n else []
            ec_out = None
        else:
            parts = [_text_part(text, None)] if text else []
        output = [{"id": self._item_id(g), "content": parts, "role": "assistant", "status": "completed",
                   "type": "message", "phase": None}] if parts or not seq.stream else []
        p, n, cached = seq.prompt_tokens, seq.n, seq.cached_tokens
        usage = {"input_tokens": p,
                 "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0,
                                          "input_tokens_per_turn": [p], "cached_tokens_per_turn": [cached]},
                 "output_tokens": n,
                 "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                           "output_tokens_per_turn": [n], "tool_output_tokens_per_turn": [0]},
                 "total_tokens": p + n}
        status = "incomplete" if seq.finish_reason == "length" else "completed"
        return self._response(g, status, output, usage, kv_out, ec_out)

    def finished(self, g, answer: dict) -> None:
        stored = self.store.get(g.resp_id)
        if stored is not None and stored[0]["status"] == "cancelled":
            return  # a cancelled background response keeps its status
        if self.enable_store and g.body[_REQUEST].get("store", True) is not False:
            text = "".join(p["text"] for item in answer["output"] for p in item["content"])
            history = [*g.body["messages"], {"role": "assistant", "content": text}]
            self.store[g.resp_id] = (answer, history)

    def failed(self, g) -> None:
        stored = self.store.get(g.resp_id)
        if stored is not None and stored[0]["status"] == "queued":
            self.store[g.resp_id] = (dict(stored[0], status="failed"), stored[1])

    def detach(self, g, writer) -> bool:
        """``background: true``: the response is stored and answered ``queued`` at once, as
        vLLM does; GET shows it ``queued`` until it is done."""
        if not g.body[_REQUEST].get("background"):
            return False
        queued = self._response(g, "queued", [], None, None, None)
        self.store[g.resp_id] = (queued, list(g.body["messages"]))
        writer.send(200, _encode(queued), headers=g.headers)
        return True

    def started(self, g, task: asyncio.Task) -> None:
        rid = g.resp_id
        self.tasks[rid] = task
        task.add_done_callback(lambda t: self.tasks.pop(rid, None) if self.tasks.get(rid) is t else None)

    # -- the stream ------------------------------------------------------------------------
    def stream_open(self, g) -> bytes:
        initial = self._response(g, "in_progress", [], None, None, None)
        return (_event("response.created", {"response": initial, "sequence_number": 0, "type": "response.created"})
                + _event("response.in_progress", {"response": initial, "sequence_number": 1,
                                                  "type": "response.in_progress"}))

    def first_events(self, seq: Sequence, choice: int) -> bytes:
        item_id = self._item_id(seq.ctx)
        item: dict = {"id": item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message",
                "phase": None}
        return (_event("response.output_item.added", {"item": item, "output_index": 0, "sequence_number": 2,
                                                      "type": "response.output_item.added"})
                + _event("response.content_part.added", {
                    "content_index": 0, "item_id": item_id, "output_index": 0, "part": _text_part("", []),
                    "sequence_number": 3, "type": "response.content_part.added"}))

    def token_event(self, seq: Sequence, choice: int, i: int, tok: int) -> tuple[bytes, bytes, bytes]:
        head = b'event: response.output_text.delta\ndata: {"content_index":0,"delta":'
        tail = (b',"item_id":"' + self._item_id(seq.ctx).encode() + b'","logprobs":[],"output_index":0,'
                b'"sequence_number":%d,"type":"response.output_text.delta"}\n\n' % (4 + i))
        return head, VOCAB_JSON[tok], tail

    def stream_tail(self, seq: Sequence) -> bytes:
        g = seq.ctx
        final = g.final
        n = 2
        out = b""
        if seq.n:
            item_id = self._item_id(g)
            text = seq.text(0)
            n = 4 + seq.n
            out = (_event("response.output_text.done", {
                "content_index": 0, "item_id": item_id, "logprobs": [], "output_index": 0, "sequence_number": n,
                "text": text, "type": "response.output_text.done"})
                + _event("response.content_part.done", {
                    "content_index": 0, "item_id": item_id, "output_index": 0, "part": _text_part(text, None),
                    "sequence_number": n + 1, "type": "response.content_part.done"})
                + _event("response.output_item.done", {
                    "item": final["output"][0], "output_index": 0, "sequence_number": n + 2,
                    "type": "response.output_item.done"}))
            n += 3
        return out + _event("response.completed", {"response": final, "sequence_number": n,
                                                   "type": "response.completed"})

    # -- stored responses ----------------------------------------------------------------
    def stored(self, method: str, path: str) -> tuple[int, bytes]:
        """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: (status, body)."""
        rest = path[len("/v1/responses/"):]
        cancel = rest.endswith("/cancel")
        rid = rest[:-len("/cancel")] if cancel else rest
        if (method != "POST") if cancel else (method != "GET"):
            return 405, b'{"detail":"Method Not Allowed"}'
        entry = self.store.get(rid)
        if entry is None:
            return 404, api_error_body(not_found(rid))
        response = entry[0]
        if cancel:
            # Only a background response still queued (or in progress) can be cancelled.
            if response["status"] not in ("queued", "in_progress"):
                return 400, api_error_body(ApiError(400, "Cannot cancel a synchronous response.",
                                                    "invalid_request_error", "response_id"))
            response = dict(response, status="cancelled")
            self.store[rid] = (response, entry[1])
            task = self.tasks.pop(rid, None)
            if task is not None:
                task.cancel()
        return 200, _encode(response)

