"""The generation APIs besides chat and completions, as the pipeline sees them.

vLLM 0.32 serves ``/v1/messages`` (Anthropic), ``/v1/responses`` (OpenAI Responses) and
``/inference/v1/generate`` (token in, token out) on the same engine as chat, and each takes
``kv_transfer_params`` and answers with them (docs/protocol.md §2.9). What differs per API
is small and lives here, one object per path (:data:`GENERATION_APIS`), so the pipeline
pays one dict lookup per request for all of them and chat nothing more:

* where its media is, as the chat parts vLLM makes of it, for the operator's media rules
  and for the encoders (the consumer keeps the API's own parts: both hash the same image);
* how the one-token prefill is spelled (``max_tokens``, ``max_output_tokens``,
  ``sampling_params.max_tokens``) and what else prefill must not do (store a Responses
  answer, run in the background);
* when a request is served whole by one instance instead (:meth:`GenerationApi.whole`);
* which leading stream events say nothing yet and which are failures (the commit point);
* the in-band error of a committed stream, in the API's own form, and which error envelope
  a path's clients read (:func:`speaks_anthropic`).

Pure: plain dicts and bytes in, the same out.
"""

from __future__ import annotations

import msgspec

from epd_proxy.encode.multimodal import MediaItem, content_uuid
from epd_proxy.request.usage.api_fields import messages_usage, responses_usage, rewrite_api_usage, rewrite_usage_events
from epd_proxy.request.usage.rewrite import PrefillReport
from epd_proxy.request.usage.rewrite import rewrite_usage as rewrite_chat_usage
from epd_proxy.wire.errors import ProxyError, error_body

MESSAGES = "/v1/messages"
MESSAGES_PREFIX = MESSAGES + "/"  # count_tokens, and whatever else an Anthropic client asks under it
RESPONSES = "/v1/responses"
GENERATE = "/inference/v1/generate"

# What the first-event check makes of a named event (``event: NAME``) before the commit.
LEAD, FAILURE, COMMIT = 0, 1, 2

# Why a request is served whole by one instance (``epd_proxy_not_disaggregated_total{reason}``).
MEDIA = "media"  # with an encode stage, an image no encoder can be sent (an uploaded file's id)
PREVIOUS_RESPONSE = "previous_response_id"  # the conversation is in one instance's store
BACKGROUND = "background"  # answered "queued" at once: no prefill answer to hand over


class GenerationApi:
    """One API's differences from chat; the defaults are chat's."""

    path = ""
    chat_view = False  # the routing keys are read from ``messages`` (else ``prompt``)
    rewrite_usage = False  # the P/D usage rewrite (usage/rewrite.py, usage/api_fields.py) reads this API's usage
    usage_event = b""  # the named stream event that carries the final usage (usage/api_fields.py)
    ending = b"\x00"  # that event's line: the answer is whole (a stream that may move stops watching)
    # How a read ends when its last event is a text delta: the final usage event is still to
    # come, so the relay passes such a read on without searching it (vLLM's key order).
    text_delta_ends: tuple[bytes, ...] = ()
    cache_after_output = False  # its usage writes prompt fields after the output count (Anthropic)
    stateful = False  # answers are stored on the instance that made them (Responses)
    lead: frozenset[bytes] = frozenset()  # named events read past before the commit
    failures: frozenset[bytes] = frozenset()  # named events that are a failure
    # What marks an in-band error of decode's own whose type this API's clients do not know
    # (looked for only in reads that are not a text delta; :meth:`own_error_event`).
    foreign_error = b""

    def media(self, body: dict) -> list[MediaItem]:
        """The media the body carries, as chat parts (for the operator's media rules)."""
        return []

    def whole(self, body: dict) -> str | None:
        """Why this request must be served whole by one instance, or None."""
        return None

    def prefill_body(self, body: dict, kv: dict | None) -> dict:
        """The prefill leg: one token, not streamed, with the connector's ``kv``."""
        raise NotImplementedError

    def first_event(self, name: bytes) -> int:
        """LEAD, FAILURE or COMMIT for a leading named event."""
        if name in self.lead:
            return LEAD
        return FAILURE if name in self.failures else COMMIT

    def in_band_error(self, err: ProxyError, last: bytes, head: bytes = b"") -> bytes:
        """A committed stream's failure, in this API's form (``last``: the last bytes relayed,
        ``head``: the stream's first read, its leading events)."""
        return err.sse_event()

    def own_error_event(self, events: bytes) -> bytes:
        """``events`` with decode's in-band error typed as this API's clients know it."""
        return events

    def merge_usage(self, decode: dict, prefill: dict | None) -> dict | None:
        """The client's usage object from decode's and the prefill's (usage/api_fields.py)."""
        return None

    def client_answer(self, doc: bytes, report: PrefillReport) -> bytes:
        """Decode's whole answer with the client's usage (chat's fields by default)."""
        if not self.usage_event:
            return rewrite_chat_usage(doc, report)
        return rewrite_api_usage(doc, report, self.merge_usage, self.cache_after_output)

    def client_events(self, events: bytes, report: PrefillReport) -> bytes:
        """Whole stream events with the final usage event's usage the client's."""
        return rewrite_usage_events(events, report, self.usage_event, self.merge_usage, self.cache_after_output)


def _with_kv(out: dict, kv: dict | None) -> dict:
    if kv is not None:
        out["kv_transfer_params"] = kv
    else:
        out.pop("kv_transfer_params", None)
    return out


def _item(index: int, msg: int, part: int, url: object) -> MediaItem:
    """An image as the chat part vLLM makes of it: what the media rules read and what the
    encoder is sent. ``url`` None (an uploaded file's id, a malformed source): not encodable
    here, the item's ``uuid`` is empty and the request is served whole."""
    if not isinstance(url, str):
        return MediaItem(index, msg, part, "image_url", {"type": "image_url", "image_url": {"url": "data:"}}, "")
    chat_part = {"type": "image_url", "image_url": {"url": url}}
    return MediaItem(index, msg, part, "image_url", chat_part, content_uuid(chat_part))


def encodable(items: list[MediaItem]) -> bool:
    """Whether the encode stage can take every item (each has the URL vLLM would load)."""
    return all(item.uuid for item in items)


def anthropic_image_url(source: object) -> str | None:
    """An image block's source as vLLM 0.32 hands it to chat (``anthropic/serving.py``
    ``_convert_image_source_to_url``): a URL source's URL, else a base64 ``data:`` URL."""
    if not isinstance(source, dict):
        return None
    if source.get("type") == "url":
        url = source.get("url", "")
        return url if isinstance(url, str) and url else None
    media_type, data = source.get("media_type", "image/jpeg"), source.get("data", "")
    if not isinstance(media_type, str) or not isinstance(data, str) or not data:
        return None
    return f"data:{media_type};base64,{data}"


class Messages(GenerationApi):
    """Anthropic Messages: image blocks are media; ``max_tokens`` is required; named events
    (``message_start`` … ``message_stop``), no ``[DONE]``."""

    path = MESSAGES
    chat_view = True
    rewrite_usage = True
    usage_event = b"message_delta"  # message_start's usage is the whole prompt, as decode has it
    ending = b"event: message_delta\n"
    text_delta_ends = (b'},"index":0}\n\n', b'},"index":1}\n\n')  # a text block, after a thinking one
    cache_after_output = True
    lead = frozenset((b"message_start", b"content_block_start", b"ping"))
    failures = frozenset((b"error",))
    # vLLM 0.32's in-stream failure (anthropic/serving.py): ``internal_error``, no type of
    # Anthropic's; a model's text cannot spell it (its quotes would be escaped).
    foreign_error = b'"type":"internal_error"'

    def media(self, body: dict) -> list[MediaItem]:
        items: list[MediaItem] = []
        messages = body.get("messages")
        if not isinstance(messages, list):
            return items
        for m, msg in enumerate(messages):
            content = msg.get("content") if isinstance(msg, dict) else None
            if not isinstance(content, list):
                continue
            for p, block in enumerate(content):
                if isinstance(block, dict) and block.get("type") == "image":
                    items.append(_item(len(items), m, p, anthropic_image_url(block.get("source"))))
        return items

    def prefill_body(self, body: dict, kv: dict | None) -> dict:
        out = dict(body)
        out["stream"] = False
        out["max_tokens"] = 1
        return _with_kv(out, kv)

    def merge_usage(self, decode: dict, prefill: dict | None) -> dict | None:
        return messages_usage(decode, prefill)

    def in_band_error(self, err: ProxyError, last: bytes, head: bytes = b"") -> bytes:
        # vLLM's own form (anthropic/serving.py), typed as Anthropic types its status (vLLM
        # says ``internal_error``, a type Anthropic's clients do not know): the SDKs raise on it.
        return err.anthropic_event()

    def own_error_event(self, events: bytes) -> bytes:
        # Anthropic's type for a server's failure mid-stream, vLLM's message kept.
        return events.replace(self.foreign_error, b'"type":"api_error"')


class Responses(GenerationApi):
    """OpenAI Responses: ``input_image`` parts are media; ``max_output_tokens``; typed events
    with a ``sequence_number``, no ``[DONE]``; answers stored per instance (``store``)."""

    path = RESPONSES
    stateful = True
    rewrite_usage = True
    usage_event = b"response.completed"
    ending = b"event: response.completed\n"
    text_delta_ends = (b'"type":"response.output_text.delta"}\n\n',)
    lead = frozenset((b"response.created", b"response.in_progress", b"response.output_item.added",
                      b"response.content_part.added"))
    failures = frozenset((b"error", b"response.failed"))

    def media(self, body: dict) -> list[MediaItem]:
        items: list[MediaItem] = []
        inp = body.get("input")
        if not isinstance(inp, list):
            return items
        for m, entry in enumerate(inp):
            if not isinstance(entry, dict):
                continue
            content = entry.get("content")
            parts = content if isinstance(content, list) else [entry]
            for p, part in enumerate(parts):
                if isinstance(part, dict) and part.get("type") == "input_image":
                    url = part.get("image_url")
                    # A file_id names an uploaded file: no URL to send an encoder, still media.
                    # A client's uuid would key the item on the consumer only (vLLM's chat
                    # parser reads it on an input_image): served whole too.
                    if "uuid" in part:
                        url = None
                    items.append(_item(len(items), m, p, url))
        return items

    def whole(self, body: dict) -> str | None:
        if body.get("previous_response_id") is not None:
            return PREVIOUS_RESPONSE
        if body.get("background") is True:
            return BACKGROUND
        return None

    def prefill_body(self, body: dict, kv: dict | None) -> dict:
        out = dict(body)
        out["stream"] = False
        out["max_output_tokens"] = 1
        # The prefill's one-token answer must never be stored: a retrieve would find it.
        out["store"] = False
        out.pop("stream_options", None)
        return _with_kv(out, kv)

    def merge_usage(self, decode: dict, prefill: dict | None) -> dict | None:
        return responses_usage(decode, prefill)

    def in_band_error(self, err: ProxyError, last: bytes, head: bytes = b"") -> bytes:
        # The Responses stream's ``error`` event (the openai SDK's ResponseErrorEvent), then
        # ``response.failed`` with the response ``response.created`` began (same id: the SDK's
        # stream helper checks it), ``status: failed`` and its ``error``, as OpenAI ends a
        # failed response: clients that watch the response's lifecycle see it end.
        seq = next_sequence_number(last)
        code = "rate_limit_exceeded" if err.status == 429 else "server_error"
        out = b"event: error\ndata: " + msgspec.json.encode(
            {"type": "error", "code": code, "message": err.message, "param": None, "sequence_number": seq}) + b"\n\n"
        response = created_response(head)
        if response is None:
            return out
        response.update(status="failed", error={"code": code, "message": err.message}, incomplete_details=None)
        return out + b"event: response.failed\ndata: " + msgspec.json.encode(
            {"type": "response.failed", "response": response, "sequence_number": seq + 1}) + b"\n\n"


def next_sequence_number(last: bytes) -> int:
    """One past the last ``"sequence_number":N`` in ``last`` (0 when there is none)."""
    key = b'"sequence_number":'
    at = last.rfind(key)
    if at < 0:
        return 0
    at += len(key)
    end = at
    while end < len(last) and 0x30 <= last[end] <= 0x39:
        end += 1
    return int(last[at:end]) + 1 if end > at else 0


def created_response(head: bytes) -> dict | None:
    """The response object of the ``response.created`` event in ``head`` (None if absent)."""
    at = head.find(b"event: response.created\n")
    if at < 0:
        return None
    start = head.find(b"data: ", at)
    end = head.find(b"\n\n", start)
    if start < 0 or end < 0:
        return None
    try:
        event = msgspec.json.decode(head[start + 6:end])
    except msgspec.DecodeError:
        return None
    response = event.get("response") if isinstance(event, dict) else None
    return response if isinstance(response, dict) else None


def speaks_anthropic(path: str) -> bool:
    """Whether a path's clients read Anthropic's error envelope (``/v1/messages`` and what is
    under it); every other path's read OpenAI's (vLLM's ``ErrorResponse``)."""
    return path == MESSAGES or path.startswith(MESSAGES_PREFIX)


def front_door_error_body(status: int, message: str, path: str) -> bytes:
    """An error answered before any handler ran (the HTTP server's: 400, 408, 413, 431, ...)
    in the envelope of the path's API (OpenAI's when no request line was read)."""
    return error_body(status, message, speaks_anthropic(path))


class _Created(msgspec.Struct):
    id: str | None = None


class _Event(msgspec.Struct):
    response: _Created | None = None


def response_id(data: bytes, stream: bool) -> str | None:
    """The id of a Responses answer: the body's ``id``, or the ``response.created`` event's
    (the first event of a stream)."""
    try:
        if not stream:
            return msgspec.json.decode(data, type=_Created).id
        start = data.find(b"\ndata: ")
        end = data.find(b"\n\n", start + 1)
        if start < 0 or end < 0:
            return None
        event = msgspec.json.decode(data[start + 7:end], type=_Event)
        return event.response.id if event.response is not None else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class Generate(GenerationApi):
    """Token in, token out (``/inference/v1/generate``, vLLM ``--enable-scale-out``): the
    limit is ``sampling_params.max_tokens``; ``data:`` chunks and ``[DONE]`` as chat."""

    path = GENERATE
    rewrite_usage = True  # chat's usage fields

    def prefill_body(self, body: dict, kv: dict | None) -> dict:
        out = dict(body)
        out["stream"] = False
        out.pop("stream_options", None)
        params = body.get("sampling_params")
        params = dict(params) if isinstance(params, dict) else {}
        params["max_tokens"] = 1
        params.pop("min_tokens", None)
        if "n" in params:
            params["n"] = 1
        out["sampling_params"] = params
        return _with_kv(out, kv)


GENERATION_APIS: dict[str, GenerationApi] = {api.path: api for api in (Messages(), Responses(), Generate())}
