"""Decode's parameters in a stream: taken out of the event that carries them, and read back
with the answer the stream spelled, for the next turn.

vLLM 0.32 sends them in no chat, completions or Messages stream, but its Responses stream
ends with a ``response.completed`` event whose ``response`` is the whole answer, parameters
included; a later vLLM sends them in a chat or completions stream's last chunk. Either way
only the event that carries them changes (:func:`strip_stream_params`), every other byte goes
out as received. To keep them for the next turn the proxy needs the token ids decode holds,
which a stream carries only when asked (``return_token_ids``, generate's token ids), so
:func:`read_stream` reads them back from the events when they are there.

Pure: bytes in, bytes and plain data out.
"""

from __future__ import annotations

import msgspec

from epd_proxy.request.turns.multiturn import CHOICES, NO_IDS, REASONING, UNKNOWN

KEY = b'"kv_transfer_params":'
MARK = b'"kv_transfer_params":{'


def _object_end(buf: bytes, start: int) -> int:
    """The index after the JSON object that opens at ``buf[start]`` (``{``); -1 if it does
    not close in ``buf``."""
    depth = 0
    i, n = start, len(buf)
    while i < n:
        c = buf[i]
        if c == 0x22:  # a string: to its unescaped closing quote
            i += 1
            while i < n:
                c = buf[i]
                if c == 0x5C:
                    i += 2
                    continue
                if c == 0x22:
                    break
                i += 1
        elif c == 0x7B or c == 0x5B:
            depth += 1
        elif c == 0x7D or c == 0x5D:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def strip_stream_params(events: bytes) -> tuple[bytes, list[bytes]]:
    """Whole SSE events with every ``kv_transfer_params`` object (at any depth: a Responses
    event nests the answer) replaced by ``null``, and the objects taken out, as sent."""
    found: list[bytes] = []
    if events.find(KEY) < 0:
        return events, found
    out = []
    pos = 0
    while True:
        at = events.find(KEY, pos)
        if at < 0:
            break
        start = at + len(KEY)
        while start < len(events) and events[start] in b" \t":
            start += 1
        if start >= len(events) or events[start] != 0x7B:
            out.append(events[pos:start])
            pos = start
            continue
        end = _object_end(events, start)
        if end < 0 or events.find(b"\n\n", start, end) >= 0:
            out.append(events[pos:start])  # not an object within one event: left alone
            pos = start
            continue
        found.append(events[start:end])
        out.append(events[pos:start])
        out.append(b"null")
        pos = end
    out.append(events[pos:])
    return b"".join(out), found


def params_of(found: list[bytes]) -> dict | None:
    """The last of the objects :func:`strip_stream_params` took out that holds blocks."""
    for raw in reversed(found):
        try:
            params = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            continue
        if isinstance(params, dict) and params.get("do_remote_decode") is True:
            return params
    return None


class _Delta(msgspec.Struct):
    content: object = None
    tool_calls: object = None
    reasoning_content: object = None
    reasoning: object = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    text: object = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class _Event(msgspec.Struct):
    choices: list[_Choice] = []
    prompt_token_ids: list[int] | None = None


class StreamAnswer:
    """What a chat, completions or generate stream spelled: the answer's text, the prompt's
    token ids and the answer's (None where the stream did not carry them), or why it cannot
    be continued (``reason``)."""

    __slots__ = ("text", "prompt_ids", "output", "reason")

    def __init__(self, text: str, prompt_ids: list[int] | None, output: list[int] | None, reason: str) -> None:
        self.text = text
        self.prompt_ids = prompt_ids
        self.output = output
        self.reason = reason


def read_stream(events: bytes) -> StreamAnswer:
    """The answer of a stream of ``data:`` chunks of one choice, read back from its events."""
    texts: list[str] = []
    output: list[int] | None = []
    prompt_ids = None
    decoder = msgspec.json.Decoder(_Event)
    for event in events.split(b"\n\n"):
        at = event.find(b"data: {")
        if at < 0 or (at and event[at - 1] != 0x0A):
            continue
        try:
            doc = decoder.decode(event[at + 6:])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return StreamAnswer("", None, None, UNKNOWN)
        if doc.prompt_token_ids is not None:
            prompt_ids = doc.prompt_token_ids
        for choice in doc.choices:
            if choice.index != 0:
                return StreamAnswer("", None, None, CHOICES)
            if choice.prompt_token_ids is not None:
                prompt_ids = choice.prompt_token_ids
            text = choice.text
            delta = choice.delta
            if delta is not None:
                if delta.reasoning_content or delta.reasoning:
                    return StreamAnswer("", None, None, REASONING)
                if delta.tool_calls:
                    return StreamAnswer("", None, None, UNKNOWN)  # tool calls are not rebuilt from deltas
                text = delta.content
            if isinstance(text, str) and text:
                texts.append(text)
            if choice.token_ids is not None:
                if output is not None:
                    output.extend(choice.token_ids)
            elif isinstance(text, str) and text:
                output = None  # text without its ids: the answer's tokens are not known
    if output is None:
        return StreamAnswer("", None, None, NO_IDS)
    return StreamAnswer("".join(texts), prompt_ids, output, "")
