"""What a generation API other than chat and completions changes in a request's life.

vLLM serves ``/v1/messages``, ``/v1/responses`` and ``/inference/v1/generate`` on the
same engine as chat and completions: each turns its request into a chat (or a
token-prompt) request and its engine output into its own wire format. The simulator
does the same, so these APIs share the generation steps, the roles, the KV and EC
hand-offs and the deterministic output of ``generation.py``; an :class:`ApiFormat`
holds only what differs: the request's translation, the ids, the bodies and the
stream events (written by an :class:`EventSequence`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from epd_proxy.sim.engine import Sequence, merged_literal
from epd_proxy.sim.responses import GENERATION_ERROR_BODY, api_error_body
from epd_proxy.sim.tokens import VOCAB_JSON, VOCAB_SPLIT
from epd_proxy.sim.validation import ApiError


class ApiFormat:
    """One API's spelling of a generation request; the defaults are vLLM's OpenAI ones."""

    chat = True  # the request becomes a chat request (else a completions one with token ids)
    # The answer reports cached prompt tokens without --enable-prompt-tokens-details (vLLM's
    # Responses usage always has ``input_tokens_details.cached_tokens``).
    always_cached = False
    # Its stream may merge tokens into one event (``SimConfig.stream_merge``).
    merges = False

    def translate(self, body: Any) -> dict:
        """The request as the chat (or completions) body the engine runs; raises ApiError."""
        raise NotImplementedError

    def request_id(self, body: dict) -> str | None:
        """The request's own id, which names it when there is no X-Request-Id."""
        return None

    def ids(self, base: str, suffix: str, body: dict) -> tuple[str, str]:
        """(the answer's id, vLLM's internal request id, which ``remote_request_id`` names)."""
        raise NotImplementedError

    def error_body(self, exc: ApiError) -> bytes:
        return api_error_body(exc)

    def generation_error_body(self) -> bytes:
        return GENERATION_ERROR_BODY

    def body(self, g, seq: Sequence, kv_out: dict | None, ec_out: dict | None) -> dict:
        """The answer (non-stream), or the final object a stream reports."""
        raise NotImplementedError

    def finished(self, g, answer: dict) -> None:
        """After a successful answer (the Responses API stores it here)."""

    def failed(self, g) -> None:
        """After a generation failure."""

    def detach(self, g, writer) -> bool:
        """Whether the request answers at once and generates in the background; if so, this
        has sent the answer to ``writer``."""
        return False

    def started(self, g, task: asyncio.Task) -> None:
        """The task that generates a detached request's output."""

    # -- stream ------------------------------------------------------------------------
    def stream_open(self, g) -> bytes:
        """Events written as soon as the stream starts, before the engine's first output."""
        return b""

    def first_events(self, seq: Sequence, choice: int) -> bytes:
        """Events that go out with a choice's first token."""
        return b""

    def token_event(self, seq: Sequence, choice: int, i: int, tok: int) -> tuple[bytes, bytes, bytes]:
        """A token's event as (before, the token's literal, after)."""
        raise NotImplementedError

    def stream_tail(self, seq: Sequence) -> bytes:
        """What ends a successful stream (``seq.ctx.final`` is the final answer)."""
        raise NotImplementedError

    def stream_error(self, seq: Sequence) -> bytes | None:
        """What a generation failure writes once streaming; None breaks the stream off."""
        return None


class NullWriter:
    """Where a detached request's output goes: nowhere (its client has had its answer)."""

    started = finished = disconnected = False
    bytes_sent = 0

    def send(self, status, body=b"", content_type=None, headers=None) -> None:
        pass

    def start(self, status, content_type=None, headers=None) -> None:
        self.started = True

    def write(self, data: bytes) -> None:
        pass

    def end(self, data: bytes = b"") -> None:
        pass

    def abort(self) -> None:
        pass

    async def drain(self) -> None:
        pass


class EventSequence(Sequence):
    """A :class:`Sequence` whose stream events an :class:`ApiFormat` spells."""

    __slots__ = ("fmt",)
    fmt: ApiFormat

    def _emit(self, i: int) -> None:
        fmt: ApiFormat = self.fmt
        last = len(self.tokens) - 1
        start = self.merged_from(i)
        for c, toks in enumerate(self.tokens):
            tok = toks[i]
            before, lit, after = fmt.token_event(self, c, i, tok)
            if start == 0:
                before = fmt.first_events(self, c) + before
            if start != i:
                lit = merged_literal(toks[start:i + 1])
            cut = VOCAB_SPLIT[tok] if lit is VOCAB_JSON[tok] else -1
            self._write_event(before + lit + after, cut + len(before) if cut > 0 else cut, c == last)

    def stream_tail(self) -> bytes:
        return self.fmt.stream_tail(self)

    def error_head(self) -> bytes:
        return b""
