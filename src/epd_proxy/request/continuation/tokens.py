"""Continuing a broken ``/inference/v1/generate`` stream on another decode, token in.

Generate takes token ids and streams token ids, so its continuation is exact by construction:
the prompt's ids followed by the ids the client has received, with the rest of the token budget
(``sampling_params.max_tokens`` and ``min_tokens`` less the ids streamed). At temperature 0 the
continued answer is the uninterrupted one token for token; with sampling it is a valid draw
of the same distribution. Its events are the stream's own: the first event's ``request_id``,
the prompt ids the continuation's first event may repeat (``return_token_ids``) taken out, and
a usage that counts the whole answer (exact: the continuation's prompt held ``before`` ids).

Pure: dicts and bytes (the shell is ``migration.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from epd_proxy.request.continuation.text import OpenAiStream, first_choice, read_events, whole_usage

# Sampling parameters whose answer a continuation cannot reproduce: more than one choice, log
# probabilities (the client's would restart), a seed (the continuation draws anew), guided
# decoding (its grammar state would restart), penalties over the output tokens only (the
# answer so far moves into the prompt), custom logits processors and their arguments, bad
# words (a word straddling the break), prompt truncation (the prompt grows).
_UNSOUND_PARAMS = frozenset(("n", "best_of", "logprobs", "prompt_logprobs", "seed", "structured_outputs",
                             "guided_decoding", "presence_penalty", "frequency_penalty", "logits_processors",
                             "extra_args", "bad_words", "truncate_prompt_tokens", "prompt_logprob_token_ids"))
# Those whose vLLM default is a number: that number is unset too.
_DEFAULTS = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0}

_DATA = b"data: "
_encode = msgspec.json.encode


def unsound(body: dict) -> str | None:
    """Why this generate request's stream cannot be continued (None: it can): token output only
    (``output_mode: "text"`` holds text back for stop strings and would restart its
    detokenization at the break), no media (its placement and encoder legs are the request's),
    and sampling parameters a continuation reproduces."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        return "token_ids"
    if body.get("output_mode", "tokens") != "tokens":
        return "output_mode"
    if body.get("features") or body.get("content_parts"):
        return "media"
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        return "sampling_params"
    if not _UNSOUND_PARAMS.isdisjoint(params):
        for name in _UNSOUND_PARAMS.intersection(params):
            value = params[name]
            if value is None or value is False or value == [] or value == {} or value == _DEFAULTS.get(name):
                continue
            return name
    return None


@dataclass(slots=True)
class TokensReceived(OpenAiStream):
    """What the client has of a generate answer: the stream's ``request_id`` (its first
    event's) and the token ids streamed so far."""

    id: object = None
    ids: list[int] = field(default_factory=list)
    finished: bool = False
    unsound: str | None = None
    before: int = 0  # the ids of the answer before the leg now streaming (its usage adds them)
    strip_ids = False  # the events' token ids are the answer
    via: str | None = None  # the continuation goes to the client's path

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def take(self, event: dict) -> None:
        if self.id is None:
            self.id = event.get("request_id")
        choice = first_choice(event)
        if choice is None:
            return
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            if all(type(t) is int for t in ids):
                self.ids += ids
            else:
                self.unsound = "token_ids"
        if choice.get("finish_reason") is not None:
            self.finished = True

    def body(self, path: str, body: dict) -> dict:
        """The request that continues the answer: the client's ids and the ids streamed as its
        prompt, the rest of its token budget."""
        cont = dict(body)
        cont["token_ids"] = list(body["token_ids"]) + self.ids
        cont.pop("token_offsets", None)  # the offsets of the client's ids only
        params = dict(body["sampling_params"])
        done = len(self.ids)
        for key in ("max_tokens", "min_tokens"):
            value = params.get(key)
            if type(value) is int:
                params[key] = max(value - done, 0 if key == "min_tokens" else 1)
        cont["sampling_params"] = params
        return cont

    def own(self, event: dict) -> bytes | None:
        """A continuation event as the stream's: its ``request_id``, no prompt ids repeated,
        its ids taken, its usage the whole answer's."""
        if self.id is not None:
            event["request_id"] = self.id
        event.pop("prompt_token_ids", None)
        event.pop("mm_placeholders", None)
        if event.get("choices"):
            self.take(event)
        usage = event.get("usage")
        if isinstance(usage, dict):
            whole_usage(usage, self.before)
        return _DATA + _encode(event) + b"\n\n"


def received(data: bytes) -> TokensReceived:
    """The client's part of a generate stream from the reads relayed."""
    return read_events(data, TokensReceived())
