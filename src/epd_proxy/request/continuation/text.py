"""Continuing a broken chat or completions stream on another decode: what the client has
received, the request that continues it, and the continuation's events made the stream's own.

Pure functions and data over bytes and dicts (the shell is ``migration.py``). The client's
stream is parsed only here, and only when it broke: a stream that never breaks pays for
none of it (its relay keeps the reads it relayed by reference, ``relay.py``).

The continuation is a *text* continuation, measured against a token-in one (docs/protocol.md
§5.3.1): chat sends the conversation with the partial answer as the last assistant message and
``continue_final_message: true``, ``add_generation_prompt: false`` (vLLM renders the template
without closing that message, so the model goes on from its last token); completions sends the
prompt with the partial text appended. Both ask for the rest of the token budget. At
temperature 0 it is exact when the partial text re-tokenizes to the ids that produced it (it
does at a token boundary for the text vLLM streamed; a word split across events stays whole).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from epd_proxy.request.continuation.recount import answer_tokens, chat_requests, prompt_requests
from epd_proxy.request.ingress import CHAT, COMPLETIONS
from epd_proxy.wire.errors import ProxyError

# What makes a stream's continuation unsound (its answer would not be the uninterrupted one's,
# or the proxy could not say the rest in the client's terms): it ends as before, in-band.
_UNSOUND_FIELDS = frozenset(("logprobs", "top_logprobs", "prompt_logprobs", "tools", "functions",
                             "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                             "structured_outputs", "seed", "echo", "suffix", "best_of", "continue_final_message",
                             "logit_bias", "n", "presence_penalty", "frequency_penalty"))
# Penalties over the generated tokens only: the answer so far moves into the continuation's
# prompt, where they no longer count it (unsound unless zero).
_PENALTIES = frozenset(("presence_penalty", "frequency_penalty"))

_DATA = b"data: "
_DONE = b"[DONE]"
_encode = msgspec.json.encode
_decode = msgspec.json.decode


def unsound(path: str, body: dict) -> str | None:
    """Why this request's stream cannot be continued (None: it can). Only single-choice chat and
    completions streams with a text prompt: ``n > 1``, log probabilities, tools, guided decoding,
    a seed (the continuation would not be the seeded answer) and the like end as before."""
    if path != CHAT and path != COMPLETIONS:
        return "api"
    if not _UNSOUND_FIELDS.isdisjoint(body):  # most bodies have none of them (one C-level pass)
        why = _unsound_field(body)
        if why is not None:
            return why
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return "prompt"
    elif not isinstance(body.get("messages"), list):
        return "messages"
    return None


def _unsound_field(body: dict) -> str | None:
    """The first field of ``body`` that makes its continuation unsound (unset-like values pass)."""
    for name in _UNSOUND_FIELDS.intersection(body):
        value = body[name]
        if value is None or value is False or value == [] or (name == "n" and value == 1):
            continue
        if name in _PENALTIES and value == 0:
            continue
        return name
    return None


def first_choice(event: dict) -> dict | None:
    """An OpenAI-style event's first choice, if it has one that is an object."""
    choices = event.get("choices")
    if not choices or not isinstance(choices, list):
        return None
    choice = choices[0]
    return choice if isinstance(choice, dict) else None


class OpenAiStream:
    """The ends of an OpenAI-style stream (chat, completions, generate): ``data:`` events,
    vLLM's ``{"error": ...}`` in band, ``[DONE]`` last."""

    __slots__ = ()

    def is_error(self, event: dict) -> bool:
        """Decode's own in-band error event (vLLM's ``{"error": ...}``)."""
        return "error" in event and "choices" not in event

    def done(self) -> bytes:
        """The terminator, as the stream's."""
        return b"data: [DONE]\n\n"

    def error(self, event: dict, raw: bytes) -> bytes:
        """Decode's own in-band error event, as the stream's."""
        return raw + b"\n\n"

    def in_band(self, error: ProxyError) -> bytes:
        """The proxy's in-band error, in the stream's form."""
        return error.sse_event()


@dataclass(slots=True)
class Received(OpenAiStream):
    """What the client has of the answer: the stream's identity (its first event's), the text so
    far and its tokens (the events it came in, until :meth:`counted`: vLLM merges the outputs a
    slow stream has not sent into one event)."""

    id: object = None
    created: object = None
    model: object = None
    fingerprint: object = None
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finished: bool = False  # the choice's finish was sent: nothing is left to continue
    unsound: str | None = None  # something in the answer cannot be continued (a tool call, reasoning)
    before: int = 0  # the tokens of the answer before the leg now streaming (its usage adds them)
    # The events' ``token_ids`` are not the answer (the proxy asked for them, or the client did
    # on chat and completions): taken out of the continuation's events (generate's are kept).
    strip_ids = True
    via: str | None = None  # the continuation goes to the client's path

    def body(self, path: str, body: dict) -> dict:
        return continuation_body(path, body, self)

    def own(self, event: dict) -> bytes | None:
        return own_event(event, self)

    def recount(self, body: dict) -> tuple[dict, dict]:
        """The two ``/tokenize`` requests whose difference is the answer so far in tokens
        (``recount.py``): chat's conversation, or completions' prompt, without and with it."""
        text = "".join(self.text)
        if "messages" in body:
            return chat_requests(body, list(body["messages"]), text)
        prompt = body["prompt"]
        return prompt_requests(body, prompt[0] if isinstance(prompt, list) else prompt, text)

    def counted(self, prompt: list[int] | None, continued: list[int] | None) -> None:
        """The answer so far in tokens from :meth:`recount`'s two answers."""
        self.tokens = answer_tokens(self.tokens, prompt, continued)

    def take(self, event: dict) -> None:
        """Account for one event the client got."""
        if self.id is None:
            self.id = event.get("id")
            self.created = event.get("created")
            self.model = event.get("model")
            self.fingerprint = event.get("system_fingerprint")
        choice = first_choice(event)
        if choice is None:
            return
        delta = choice.get("delta")
        if isinstance(delta, dict):  # chat
            if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
                self.unsound = "tool_calls" if delta.get("tool_calls") else "reasoning"
            text = delta.get("content")
            if isinstance(text, str) and text:
                self.text.append(text)
                self.tokens += 1
        else:
            # vLLM's completions stream sends an event per token, its text empty while the
            # token's character is incomplete or held back for a stop string: each one counts.
            text = choice.get("text")
            if isinstance(text, str):
                if text:
                    self.text.append(text)
                self.tokens += 1
        if choice.get("finish_reason") is not None:
            self.finished = True


def received(data: bytes) -> Received:
    """The client's part of a chat or completions stream from the reads relayed."""
    return read_events(data, Received())


def read_events(data: bytes, got):
    """``got`` (a stream's received record) given every event of ``data``, the reads relayed: a
    trailing partial event was not sent and does not count; nothing after an error event does."""
    end = data.rfind(b"\n\n")
    for raw in data[:end].split(b"\n\n") if end > 0 else ():
        line = raw.strip()
        if not line.startswith(_DATA):
            continue
        payload = line[len(_DATA):]
        if payload == _DONE:
            break
        try:
            event = _decode(payload)
        except msgspec.DecodeError:
            got.unsound = "unparsable"
            break
        if not isinstance(event, dict):
            continue
        if "error" in event and "choices" not in event:
            break
        got.take(event)
    return got


def continuation_body(path: str, body: dict, got: Received) -> dict:
    """The request that continues ``got`` on another decode: the client's body (already the
    one every stage gets) with the partial answer appended and the rest of its token budget."""
    cont = dict(body)
    text = "".join(got.text)
    if path == CHAT:
        cont["messages"] = list(body["messages"]) + [{"role": "assistant", "content": text}]
        cont["continue_final_message"] = True
        cont["add_generation_prompt"] = False
        keys: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    else:
        prompt = body["prompt"]
        cont["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + text
        keys = ("max_tokens",)
    done = got.tokens
    for key in keys + ("min_tokens",):
        value = body.get(key)
        if type(value) is int:
            cont[key] = max(value - done, 0 if key == "min_tokens" else 1)
    return cont


def own_event(event: dict, got: Received) -> bytes | None:
    """One event of a continuation as the client's stream's: its identity, the role the stream
    already announced taken out (None: an event left with nothing to say), the text accounted
    for; a usage counts the whole answer (the continuation's prompt held the answer so far)."""
    event["id"] = got.id
    if got.created is not None:
        event["created"] = got.created
    if got.model is not None:
        event["model"] = got.model
    if "system_fingerprint" in event and got.fingerprint is not None:
        event["system_fingerprint"] = got.fingerprint
    choices = event.get("choices")
    if choices:
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and "role" in delta:
            del delta["role"]
            if not delta.get("content") and choice.get("finish_reason") is None and len(delta) <= 1:
                return None
        got.take(event)
    usage = event.get("usage")
    if isinstance(usage, dict):
        whole_usage(usage, got.before)
    return _DATA + _encode(event) + b"\n\n"


def whole_usage(usage: dict, before: int) -> None:
    """A continuation's usage as the whole answer's: the ``before`` tokens streamed before it
    counted in the completion (generate's ids; the text APIs' by ``/tokenize``, ``recount.py``,
    or their events where that failed) and taken out of its prompt (which held them as text):
    the prompt is exact when the partial answer re-tokenized to as many tokens as were
    streamed, as at a token boundary on real vLLM."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is int and type(completion) is int:
        usage["prompt_tokens"] = prompt = max(prompt - before, 0)
        usage["completion_tokens"] = completion = completion + before
        if "total_tokens" in usage:
            usage["total_tokens"] = prompt + completion
