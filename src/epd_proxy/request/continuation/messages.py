"""Continuing a broken ``/v1/messages`` (Anthropic) stream on another decode.

vLLM 0.32's Messages endpoint renders a conversation that ends with an assistant message as a
closed turn and a new generation prompt: its request conversion (``anthropic/serving.py``,
``_build_base_request``) never sets ``continue_final_message``, and the chat parameters it
builds (``build_chat_params``: ``add_generation_prompt`` true, ``continue_final_message``
false) override any in ``chat_template_kwargs``. Anthropic's assistant prefill is therefore a
new answer there, not a continuation. The Messages endpoint is vLLM's chat endpoint behind a
conversion, so the continuation is that conversion made here (for text conversations: the
system text first, each message's text as vLLM converts it) sent to ``/v1/chat/completions``
with the answer so far as a final assistant message, ``continue_final_message: true`` and
``add_generation_prompt: false``: the same renderer, the same prompt, continued; exact as the
chat continuation is (``text.py``). Its chunks are rendered as the Messages stream's events:
the text block's deltas at the index it had (a new block at the next index when the break
fell between blocks), one ``content_block_stop``, one ``message_delta`` with the stop reason
vLLM would give and the whole answer's usage, one ``message_stop``.

Only text conversations and text answers: tools, thinking, images, documents, a system message
inside ``messages``, a client's own assistant prefill, ``output_config`` end as before.
Pure: dicts and bytes (the shell is ``migration.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from epd_proxy.request.continuation.recount import answer_tokens, chat_requests
from epd_proxy.request.ingress import CHAT
from epd_proxy.wire.errors import ProxyError

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_EVENT = b"event: "
_DATA = b"data: "
# Request fields whose answer the continuation cannot reproduce (None or empty: unset).
_UNSOUND_FIELDS = frozenset(("tools", "tool_choice", "thinking", "output_config"))
# The fields vLLM's conversion copies to the chat request (``_build_base_request``), by name there.
_COPIED = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("stop_sequences", "stop"),
           ("watermarking", "watermarking"), ("cache_salt", "cache_salt"), ("vllm_xargs", "vllm_xargs"),
           ("chat_template_kwargs", "chat_template_kwargs"), ("model", "model"))
_BILLING = "x-anthropic-billing-header"  # vLLM drops system blocks that start with it


def unsound(body: dict) -> str | None:
    """Why this Messages request's stream cannot be continued (None: it can)."""
    if not _UNSOUND_FIELDS.isdisjoint(body):  # most bodies have none of them (one C-level pass)
        for name in sorted(_UNSOUND_FIELDS.intersection(body)):
            value = body[name]
            if value is not None and value is not False and value != []:
                return name
    system = body.get("system")
    if system is not None and not isinstance(system, str) and _texts(system) is None:
        return "system"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages"
    for msg in messages:
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            return "messages"
        content = msg.get("content")
        if not isinstance(content, str) and _texts(content) is None:
            return "content"
    if messages[-1].get("role") == "assistant":
        return "prefill"  # the client's own prefill: vLLM answers it as a new turn
    if type(body.get("max_tokens")) is not int:
        return "max_tokens"
    return None


def _texts(blocks: object) -> list[str] | None:
    """The texts of a list of text blocks (None: not all of them are)."""
    if not isinstance(blocks, list):
        return None
    out = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            return None
        out.append(block["text"])
    return out


def chat_messages(body: dict) -> list[dict]:
    """The chat messages vLLM 0.32 makes of a text conversation (``to_chat_completion_request``):
    the system text joined as one system message first, each message's text as a string (one
    non-empty text block) or text parts (several), a user message without text left out."""
    out: list[dict] = []
    system = body.get("system")
    if isinstance(system, str):
        parts = [system] if system else []
    else:
        parts = [t for t in _texts(system) or () if t and not t.startswith(_BILLING)]
    if parts:
        out.append({"role": "system", "content": "".join(parts)})
    for msg in body["messages"]:
        content = msg["content"]
        one: dict = {"role": msg["role"]}
        if isinstance(content, str):
            one["content"] = content
        else:
            texts = [t for t in _texts(content) or () if t]
            if len(texts) == 1:
                one["content"] = texts[0]
            elif texts:
                one["content"] = [{"type": "text", "text": t} for t in texts]
        if not (one["role"] == "user" and "content" not in one):
            out.append(one)
    return out


def _event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\n" + _DATA + _encode(data) + b"\n\n"


@dataclass(slots=True)
class MessagesReceived:
    """What the client has of a Messages answer: its message (id, model, input usage), the text
    of its text block so far and the deltas it came in, where that block is."""

    id: object = None
    model: object = None
    usage: dict = field(default_factory=dict)  # message_start's (the prompt's, as the client has it)
    text: list[str] = field(default_factory=list)
    tokens: int = 0  # the answer so far in tokens: its text deltas (one per chat chunk), until :meth:`counted`
    index: int = 0  # the index of the open block, or of the next one
    open: bool = False  # a text block is open
    finished: bool = False  # message_delta was sent: nothing is left to continue
    unsound: str | None = None
    before: int = 0  # the tokens before the leg now streaming
    stop: tuple = ("end_turn", None)  # the continuation's stop reason and stop sequence
    ended: bool = False  # the continuation's closing events went out
    strip_ids = True
    via = CHAT  # the continuation is sent to vLLM's chat endpoint

    def take(self, name: bytes, event: dict) -> None:
        """Account for one event the client got."""
        kind = event.get("type")
        if name == b"message_start" or kind == "message_start":
            message = event.get("message")
            if isinstance(message, dict):
                self.id, self.model = message.get("id"), message.get("model")
                usage = message.get("usage")
                self.usage = usage if isinstance(usage, dict) else {}
        elif kind == "content_block_start":
            block = event.get("content_block")
            if not isinstance(block, dict) or block.get("type") != "text":
                self.unsound = str(block.get("type") if isinstance(block, dict) else "block")
            self.index, self.open = _int(event.get("index"), self.index), True
        elif kind == "content_block_delta":
            delta = event.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                self.text.append(delta["text"])
                self.tokens += 1
            else:
                self.unsound = "delta"
        elif kind == "content_block_stop":
            self.index, self.open = _int(event.get("index"), self.index) + 1, False
        elif kind == "message_delta" or kind == "message_stop":
            self.finished = True

    def body(self, path: str, body: dict) -> dict:
        """The chat request that continues the answer (for ``via``)."""
        cont: dict = {}
        for name, chat_name in _COPIED:
            value = body.get(name)
            if value is not None:
                cont[chat_name] = value
        rest = max(body["max_tokens"] - self.tokens, 1)
        cont["max_tokens"] = cont["max_completion_tokens"] = rest
        cont["messages"] = chat_messages(body) + [{"role": "assistant", "content": "".join(self.text)}]
        cont["continue_final_message"] = True
        cont["add_generation_prompt"] = False
        cont["stream"] = True
        cont["stream_options"] = {"include_usage": True}
        return cont

    def recount(self, body: dict) -> tuple[dict, dict]:
        """The two ``/tokenize`` requests whose difference is the answer so far in tokens
        (``recount.py``): the chat vLLM makes of the conversation, without and with it."""
        return chat_requests(body, chat_messages(body), "".join(self.text))

    def counted(self, prompt: list[int] | None, continued: list[int] | None) -> None:
        """The answer so far in tokens from :meth:`recount`'s two answers."""
        self.tokens = answer_tokens(self.tokens, prompt, continued)

    def own(self, event: dict) -> bytes | None:
        """One chat chunk of the continuation as the Messages stream's events (None: nothing)."""
        choices = event.get("choices")
        if choices:
            choice = choices[0]
            if not isinstance(choice, dict):
                return None
            out = b""
            delta = choice.get("delta")
            content = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(content, str) and content:
                if not self.open:
                    out += _event("content_block_start", {"type": "content_block_start",
                                                          "content_block": {"type": "text", "text": ""},
                                                          "index": self.index})
                    self.open = True
                out += _event("content_block_delta", {"type": "content_block_delta",
                                                      "delta": {"type": "text_delta", "text": content},
                                                      "index": self.index})
                self.text.append(content)
                self.tokens += 1
            finish = choice.get("finish_reason")
            if finish is not None:
                self.stop = _stop_reason(finish, choice.get("stop_reason"))
            return out or None
        usage = event.get("usage")
        if isinstance(usage, dict):
            completion = usage.get("completion_tokens")
            return self.end(completion if type(completion) is int else self.tokens - self.before)
        return None

    def end(self, completion: int) -> bytes:
        """The closing events: the open block stopped, the message's delta with the whole
        answer's usage (the prompt's as ``message_start`` said it, the output counting the
        tokens before the break), the message stopped."""
        if self.ended:
            return b""
        self.ended = self.finished = True
        out = b""
        if self.open:
            out += _event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open = False
        usage = {"input_tokens": _int(self.usage.get("input_tokens"), 0), "output_tokens": self.before + completion}
        for key in ("cache_creation_input_tokens", "cache_read_input_tokens"):
            if type(self.usage.get(key)) is int:
                usage[key] = self.usage[key]
        reason, sequence = self.stop
        out += _event("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                        "usage": usage})
        return out + _event("message_stop", {"type": "message_stop"})

    def is_error(self, event: dict) -> bool:
        """Decode's own in-band error event (vLLM's ``{"error": ...}``)."""
        return "error" in event and "choices" not in event

    def done(self) -> bytes:
        """The chat stream's terminator: the closing events if the usage chunk did not bring them."""
        return self.end(self.tokens - self.before)

    def error(self, event: dict, raw: bytes) -> bytes:
        """Decode's own in-band error, as vLLM's Messages stream ends on one: an ``error`` event
        (Anthropic's type for a server's failure), nothing after it."""
        self.ended = True
        err = event.get("error")
        message = err.get("message") if isinstance(err, dict) else None
        return _event("error", {"type": "error", "error": {"type": "api_error", "message": str(message or err)}})

    def in_band(self, error: ProxyError) -> bytes:
        self.ended = True
        return error.anthropic_event()


def _int(value: object, default: int) -> int:
    return value if type(value) is int else default


def _stop_reason(finish: object, stop: object) -> tuple:
    """vLLM's mapping of a chat finish to Anthropic's stop reason (``_to_anthropic_stop_reason``)
    for a text answer."""
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def received(data: bytes) -> MessagesReceived:
    """The client's part of a Messages stream from the reads relayed (named events; a trailing
    partial event was not sent and does not count; nothing after an error event does)."""
    got = MessagesReceived()
    end = data.rfind(b"\n\n")
    for raw in data[:end].split(b"\n\n") if end > 0 else ():
        name, payload = b"", b""
        for line in raw.strip().split(b"\n"):
            if line.startswith(_EVENT):
                name = line[len(_EVENT):].strip()
            elif line.startswith(_DATA):
                payload = line[len(_DATA):]
        if not payload:
            continue
        if name == b"error":
            break
        try:
            event = _decode(payload)
        except msgspec.DecodeError:
            got.unsound = "unparsable"
            break
        if isinstance(event, dict):
            got.take(name, event)
    return got
