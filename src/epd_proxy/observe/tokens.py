"""The tokens an answer reports: what the access log, the trace and the token metrics read
(chat's and completions' usage fields, and those of Messages and Responses).

Read from the answer's usage object alone: vLLM writes it compactly, after the choices,
as the last ``"usage":{`` of an answer (or of a stream's final usage event), holding
numbers and at most one nested object, so the object is found with two searches and
decoded by itself. Any other shape falls back to decoding the answer (or the event).
"""

from __future__ import annotations

import msgspec

# (prompt_tokens, completion_tokens, cached_tokens); None where the answer does not say.
Tokens = tuple
NO_TOKENS: Tokens = (None, None, None)


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None
    # Anthropic Messages (input_tokens: the prompt less what was read from or written to a
    # cache) and OpenAI Responses (input_tokens: the whole prompt; its details, the cached).
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    input_tokens_details: _Details | None = None


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None
    response: "_WithUsage | None" = None  # a Responses stream event: the usage is the response's


_usage_decoder = msgspec.json.Decoder(_Usage)
_answer_decoder = msgspec.json.Decoder(_WithUsage)


def _tokens(usage: _Usage | None) -> Tokens:
    if usage is None:
        return NO_TOKENS
    if usage.prompt_tokens is None and usage.input_tokens is not None:  # Messages, Responses
        read, written = usage.cache_read_input_tokens, usage.cache_creation_input_tokens
        details = usage.input_tokens_details
        cached = read if read is not None else details.cached_tokens if details is not None else None
        return usage.input_tokens + (read or 0) + (written or 0), usage.output_tokens, cached
    details = usage.prompt_tokens_details
    return usage.prompt_tokens, usage.completion_tokens, details.cached_tokens if details is not None else None


def object_end(doc: bytes, at: int) -> int:
    """One past the brace that closes the object opening at ``doc[at]``, or -1; for objects
    whose strings hold no braces (a usage object's keys). Counted by C-level searches, a
    step per closing brace, not per byte."""
    depth = 0
    pos = at
    while True:
        close = doc.find(b"}", pos)
        if close < 0:
            return -1
        depth += doc.count(b"{", pos, close) - 1
        if depth <= 0:
            return close + 1 if depth == 0 else -1
        pos = close + 1


def usage_of(data: bytes | None) -> Tokens:
    """The tokens of a whole answer, or of the SSE event holding the final usage object in
    ``data`` (a stream's last bytes); :data:`NO_TOKENS` when absent or unreadable."""
    if not data:
        return NO_TOKENS
    key = data.rfind(b'"usage":{')
    if key < 0:
        return NO_TOKENS
    at = key + 8
    close = data.find(b"}", at)
    if close >= 0 and data.find(b"{", at + 1, close) >= 0:  # one nested object: the next brace is ours
        close = data.find(b"}", close + 1)
    if close >= 0:
        try:
            return _tokens(_usage_decoder.decode(data[at:close + 1]))
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass  # deeper (a Responses usage), or not vLLM's shape
        end = object_end(data, at)
        if end > 0:
            try:
                return _tokens(_usage_decoder.decode(data[at:end]))
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass  # not vLLM's shape: read the document
    if data.startswith(b"{"):  # a whole JSON answer
        doc = data
    else:  # an SSE event: its ``data: `` line
        start = data.rfind(b"data: ", 0, key)
        end = data.find(b"\n", key)
        doc = data[start + 6: end if end >= 0 else len(data)]
    try:
        answer = _answer_decoder.decode(doc)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return NO_TOKENS
    if answer.usage is None and answer.response is not None:
        answer = answer.response
    return _tokens(answer.usage)
