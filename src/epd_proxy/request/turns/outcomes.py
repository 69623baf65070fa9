"""What became of each turn's chance to reuse decode's KV: one label per request, and the
counts ``/metrics`` shows (docs/operations.md, "Multi-turn KV reuse: outcomes").

A request of chat, completions or generate, once some decode has answered with parameters,
ends with exactly one *outcome* (``RequestContext.kv_outcome``): it reused decode's KV (read
by the prefill, or computed on that decode with the prefill skipped), it had nothing to reuse
(an opening turn), or it fell back, and why. The access log's ``kv=`` field, ``Server-Timing``'s
``kv;desc=`` and ``epd_proxy_kv_reuse_turns_total{outcome}`` all say the same value. What
became of each decode answer that held blocks (kept for the next turn, or why not) is counted
apart (``epd_proxy_kv_reuse_answers_total{result}``): an answer is not a turn.

Pure: labels and counters; the shell sets and counts them.
"""

from __future__ import annotations

# -- a turn's outcome (epd_proxy_kv_reuse_turns_total{outcome}, kv= in the access log) ----------
REUSED = "reused"  # the prefill read the previous turn's KV from the decode holding it
LOCAL_PREFILL = "local_prefill"  # the decode holding it computed the new part alone: the prefill skipped
OPENING = "opening"  # no earlier answer in the request: nothing to reuse
UNMATCHED = "unmatched"  # completions/generate: the prompt extends no turn held here (opening, or kept elsewhere)
NOT_KEYED = "not_keyed"  # the earlier answer carries what decode never held (a name, reasoning), or is continued
NOT_HELD = "not_held"  # an earlier answer, but nothing held for it here (another process, a restart)
STREAM_NO_PARAMS = "stream_no_params"  # the previous turn was answered by a stream without KV parameters (0.32)
OLDER_TURN = "older_turn"  # this process holds an older turn of the conversation (later ones went elsewhere)
EDITED = "edited"  # this process holds the conversation's latest turn, and the history differs from it
ALREADY_USED = "already_used"  # given to a prefill before: a retry, a regeneration, a second request at once
EXPIRED = "expired"  # past its deadline (--kv-reuse-ttl - --kv-reuse-margin after receipt)
EVICTED = "evicted"  # let go for --kv-reuse-max-held-tokens or the store's capacity
SUPERSEDED = "superseded"  # a newer turn of the conversation, or the same turn answered again, replaced it
DECODE_GONE = "decode_gone"  # the decode holding it left, is draining, or failed this request
DECODE_DROPPED = "decode_dropped"  # the decode's own KV events say it no longer holds the blocks (evicted, restarted)
TOKENS = "tokens"  # the new prompt shares too few tokens with what decode holds (or they cannot be checked)
TOKENIZE_FAILED = "tokenize_failed"  # no instance tokenized the new prompt
PREFILL_FAILED = "prefill_failed"  # the prefill failed reading it (5xx) and ran again without
NO_PULL_PREFILL = "no_pull_prefill"  # no prefill instance to read it (the prefill pool empty)
MEDIA = "media"  # a request with media items: not looked up
RETRIED = "retried"  # the attempt that had it failed after its read; the retry computed the history
REQUEST_FAILED = "request_failed"  # the request ended before its prefill ran: decode's blocks freed
# Shared store: the kept turn read back failed the checks (read_back.py): malformed, or pointing
# elsewhere than at a decode of the pool as this process knows it (or at one it cannot verify yet).
INVALID = "invalid"

OUTCOMES = (REUSED, LOCAL_PREFILL, OPENING, UNMATCHED, NOT_KEYED, NOT_HELD, STREAM_NO_PARAMS, OLDER_TURN, EDITED,
            ALREADY_USED, EXPIRED, EVICTED, SUPERSEDED, DECODE_GONE, DECODE_DROPPED, TOKENS, TOKENIZE_FAILED,
            PREFILL_FAILED, NO_PULL_PREFILL, MEDIA, RETRIED, REQUEST_FAILED, INVALID)

# -- a decode answer that held blocks (epd_proxy_kv_reuse_answers_total{result}) ----------------
KEPT = "kept"  # kept for the conversation's next turn
# The others are multiturn's answer reasons: no_token_ids, reasoning, choices, unknown (not
# readable as one answer to continue), short (a prompt under prompts.PREFIX bytes).
SHORT = "short"


class TurnCounts:
    """This process's counts of turn outcomes and of decode answers (``/metrics``)."""

    __slots__ = ("turns", "answers", "declined", "freed")

    def __init__(self) -> None:
        self.turns: dict[str, int] = {}  # outcome -> requests
        self.answers: dict[str, int] = {}  # result -> decode answers that held blocks
        self.declined = 0  # turns short enough to skip the prefill whose decode ran others
        self.freed = 0  # kept parameters handed to a prefill only to free decode's blocks early

    def turn(self, outcome: str) -> None:
        self.turns[outcome] = self.turns.get(outcome, 0) + 1

    def answer(self, result: str) -> None:
        self.answers[result] = self.answers.get(result, 0) + 1
