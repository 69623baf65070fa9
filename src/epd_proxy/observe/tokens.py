"""The tokens an answer reports: what the access log, the trace and the token metrics read.

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


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_Usage)
_answer_decoder = msgspec.json.Decoder(_WithUsage)


def _tokens(usage: _Usage | None) -> Tokens:
    if usage is None:
        return NO_TOKENS
    details = usage.prompt_tokens_details
    return usage.prompt_tokens, usage.completion_tokens, details.cached_tokens if details is not None else None


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
            pass  # not vLLM's shape: read the document
    if data.startswith(b"{"):  # a whole JSON answer
        doc = data
    else:  # an SSE event: its ``data: `` line
        start = data.rfind(b"data: ", 0, key)
        end = data.find(b"\n", key)
        doc = data[start + 6: end if end >= 0 else len(data)]
    try:
        return _tokens(_answer_decoder.decode(doc).usage)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return NO_TOKENS
