"""The usage a client sees for a disaggregated request, as a single vLLM instance would report it.

With prefill and decode on different instances, decode's ``usage`` describes decode's
share: its ``prompt_tokens_details.cached_tokens`` counts the prompt tokens whose KV it
received from the prefill (vLLM 0.30 and other builds that do not carry the prefill's
count), not prefix-cache hits. A user of one instance reads ``cached_tokens`` as the
latter, so the proxy writes decode's final usage object again (docs/protocol.md §2.6.1):

* ``prompt_tokens`` is the prefill's (the instance that computed the prompt; it is
  decode's too when both tokenised the same prompt), ``completion_tokens`` decode's
  (the prefill's one token is discarded), ``total_tokens`` their sum;
* ``prompt_tokens_details.cached_tokens`` is the prefill's prefix-cache hits: from the
  prefill's own usage (vLLM reports it with ``--enable-prompt-tokens-details``), else
  ``remote_prefill_cached_tokens`` in its ``kv_transfer_params``, else 0; present, as
  vLLM has it, only when some instance reports details and the count is not 0.

This is the one exception to "bytes stay bytes": only the usage object is replaced,
every other byte of the answer or event is relayed as received, and an answer whose
usage is already right is not touched. Pure: the pipeline and the relay call it.
"""

from __future__ import annotations

from typing import TypeGuard

import msgspec

_NULL = b"null"


class _UsageOf(msgspec.Struct):
    usage: msgspec.Raw = msgspec.Raw(_NULL)


class _Kv(msgspec.Struct):
    remote_prefill_cached_tokens: object = None


class PrefillReport(msgspec.Struct, eq=False):
    """What the prefill's answer says about the prompt (kept raw until a rewrite needs it).
    A ``msgspec.Struct``: built on every P/D request, without an ``__init__`` frame."""

    usage: bytes  # the prefill answer's usage object, raw
    kv: bytes  # its kv_transfer_params, raw

    def prompt_usage(self) -> dict | None:
        """The prefill's usage object (None if absent or unreadable)."""
        try:
            usage = msgspec.json.decode(self.usage) if self.usage else None
        except msgspec.DecodeError:
            return None
        return usage if isinstance(usage, dict) else None

    def remote_cached(self) -> int | None:
        """``remote_prefill_cached_tokens`` from its kv_transfer_params (None if not a count)."""
        if not self.kv or self.kv == _NULL or self.kv.find(b"remote_prefill_cached_tokens") < 0:
            return None
        try:
            remote = msgspec.json.decode(self.kv, type=_Kv).remote_prefill_cached_tokens
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return remote if _is_count(remote) else None


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def merged_usage(decode: dict, prefill: dict | None, remote_cached: int | None) -> dict | None:
    """The usage the client should see, or None when decode's is right as it is."""
    out = dict(decode)
    prompt = prefill.get("prompt_tokens") if prefill else None
    if _is_count(prompt):
        out["prompt_tokens"] = prompt
    completion = out.get("completion_tokens")
    if _is_count(out.get("prompt_tokens")) and _is_count(completion):
        out["total_tokens"] = out["prompt_tokens"] + completion
    p_details = prefill.get("prompt_tokens_details") if prefill else None
    d_details = decode.get("prompt_tokens_details")
    p_cached = p_details.get("cached_tokens") if isinstance(p_details, dict) else None
    if _is_count(p_cached):
        cached = p_cached
    elif remote_cached is not None:
        cached = remote_cached
    else:
        cached = 0  # not known: better none than the transferred tokens
    reported = isinstance(p_details, dict) or isinstance(d_details, dict)
    if reported and cached:
        details = dict(d_details) if isinstance(d_details, dict) else dict(p_details or {})
        details["cached_tokens"] = cached
        out["prompt_tokens_details"] = details
    elif "prompt_tokens_details" in out:
        out["prompt_tokens_details"] = None
    return None if out == decode else out


def rewrite_usage(doc: bytes, report: PrefillReport) -> bytes:
    """``doc`` (one JSON object: decode's answer, or the payload of its final usage event)
    with its top-level ``usage`` replaced by :func:`merged_usage`; ``doc`` itself when that
    changes nothing or it cannot be read."""
    span = _usage_span(doc)
    if span is not None:  # vLLM's shape: only the usage object is decoded
        at, end, decode = span
        raw_len = end - at
    else:  # any other shape: read the whole document to find the top-level usage
        try:
            raw = bytes(msgspec.json.decode(doc, type=_UsageOf).usage)
            if raw == _NULL:
                return doc
            decode = msgspec.json.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return doc
        if not isinstance(decode, dict):
            return doc
        at = _usage_value_at(doc, raw)
        if at < 0:
            return doc
        raw_len = len(raw)
    if _already_right(decode, report.usage):
        return doc
    prefill = report.prompt_usage()
    details = prefill.get("prompt_tokens_details") if prefill else None
    # The kv params' count is read only when the prefill's own usage has none.
    has_count = isinstance(details, dict) and _is_count(details.get("cached_tokens"))
    new = merged_usage(decode, prefill, None if has_count else report.remote_cached())
    if new is None:
        return doc
    return doc[:at] + msgspec.json.encode(new) + doc[at + raw_len:]


def rewrite_answer_usage(doc: bytes, report: PrefillReport) -> tuple[bytes, tuple | None]:
    """:func:`rewrite_usage` for a whole answer, with the tokens it reports (``Tokens``,
    observe/tokens.py) when the usage object read on the way says them: vLLM's chat usage,
    already right (the common case). None: the caller reads them (``usage_of``), so an
    answer's usage is found and decoded once on the common path, not once for the client
    and again for the metrics."""
    span = _usage_span(doc)
    if span is not None:
        decode = span[2]
        # Counts that add up, the details null and none of the other APIs' usage keys: what
        # usage_of reads from this object.
        if _already_right(decode, report.usage) and _OTHER_APIS_KEYS.isdisjoint(decode):
            return doc, (decode["prompt_tokens"], decode["completion_tokens"], None)
    return rewrite_usage(doc, report), None


# The usage keys of Messages and Responses that observe/tokens.py reads too.
_OTHER_APIS_KEYS = frozenset(("input_tokens", "output_tokens", "cache_read_input_tokens",
                              "cache_creation_input_tokens", "input_tokens_details"))


def _already_right(decode: dict, prefill: bytes) -> bool:
    """What :func:`merged_usage` decides in the common case, read from the prefill's raw usage
    without decoding it: neither instance reports details, both counted the same prompt and
    decode's total adds up. (vLLM without ``--enable-prompt-tokens-details``: most answers.)"""
    prompt = decode.get("prompt_tokens")
    completion = decode.get("completion_tokens")
    return (type(prompt) is int and type(completion) is int and decode.get("total_tokens") == prompt + completion
            and decode.get("prompt_tokens_details") is None
            # vLLM's null details first: one search in the common case, not two.
            and (b'"prompt_tokens_details":null' in prefill or b'"prompt_tokens_details"' not in prefill)
            and prefill.startswith(b'{"prompt_tokens":%d,' % prompt))


def _usage_span(doc: bytes) -> tuple[int, int, dict] | None:
    """Where the top-level ``"usage":{...}`` object is, found without decoding the document,
    with the object decoded; None when the document is not shaped as vLLM writes it.

    vLLM writes compact JSON with ``usage`` after ``choices`` and no other ``usage`` key
    (the answer's text is inside strings, where a quote is escaped, so ``"usage":`` cannot
    occur there), and its usage object holds numbers and at most one nested object: the
    last ``"usage":{`` is the key, and its object ends at the brace that closes it. Any
    other shape (whitespace, deeper nesting, a slice that does not decode to an object)
    returns None and the caller reads the whole document."""
    key = doc.rfind(b'"usage":{')
    if key < 0:
        return None
    at = key + 8
    close = doc.find(b"}", at)
    inner = doc.find(b"{", at + 1, close)
    if inner >= 0:  # one nested object (prompt_tokens_details): the next brace closes ours
        if doc.find(b"{", inner + 1, close) >= 0:
            return None
        close = doc.find(b"}", close + 1)
    if close < 0:
        return None
    end = close + 1
    try:  # a slice that decodes is exactly the object: parsing from its start ends there
        decode = msgspec.json.decode(doc[at:end])
    except msgspec.DecodeError:
        return None
    return (at, end, decode) if isinstance(decode, dict) else None


def _usage_value_at(doc: bytes, raw: bytes) -> int:
    """Where the top-level ``"usage"`` key's value starts. A JSON string cannot hold an
    unescaped quote, so ``"usage"`` followed by a colon is a key; the one whose value is
    ``raw`` is the top-level one (vLLM's answers have no other)."""
    start = 0
    while True:
        key = doc.find(b'"usage"', start)
        if key < 0:
            return -1
        pos = key + 7
        while pos < len(doc) and doc[pos] in b" \t\r\n":
            pos += 1
        if pos < len(doc) and doc[pos] == 0x3A:  # ':'
            pos += 1
            while pos < len(doc) and doc[pos] in b" \t\r\n":
                pos += 1
            if doc.startswith(raw, pos):
                return pos
        start = key + 1


def rewrite_final_usage_events(data: bytes, report: PrefillReport) -> bytes:
    """Complete SSE events with the final usage event's usage rewritten. That event is the one
    with ``"choices":[]`` (vLLM's usage chunk); per-chunk usage (``continuous_usage_stats``)
    is left as received."""
    out = []
    changed = False
    for event in data.split(b"\n\n"):
        if event.startswith(b"data: {") and event.find(b'"usage"') >= 0 and event.find(b'"choices":[]') >= 0:
            payload = event[6:]
            new = rewrite_usage(payload, report)
            if new is not payload:
                event = b"data: " + new
                changed = True
        out.append(event)
    return b"\n\n".join(out) if changed else data
