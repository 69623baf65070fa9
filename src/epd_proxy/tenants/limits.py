"""Pure: one request against its key's limits, and the rate-limit headers its SDK reads.

Each limit is a counter in a fixed window aligned to the clock (a second, a minute, a UTC
day, a UTC calendar month), as Envoy's rate-limit service counts: the counter's key names
the window, so it resets by itself when the window turns. A request is admitted when
every counter it touches has room (:func:`fits`), and then counted in all of them at once
(the counters' store does both atomically); refused, it is counted in none.

What a request counts:

* ``requests_*``: 1;
* ``input_tokens_per_minute`` and the ``tokens_per_*`` budgets: its input tokens, estimated
  before the request from the body's size (:func:`estimate_input_tokens`), settled from the
  answer's usage afterwards (the difference added: ``settlement``);
* ``output_tokens_per_minute``: nothing up front (a request is let in while the window is
  below its limit: the answer's length is not known), its output tokens afterwards; the
  budgets count them too.

A request larger than a whole window's limit passes only into an empty window (else it
could never pass).
"""

from __future__ import annotations

import calendar
import hashlib
import math
import time
from dataclasses import dataclass

from epd_proxy.tenants.table import LIMITS, KeyPolicy

_COUNTS = {name: counts for name, counts, _ in LIMITS}  # limit -> what it counts
WINDOW_SECONDS = {"second": 1, "minute": 60, "day": 86400}
# Bytes of request body per input token, for the estimate: BPE tokenizers average about 4
# characters of English per token, and a JSON body's keys and quoting add some more.
BYTES_PER_TOKEN = 4


def estimate_input_tokens(body_bytes: int) -> int:
    """The input tokens a request is charged before its answer says: its body's bytes / 4.
    Over by the JSON around the prompt (typically 10-40 % for chat), far over for base64 media
    (an image's bytes, not its few hundred tokens), under for scripts with more bytes per token
    than the 4 assumed; the answer's usage corrects the counters afterwards."""
    return max(1, -(-body_bytes // BYTES_PER_TOKEN))


def window(kind: str, now: float) -> tuple[int, float]:
    """The window of ``kind`` holding ``now``: its number (part of the counter's key) and
    when it ends (UNIX time)."""
    seconds = WINDOW_SECONDS.get(kind)
    if seconds is not None:
        n = int(now // seconds)
        return n, (n + 1) * seconds
    t = time.gmtime(now)  # a calendar month, in UTC
    n = t.tm_year * 12 + t.tm_mon - 1
    year, month = divmod(n + 1, 12)
    return n, float(calendar.timegm((year, month + 1, 1, 0, 0, 0)))


def fits(current: int, amount: int, limit: int) -> bool:
    """Whether ``amount`` more fits a counter at ``current`` of ``limit``: below the limit,
    and within it after, unless the window is empty (a request larger than the whole limit)."""
    return current < limit and (current == 0 or current + amount <= limit)


@dataclass(slots=True)  # not frozen: one is made per limit per request, and a frozen one's __init__ costs more
class Hit:
    """One counter a request touches: the limit's field, the counter's key in the store,
    what the request adds now, the limit, when the window ends and how long to keep it."""

    name: str
    key: str
    amount: int
    limit: int
    reset_at: float
    ttl: int


def key_digest(key: str | None) -> str:
    """The counters' name for a client key: a digest, so no name a client's credential maps to
    is stored as it is. The requests without a key (None) have one no key name can have (a
    name never holds ``:``). Kept per name (the names are the key file's: bounded by it)."""
    digest = _DIGESTS.get(key)
    if digest is None:
        if len(_DIGESTS) > 4096:
            _DIGESTS.clear()
        digest = _DIGESTS[key] = hashlib.sha256((":no-key" if key is None else key).encode()).hexdigest()[:16]
    return digest


_DIGESTS: dict[str | None, str] = {}


def hits(policy: KeyPolicy, digest: str, estimate: int, now: float, prefix: str = "epd-proxy:rl:") -> list[Hit]:
    """The counters a request of ``policy`` touches now (``estimate``: its input tokens), named
    under ``prefix`` (``--state-store-prefix`` and ``rl:``)."""
    out = []
    limits = policy.limits
    for name, counts, kind in LIMITS:
        limit = limits.get(name)
        if limit is None:
            continue
        n, reset_at = window(kind, now)
        amount = 1 if counts == "requests" else 0 if counts == "output" else estimate
        # {digest}: one Redis Cluster slot for all of a key's counters (one script call).
        out.append(Hit(name, f"{prefix}{{{digest}}}:{name}:{n}", amount, limit, reset_at,
                       int(reset_at - now) + 60))
    return out


def refused_by(hits_: list[Hit], values: list[int]) -> Hit | None:
    """The first counter without room (``values``: the counters before the request)."""
    for hit, value in zip(hits_, values):
        if not fits(value, hit.amount, hit.limit):
            return hit
    return None


def settlement(hits_: list[Hit], estimate: int, tokens: tuple) -> list[tuple[Hit, int]]:
    """What to add to each counter once the answer's usage is known (``tokens``: prompt,
    completion, as observe/tokens.py reads them; None where not reported): input counters
    corrected from the estimate to the prompt's tokens, output tokens added to the output
    and budget counters. Without usage the estimate stands."""
    prompt, completion = tokens[0], tokens[1]
    extra_in = 0 if prompt is None else prompt - estimate
    out_ = completion or 0
    adds = []
    for hit in hits_:
        if hit.name.startswith("input_"):
            amount = extra_in
        elif hit.name.startswith("output_"):
            amount = out_
        elif hit.name.startswith("tokens_"):
            amount = extra_in + out_
        else:
            continue
        if amount:
            adds.append((hit, amount))
    return adds


def retry_after(hit: Hit, now: float) -> int:
    """Whole seconds until ``hit``'s window turns (at least 1)."""
    return max(1, math.ceil(hit.reset_at - now))


def duration_text(seconds: float) -> str:
    """A reset time as OpenAI writes it: ``20ms``, ``1.5s``, ``6m0s``, ``2h3m0s``."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s" if seconds < 10 else f"{int(seconds)}s"
    s = int(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m}m{s}s" if h else f"{m}m{s}s"


def _rfc3339(at: float) -> bytes:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(math.ceil(at))).encode()


def _pick(hits_: list[Hit], values: list[int], counts: tuple[str, ...]) -> tuple[Hit, int] | None:
    """Of the counters counting ``counts``, the one with the least room (the binding one)."""
    best = None
    for hit, value in zip(hits_, values):
        if _COUNTS[hit.name] in counts:
            room = hit.limit - value
            if best is None or room < best[1].limit - best[2]:
                best = (room, hit, value)
    return None if best is None else (best[1], best[2])


def rate_headers(hits_: list[Hit], values: list[int], now: float, anthropic: bool) -> list[tuple[bytes, bytes]]:
    """The rate-limit headers of an answer (``values``: the counters after it was counted, or
    as they stood when it was refused): OpenAI's ``x-ratelimit-{limit,remaining,reset}-
    {requests,tokens}``, or for Messages Anthropic's ``anthropic-ratelimit-*`` (requests,
    tokens, input-tokens, output-tokens; reset as an RFC 3339 time)."""
    out: list[tuple[bytes, bytes]] = []
    if anthropic:
        for label, counts in ((b"requests", ("requests",)), (b"tokens", ("input", "output", "tokens")),
                              (b"input-tokens", ("input",)), (b"output-tokens", ("output",))):
            picked = _pick(hits_, values, counts)
            if picked is None:
                continue
            hit, value = picked
            prefix = b"anthropic-ratelimit-" + label
            out += [(prefix + b"-limit", b"%d" % hit.limit),
                    (prefix + b"-remaining", b"%d" % max(0, hit.limit - value)),
                    (prefix + b"-reset", _rfc3339(hit.reset_at))]
        return out
    for label, counts in ((b"requests", ("requests",)), (b"tokens", ("input", "output", "tokens"))):
        picked = _pick(hits_, values, counts)
        if picked is None:
            continue
        hit, value = picked
        out += [(b"x-ratelimit-limit-" + label, b"%d" % hit.limit),
                (b"x-ratelimit-remaining-" + label, b"%d" % max(0, hit.limit - value)),
                (b"x-ratelimit-reset-" + label, duration_text(hit.reset_at - now).encode())]
    return out
