"""Continuing a broken ``/v1/responses`` stream on another decode.

vLLM 0.32's Responses endpoint continues a partial assistant message: when the last input item
is an assistant output message whose ``status`` is ``in_progress`` or ``incomplete``
(``responses/utils.py``, ``should_continue_final_message``) it renders the conversation with
``continue_final_message`` and without a generation prompt, as chat does. So the continuation
is the client's request with that item appended, holding the text so far, and the rest of
``max_output_tokens``; exact as the chat continuation is (``text.py``). The tokens so far are
not the deltas: vLLM merges the outputs a stream has not sent yet into one delta when the
stream falls behind, which its Responses stream does often (more work per event than chat's),
so the shell counts them by ``/tokenize`` (:meth:`ResponsesReceived.recount`). Its events are the
stream's own: its leading events (``response.created`` … ``content_part.added``) dropped, every
other one carrying the stream's item id and the next ``sequence_number``, the ``done`` events
and ``response.completed`` holding the whole text, the first response's id and creation time,
and the whole answer's usage.

Only ``store: false`` requests are continued: a stored response would be the broken decode's
(the proxy sends a retrieval to the instance that answered, ``stored_responses.py``), so a
request that stores ends as before. So do tools, reasoning, structured text formats, log
probabilities, truncation, prompt templates, a follow-up (``previous_response_id``, served
whole) and a client's own partial assistant message.
Pure: dicts and bytes (the shell is ``migration.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from epd_proxy.request.apis import GENERATION_APIS, RESPONSES
from epd_proxy.wire.errors import ProxyError

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_EVENT = b"event: "
_DATA = b"data: "
# Request fields whose answer a continuation cannot reproduce, or whose state it would split.
_UNSOUND_FIELDS = frozenset(("tools", "tool_choice", "reasoning", "include", "top_logprobs", "prompt",
                             "conversation", "previous_response_id", "previous_input_messages", "background"))
_LEADING = frozenset(("response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"))
_TEXT_PARTS = frozenset(("input_text", "output_text", "text"))


def unsound(body: dict) -> str | None:
    """Why this Responses request's stream cannot be continued (None: it can)."""
    if body.get("store") is not False:
        return "store"
    if not _UNSOUND_FIELDS.isdisjoint(body):  # most bodies have none of them (one C-level pass)
        for name in sorted(_UNSOUND_FIELDS.intersection(body)):
            value = body[name]
            if value is not None and value is not False and value != [] and value != 0:
                return name
    if body.get("truncation") not in (None, "disabled"):
        return "truncation"
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text")):
            return "text"
    inp = body.get("input")
    if isinstance(inp, str):
        return None
    if not isinstance(inp, list) or not inp:
        return "input"
    for item in inp:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            return "input"
        content = item.get("content")
        if isinstance(content, list) and not all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS
                                                 for p in content):
            return "content"
        if not isinstance(content, (str, list)):
            return "content"
    if inp[-1].get("role") == "assistant":
        return "prefill"  # the client's own partial message, or an answer to go on from
    return None


@dataclass(slots=True)
class ResponsesReceived:
    """What the client has of a Responses answer: the response its first event began, the
    output message's item id, the text so far and the deltas it came in, the last sequence
    number."""

    id: object = None
    response: dict = field(default_factory=dict)  # response.created's
    head: bytes = b""  # response.created's event, for an in-band error's response.failed
    item: object = None  # the output message's id
    text: list[str] = field(default_factory=list)
    tokens: int = 0  # the answer so far in tokens: its text deltas, until :meth:`counted`
    seq: int = -1  # the last sequence number sent
    finished: bool = False
    unsound: str | None = None
    before: int = 0
    strip_ids = True
    via: str | None = None

    def take(self, event: dict, raw: bytes = b"") -> None:
        """Account for one event the client got."""
        kind = event.get("type")
        seq = event.get("sequence_number")
        if type(seq) is int:
            self.seq = seq
        if kind == "response.created":
            response = event.get("response")
            if isinstance(response, dict):
                self.response, self.id, self.head = response, response.get("id"), raw
        elif kind == "response.output_item.added":
            item = event.get("item")
            if not isinstance(item, dict) or item.get("type") != "message" or self.item is not None:
                self.unsound = str(item.get("type") if isinstance(item, dict) else "item")
            else:
                self.item = item.get("id")
        elif kind == "response.output_text.delta":
            delta = event.get("delta")
            if isinstance(delta, str):
                self.text.append(delta)
                self.tokens += 1
        elif kind in ("response.output_text.done", "response.output_item.done", "response.completed",
                      "response.incomplete"):
            self.finished = True
        elif kind is not None and kind not in _LEADING and kind != "response.content_part.done":
            self.unsound = str(kind)  # reasoning, tool calls, refusals: not a plain text answer

    def recount(self, body: dict) -> tuple[dict, dict]:
        """The two ``/tokenize`` requests whose difference is the answer so far in tokens: the
        conversation vLLM renders for ``body`` (its Responses to chat conversion: the
        instructions as a system message, each input message as is, an assistant one by its
        text), with the generation prompt, and with the text so far as the final message to
        continue, as the continuation renders it."""
        messages: list[dict] = []
        instructions = body.get("instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
        inp = body["input"]
        for item in [{"role": "user", "content": inp}] if isinstance(inp, str) else inp:
            content = item.get("content")
            if item.get("role") == "assistant" and isinstance(content, list) and content:
                content = content[0].get("text")
            messages.append({"role": item.get("role"), "content": content})
        common = {"model": body.get("model")}
        if isinstance(body.get("chat_template_kwargs"), dict):
            common["chat_template_kwargs"] = body["chat_template_kwargs"]
        return (dict(common, messages=messages, add_generation_prompt=True),
                dict(common, messages=messages + [{"role": "assistant", "content": "".join(self.text)}],
                     add_generation_prompt=False, continue_final_message=True))

    def counted(self, prompt: list[int] | None, continued: list[int] | None) -> None:
        """The answer so far in tokens from :meth:`recount`'s two answers: what the continued
        prompt holds after the original one. vLLM merges the outputs a slow stream has not
        sent yet into one delta (its Responses stream does more work per event than chat's, so
        it merges more), so counting deltas undercounts; the tokens the text renders to are
        the answer's own wherever the continuation can be exact at all (the text re-tokenizes
        to the ids that made it), and never fewer than the deltas. Left as counted when either
        is missing or the original prompt is no prefix of the continued one."""
        if prompt is None or continued is None or len(continued) < len(prompt) \
                or continued[:len(prompt)] != prompt:
            return
        self.tokens = max(self.tokens, len(continued) - len(prompt))

    def body(self, path: str, body: dict) -> dict:
        """The client's request with the text so far as a partial assistant message to continue."""
        cont = dict(body)
        inp = body["input"]
        items = [{"type": "message", "role": "user", "content": inp}] if isinstance(inp, str) else list(inp)
        items.append({"id": self.item, "type": "message", "role": "assistant", "status": "incomplete",
                      "content": [{"type": "output_text", "text": "".join(self.text), "annotations": []}]})
        cont["input"] = items
        limit = body.get("max_output_tokens")
        if type(limit) is int:
            cont["max_output_tokens"] = max(limit - self.tokens, 1)
        return cont

    def own(self, event: dict) -> bytes | None:
        """One continuation event as the stream's (None: a leading event the client had)."""
        kind = event.get("type")
        if kind in _LEADING:
            return None
        text = "".join(self.text)
        if kind == "response.output_text.delta":
            delta = event.get("delta")
            if isinstance(delta, str):
                self.text.append(delta)
                self.tokens += 1
        elif kind == "response.output_text.done":
            event["text"] = text
        elif kind == "response.content_part.done":
            part = event.get("part")
            if isinstance(part, dict):
                part["text"] = text
        elif kind == "response.output_item.done":
            _own_item(event.get("item"), self.item, text)
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self._own_response(event.get("response"), text)
            self.finished = True
        if "item_id" in event:
            event["item_id"] = self.item
        self.seq += 1
        event["sequence_number"] = self.seq
        return b"event: " + str(kind).encode() + b"\n" + _DATA + _encode(event) + b"\n\n"

    def _own_response(self, response: object, text: str) -> None:
        if not isinstance(response, dict):
            return
        for key in ("id", "created_at"):
            if key in self.response:
                response[key] = self.response[key]
        output = response.get("output")
        if isinstance(output, list):
            for item in output:
                _own_item(item, self.item, text)
        usage = response.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
            if type(prompt) is int and type(completion) is int:
                usage["input_tokens"] = prompt = max(prompt - self.before, 0)
                usage["output_tokens"] = completion = completion + self.before
                usage["total_tokens"] = prompt + completion

    def is_error(self, event: dict) -> bool:
        return event.get("type") == "error"

    def done(self) -> bytes:
        return b""  # a Responses stream has no terminator of its own

    def error(self, event: dict, raw: bytes) -> bytes:
        """Decode's own error event: the stream's next sequence number."""
        self.seq += 1
        event["sequence_number"] = self.seq
        return b"event: error\n" + _DATA + _encode(event) + b"\n\n"

    def in_band(self, error: ProxyError) -> bytes:
        """The proxy's in-band error as the Responses stream's (apis.py): ``error`` and
        ``response.failed`` for the response the stream began."""
        return GENERATION_APIS[RESPONSES].in_band_error(error, b'"sequence_number":%d' % self.seq, self.head)


def _own_item(item: object, item_id: object, text: str) -> None:
    """An output message item of the continuation as the stream's: its id, the whole text."""
    if not isinstance(item, dict) or item.get("type") != "message":
        return
    item["id"] = item_id
    content = item.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        content[0]["text"] = text


def received(data: bytes) -> ResponsesReceived:
    """The client's part of a Responses stream from the reads relayed (a trailing partial event
    was not sent; nothing after an error event counts)."""
    got = ResponsesReceived()
    end = data.rfind(b"\n\n")
    for raw in data[:end].split(b"\n\n") if end > 0 else ():
        at = raw.find(_DATA)
        if at < 0:
            continue
        try:
            event = _decode(raw[at + len(_DATA):])
        except msgspec.DecodeError:
            got.unsound = "unparsable"
            break
        if not isinstance(event, dict):
            continue
        if event.get("type") in ("error", "response.failed"):
            break
        got.take(event, raw.strip() + b"\n\n")
    return got
