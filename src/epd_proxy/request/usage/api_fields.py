"""The usage a client sees for a disaggregated Messages or Responses request, as one vLLM
instance reports it (chat's rule, usage/rewrite.py, in these APIs' own fields).

Decode's usage describes decode's share: the prompt tokens whose KV it received from the
prefill count as cached there. vLLM 0.32 writes the usage of these APIs from the same
numbers as chat's (docs/protocol.md §2.9):

* Anthropic (``anthropic/serving.py``): ``input_tokens`` is the prompt less the cached
  tokens, ``output_tokens`` the completion, ``cache_read_input_tokens`` the cached tokens
  (present only with ``--enable-prompt-tokens-details``); a stream's ``message_start``
  carries the whole prompt as ``input_tokens`` and no cache fields, its ``message_delta``
  the final usage.
* Responses (``openai/responses/serving.py``): ``input_tokens`` is the whole prompt,
  ``input_tokens_details.cached_tokens`` the cached tokens (always there), ``output_tokens``
  the completion, ``total_tokens`` their sum; a stream carries it in ``response.completed``.

So the client's usage takes the prompt side (input tokens and their cache details) from
the prefill's answer, which computed the prompt, and the output side from decode's. Only
the usage object changes; every other byte is relayed as received. Pure.
"""

from __future__ import annotations

import msgspec

from epd_proxy.observe.tokens import object_end
from epd_proxy.request.usage.rewrite import PrefillReport

# Anthropic's prompt-side fields, in the order vLLM's AnthropicUsage writes them.
_ANTHROPIC_FIELDS = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
_ANTHROPIC_PROMPT = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def messages_usage(decode: dict, prefill: dict | None) -> dict | None:
    """Anthropic: the prefill's input and cache fields, decode's output; None if unchanged."""
    if not prefill or not _is_count(prefill.get("input_tokens")):
        return None
    merged = dict(decode)
    for key in _ANTHROPIC_PROMPT:
        if key in prefill:
            merged[key] = prefill[key]
        else:
            merged.pop(key, None)
    out = {k: merged.pop(k) for k in _ANTHROPIC_FIELDS if k in merged}
    out.update(merged)  # fields a later vLLM may add, after the known ones
    return None if out == decode else out


def responses_usage(decode: dict, prefill: dict | None) -> dict | None:
    """Responses: the prefill's input tokens and their details, decode's output and the sum;
    None if unchanged."""
    if not prefill or not _is_count(prefill.get("input_tokens")):
        return None
    out = dict(decode)
    out["input_tokens"] = prefill["input_tokens"]
    if "input_tokens_details" in prefill:
        out["input_tokens_details"] = prefill["input_tokens_details"]
    if _is_count(out.get("output_tokens")) and "total_tokens" in out:
        out["total_tokens"] = out["input_tokens"] + out["output_tokens"]
    return None if out == decode else out


_OUTPUT = b',"output_tokens":'


def prompt_side_same(decode: bytes, prefill: bytes, cache_after_output: bool) -> bool:
    """Whether decode's raw usage object already has the prefill's prompt side, read from the
    bytes without decoding either (the common case: vLLM 0.32 over NIXL reports the prefill's
    count on decode). Both APIs write ``input_tokens`` first and the output count after the
    prompt's fields, except Anthropic's cache fields, which follow it
    (``cache_after_output``)."""
    d, p = decode.find(_OUTPUT), prefill.find(_OUTPUT)
    if d < 0 or d != p or decode[:d] != prefill[:p]:
        return False
    if not cache_after_output:
        return True  # Responses: what follows is the output side and the sum, decode's
    d_end, p_end = decode.find(b",", d + 1), prefill.find(b",", p + 1)
    if d_end < 0 and p_end < 0:  # no field after the output count in either
        return True
    if d_end < 0 or p_end < 0:
        return False
    return decode[d_end:] == prefill[p_end:]


def usage_span(doc: bytes, start: int = 0, stop: int | None = None) -> tuple[int, int] | None:
    """Where the last ``"usage":{...}`` object of ``doc`` (from ``start``) is: its first and
    one-past-last byte. A quote inside a JSON string is escaped, so ``"usage":{`` is a key;
    the usage objects of these APIs hold numbers, lists of numbers and objects of those, so
    their end is the brace that balances the first (the caller decodes the slice: any other
    shape does not decode, and is left alone)."""
    key = doc.rfind(b'"usage":{', start, len(doc) if stop is None else stop)
    if key < 0:
        return None
    end = object_end(doc, key + 8)
    return (key + 8, end) if end > 0 else None


def rewrite_api_usage(doc: bytes, report: PrefillReport, merge, cache_after_output: bool, start: int = 0,
                      stop: int | None = None) -> bytes:
    """``doc`` with its (last) usage object, between ``start`` and ``stop``, replaced by
    ``merge(decode's, prefill's)``; ``doc`` itself when that changes nothing or either cannot
    be read."""
    span = usage_span(doc, start, stop)
    if span is None:
        return doc
    at, end = span
    raw = doc[at:end]
    if prompt_side_same(raw, report.usage, cache_after_output):
        return doc
    prefill = report.prompt_usage()
    if prefill is None:
        return doc
    try:
        decode = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return doc
    if not isinstance(decode, dict):
        return doc
    new = merge(decode, prefill)
    if new is None:
        return doc
    return doc[:at] + msgspec.json.encode(new) + doc[end:]


def rewrite_usage_events(events: bytes, report: PrefillReport, name: bytes, merge, cache_after_output: bool) -> bytes:
    """Whole SSE events with the usage of the one named ``name`` (``event: NAME``) rewritten."""
    head = b"event: " + name + b"\n"
    at = events.find(head)
    if at < 0 or (at > 0 and events[at - 1] != 0x0A):
        return events
    end = events.find(b"\n\n", at)
    return rewrite_api_usage(events, report, merge, cache_after_output, at + len(head),
                             len(events) if end < 0 else end)
