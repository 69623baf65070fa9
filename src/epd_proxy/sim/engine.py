"""One engine per simulated instance: continuous batching on a single timer.

vLLM runs one engine loop per instance. Each step admits waiting requests up
to ``max_num_seqs`` and produces one token for every running sequence. The
simulator does the same, with the step period as the inter-token latency:

* a request is *waiting* until admitted, then *prefilling* until its TTFT has
  elapsed (``ready_at``), then *running*: one token (one SSE event, one
  ``writer.write``) per step until it has produced all its tokens;
* a decode that loads KV from a prefill is admitted first and then waits for
  the transfer (vLLM's WAITING_FOR_REMOTE_KVS), so a long queue on D can
  outlive the prefill's abort timeout, as it can with vLLM;
* the timer only runs while something is active; when every active sequence
  is prefilling or stalled, the engine sleeps until the earliest one is due;
* with chunked prefill (``chunk_tokens`` > 0, vLLM's ``max_num_batched_tokens``)
  a sequence's prompt tokens to compute (``prefill_tokens``) go through the
  steps, at most ``chunk_tokens`` per step in arrival order, and a step with C
  of them lasts ``itl + C x per_token``: a prefill slows the streams running
  beside it, as in vLLM, and concurrent prefills queue;
* a sequence is admitted only while its blocks (prompt and output) fit in the
  instance's ``num_blocks`` beside the running ones and the ``reserved`` blocks
  (KV held for another instance); otherwise it waits, in order, as vLLM's
  scheduler does when the KV cache is full (one larger than the whole cache
  runs alone on an empty engine).

There is no per-token ``sleep``: the cost per token is a bytes concatenation
and a ``transport.write``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Callable

import msgspec

from epd_proxy.sim.tokens import VOCAB, VOCAB_JSON, VOCAB_SPLIT

if TYPE_CHECKING:  # pragma: no cover
    from epd_proxy.http.response import ResponseWriter
    from epd_proxy.sim.records import SimRecord

_INF = float("inf")
WAITING, ACTIVE, DONE = 0, 1, 2
DONE_EVENT = b"data: [DONE]\n\n"


class Sequence:
    """One request inside an engine, and how its output is written."""

    __slots__ = (
        "engine", "writer", "rec", "stream", "chat", "n", "tokens", "emitted", "state", "ready_at",
        "next_at", "ttft", "needs_load", "admitted", "done", "prompt_tokens", "cached_tokens",
        "finish_reason", "faulty", "error_after", "reset_after", "stall_after", "stall_seconds",
        "stalled", "slow_body", "split", "prefixes", "suffix", "final_suffix", "role_events",
        "include_usage", "continuous_usage", "head", "on_complete", "on_error", "on_reset",
        "loading", "ctx", "fast", "on_ready", "fingerprint", "prefill_tokens", "blocks", "prompt_ids_json",
        "chunk_ids", "merge",
    )

    def __init__(self, *, writer: "ResponseWriter", rec: "SimRecord | None", stream: bool, chat: bool,
                 tokens: list[list[int]], prompt_tokens: int, ttft: float, finish_reason: str,
                 head: bytes, include_usage: bool, continuous_usage: bool, split: bool,
                 on_complete: Callable[["Sequence"], None], on_error: Callable[["Sequence", str], None],
                 on_reset: Callable[["Sequence"], None], ctx=None, fingerprint: bytes = b"") -> None:
        self.engine: Engine | None = None
        self.writer = writer
        self.rec = rec
        self.stream = stream
        self.chat = chat
        self.tokens = tokens
        self.n = len(tokens[0]) if tokens else 0
        self.emitted = 0
        self.state = WAITING
        self.ready_at = _INF
        self.next_at = 0.0
        self.ttft = ttft
        self.needs_load = False
        self.loading = False
        self.admitted: asyncio.Future | None = None
        self.done: asyncio.Future | None = None
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        # Prompt tokens computed through the engine's steps (chunked prefill); 0 = none.
        self.prefill_tokens = 0
        self.blocks = 0  # KV blocks reserved while admitted
        # return_token_ids on a chat stream: the prompt's ids (JSON) for the role chunk, and per
        # choice per token the ids (JSON) its chunk carries; None = "token_ids": null as vLLM.
        self.prompt_ids_json: bytes | None = None
        self.chunk_ids: list[list[bytes]] | None = None
        self.finish_reason = finish_reason
        self.faulty = False
        self.error_after: int | None = None
        self.reset_after: int | None = None
        self.stall_after: int | None = None
        self.stall_seconds = 0.0
        self.stalled = False
        self.slow_body = 0.0
        self.split = split
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.on_complete = on_complete
        self.on_error = on_error
        self.on_reset = on_reset
        self.ctx = ctx
        # The JSON string of system_fingerprint (b"" for none): vLLM stamps it on the
        # chunks that carry a finish_reason, or on the usage chunk when there is one.
        self.fingerprint = fingerprint
        # Called once, when the prefill is done (before the first token and its faults).
        self.on_ready: Callable[["Sequence"], None] | None = None
        self.merge = 1  # tokens per stream event (SimConfig.stream_merge)
        # Non-stream without per-token faults: jump straight to the last token.
        self.fast = not stream
        # ``head`` is ``data: {"id":..,"object":..,"created":..,"model":..,"choices":[{"index":``
        self.head = head
        if stream:
            # vLLM 0.32's chunks (model_dump_json(exclude_unset=True)): only the fields it sets.
            ncho = len(tokens)
            fin = finish_reason.encode()
            fp = b',"system_fingerprint":' + fingerprint if fingerprint and not include_usage else b""
            if chat:
                self.prefixes = [head + b"%d" % c + b',"delta":{"content":' for c in range(ncho)]
                self.suffix = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]'
                self.final_suffix = (b'},"logprobs":null,"finish_reason":"' + fin
                                     + b'","stop_reason":null,"token_ids":null}]' + fp)
                self.role_events = [head + b"%d" % c + b',"delta":{"role":"assistant","content":""},'
                                    b'"logprobs":null,"finish_reason":null}]' for c in range(ncho)]
            else:
                self.prefixes = [head + b"%d" % c + b',"text":' for c in range(ncho)]
                self.suffix = (b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
                               b'"prompt_token_ids":null,"token_ids":null}]')
                self.final_suffix = (b',"logprobs":null,"finish_reason":"' + fin + b'","stop_reason":null,'
                                     b'"prompt_token_ids":null,"token_ids":null}]' + fp)
                self.role_events = None  # type: ignore[assignment]  # completions: no role events
        else:
            self.prefixes = None  # type: ignore[assignment]  # non-stream: no events to prefix
            self.suffix = self.final_suffix = b""
            self.role_events = None  # type: ignore[assignment]

    def set_faults(self, error_after, reset_after, stall_after, stall_seconds, slow_body) -> None:
        self.error_after = error_after
        self.reset_after = reset_after
        self.stall_after = stall_after
        self.stall_seconds = stall_seconds
        self.slow_body = slow_body
        self.faulty = (error_after is not None or reset_after is not None or stall_after is not None
                       or slow_body > 0)
        if self.faulty:
            self.fast = False

    # -- output ------------------------------------------------------------------------
    def _usage_json(self, completion_tokens: int, final: bool) -> bytes:
        usage: dict = {"prompt_tokens": self.prompt_tokens,
                       "total_tokens": self.prompt_tokens + completion_tokens,
                       "completion_tokens": completion_tokens}
        if final:
            if self.cached_tokens:
                usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        elif self.chat:
            usage["completion_tokens_details"] = None  # set explicitly by vLLM's chat stream
        return msgspec.json.encode(usage)

    def _tail(self, end: bytes, ntok: int = 0) -> bytes:
        # Object close (``}``) plus, with continuous usage stats, the choice's running usage.
        if self.continuous_usage:
            return end + b',"usage":' + self._usage_json(ntok, False) + b"}\n\n"
        return end + b"}\n\n"

    def _role_event(self, c: int) -> bytes:
        """The chat chunk that announces the assistant role for choice ``c``."""
        ev = self.role_events[c]
        if self.continuous_usage:
            ev += b',"usage":' + self._usage_json(0, False)
        ids = self.prompt_ids_json
        return ev + b',"prompt_token_ids":' + (ids or b"null") + b',"prompt_text":null}\n\n'

    def error_head(self) -> bytes:
        """What precedes an in-band error: vLLM sends a chat stream's role chunks on the
        engine's first output, even when that output is the failure."""
        if self.role_events is None or self.emitted:
            return b""
        return b"".join([self._role_event(c) for c in range(len(self.tokens))])

    def _write_event(self, ev: bytes, cut: int, last_choice: bool) -> None:
        """An event in one write or, while ``split`` lasts (once per choice), in two cut at
        ``cut``, inside a UTF-8 character (``cut`` <= 0: nothing to cut)."""
        w = self.writer
        if cut > 0 and self.split:
            if last_choice:
                self.split = False
            w.write(ev[:cut])
            w.write(ev[cut:])
        else:
            w.write(ev)

    def merged_from(self, i: int) -> int:
        """The first token of the event that token ``i`` ends (itself unless merged)."""
        return i - i % self.merge if self.merge > 1 else i

    def _emit(self, i: int) -> None:
        last = i == self.n - 1
        end = self.final_suffix if last else self.suffix
        prefixes = self.prefixes
        simple = not self.continuous_usage
        chunk_ids = self.chunk_ids
        start = self.merged_from(i)
        for c, toks in enumerate(self.tokens):
            tok = toks[i]
            prefix = prefixes[c]
            lit = VOCAB_JSON[tok] if start == i else merged_literal(toks[start:i + 1])
            if chunk_ids is not None:
                ids = chunk_ids[c][i] if start == i else b"[" + b",".join(
                    [j[1:-1] for j in chunk_ids[c][start:i + 1] if len(j) > 2]) + b"]"
                end = (self.final_suffix if last else self.suffix).replace(
                    b'"token_ids":null', b'"token_ids":' + ids, 1)
            if simple:
                ev = prefix + lit + end + b"}\n\n"
            else:
                ev = prefix + lit + self._tail(end, i + 1)
            if start == 0 and self.role_events is not None:
                # The role chunk goes out with the first token (one write, two SSE events).
                role = self._role_event(c)
                prefix = role + prefix
                ev = role + ev
            cut = VOCAB_SPLIT[tok] if start == i else -1
            self._write_event(ev, cut + len(prefix) if cut > 0 else cut, c == len(self.tokens) - 1)

    def stream_tail(self) -> bytes:
        """What ends a successful stream: the role chunks if no token was produced (vLLM
        sends no chunk for an output without text), the usage chunk if asked for, then
        ``[DONE]``."""
        parts = []
        if self.n == 0:
            parts.append(self.error_head())
        if self.include_usage:
            total = self.n * len(self.tokens)
            parts.append(self.head.partition(b',"choices":')[0] + b',"choices":[],"usage":'
                         + self._usage_json(total, True)
                         + (b',"system_fingerprint":' + self.fingerprint if self.fingerprint else b"")
                         + b"}\n\n")
        parts.append(DONE_EVENT)
        return b"".join(parts)

    def text(self, choice: int) -> str:
        return "".join([VOCAB[t] for t in self.tokens[choice]])

    # -- stepping ----------------------------------------------------------------------
    def step(self, now: float) -> bool:
        """Produce the next token; True when the sequence has finished."""
        if self.on_ready is not None:
            cb, self.on_ready = self.on_ready, None
            cb(self)
        i = self.emitted
        if self.faulty:
            # A stall comes first, so "stall-after=N:S,error-after=N" fails S seconds late.
            if self.stall_after == i and not self.stalled:
                self.stalled = True
                self.next_at = now + self.stall_seconds
                return False
            if self.error_after == i:
                self.on_error(self, f"injected fault: error after {i} tokens")
                return True
            if self.reset_after == i:
                self.on_reset(self)
                return True
        if i >= self.n:
            self.on_complete(self)
            return True
        if self.stream:
            if self.merge == 1 or (i + 1) % self.merge == 0 or i == self.n - 1:
                self._emit(i)  # else: the token goes out with the next ones, merged
        elif self.fast and i == 0 and self.n > 1:
            # Nobody sees the tokens of a non-stream answer: skip to the last one.
            self.emitted = self.n - 1
            self.next_at = now + (self.n - 1) * self.engine.itl  # type: ignore[union-attr]  # submitted
            return False
        self.emitted = i + 1
        if self.emitted >= self.n:
            self.on_complete(self)
            return True
        if self.slow_body > 0:
            self.next_at = now + self.slow_body
        return False


def merged_literal(tokens: list[int]) -> bytes:
    """The JSON string of several tokens' text, one event's when merged."""
    return msgspec.json.encode("".join([VOCAB[t] for t in tokens]))


class Engine:
    """Continuous batching for one instance.

    Tokens are produced on engine *ticks*, at most one tick per ``itl``: every
    running sequence that is due gets one token per tick. Admission is
    immediate (O(1) per request, never a pass over the running batch); a
    sequence whose prefill completes produces its first token at the next tick,
    as vLLM emits a request's first token at the end of the step that ran its
    prefill.
    """

    def __init__(self, itl_ms: float, max_num_seqs: int, *, chunk_tokens: int = 0, per_token_ms: float = 0.0,
                 block_size: int = 16, num_blocks: int = 0, reserved: Callable[[], int] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.itl = max(itl_ms, 0.0) / 1000.0
        self.chunk_tokens = max(int(chunk_tokens), 0)
        self.per_token = max(per_token_ms, 0.0) / 1000.0
        self.block_size = max(int(block_size), 1)
        self.num_blocks = max(int(num_blocks), 0)  # 0 = no capacity limit
        self.reserved = reserved  # blocks held outside the running sequences (KV kept for others)
        self.blocks_used = 0  # reserved by admitted sequences
        self.prefilling: deque[Sequence] = deque()  # chunked prefill, in arrival order
        self.prefill_steps = 0  # steps that carried a prefill chunk (each one longer)
        # Decode's inter-token latency as the model sets it (not as timers fire): stream tokens
        # after the first, by the length of the step before them in 0.1 ms (itl, plus a prefill
        # chunk's time when that step carried one). What vLLM's own ITL histogram would show.
        self.gaps: dict[int, int] = {}
        self._extra = 0.0  # the last step's prefill chunk time
        # Timers may fire a little early; anything this close to the tick counts as on time.
        self._slack = min(self.itl * 0.2, 0.0002)
        self.max_num_seqs = max(int(max_num_seqs), 1)
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.n_waiting = 0
        self.n_active = 0
        self.n_loading = 0
        self.steps = 0
        self._last_tick = -_INF
        # Whether the last step left sequences producing tokens. Only then is the
        # engine busy until the next tick: an engine whose last step finished its
        # work starts the next step as soon as something is ready, as vLLM does.
        self._busy = False
        self._handle: asyncio.Handle | None = None
        self._handle_at = _INF

    # -- public ------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.n_active - self.n_loading

    @property
    def num_waiting(self) -> int:
        return self.n_waiting + self.n_loading

    def submit(self, seq: Sequence) -> None:
        seq.engine = self
        if self.num_blocks:
            seq.blocks = -(-(seq.prompt_tokens + seq.n * max(len(seq.tokens), 1)) // self.block_size)
        if self.n_active < self.max_num_seqs and not self.n_waiting and self._fits(seq):
            self._admit(seq, self.loop.time())
        else:
            seq.state = WAITING
            self.n_waiting += 1
            self.waiting.append(seq)

    def ready(self, seq: Sequence, at: float) -> None:
        """A loading sequence has its KV: it produces tokens from ``at`` on."""
        if seq.state != ACTIVE or not seq.loading:
            return
        seq.loading = False
        self.n_loading -= 1
        seq.ready_at = at
        self._wake_for(at)

    def retire(self, seq: Sequence) -> None:
        """Take a sequence out (finished, failed or aborted); idempotent."""
        if seq.state == WAITING:
            self.n_waiting -= 1
        elif seq.state == ACTIVE:
            self.n_active -= 1
            self.blocks_used -= seq.blocks
            if seq.loading:
                seq.loading = False
                self.n_loading -= 1
        else:
            return
        seq.state = DONE
        if seq.admitted is not None and not seq.admitted.done():
            seq.admitted.cancel()
        if seq.done is not None and not seq.done.done():
            seq.done.set_result(None)
        if self.n_waiting and self.n_active < self.max_num_seqs:
            self._admit_waiting()

    def capacity_freed(self) -> None:
        """Blocks held outside the sequences were freed: admit what now fits."""
        if self.n_waiting and self.n_active < self.max_num_seqs:
            self._admit_waiting()

    def _fits(self, seq: Sequence) -> bool:
        if not self.num_blocks:
            return True
        held = self.reserved() if self.reserved is not None else 0
        if self.blocks_used + seq.blocks + held <= self.num_blocks:
            return True
        # One that could never fit goes alone on an empty engine (vLLM refuses it up front).
        return not self.n_active and not held

    def kv_blocks_in_use(self, block_size: int) -> int:
        total = 0
        for seq in self.active:
            if seq.state == ACTIVE:
                total += -(-(seq.prompt_tokens + seq.emitted) // block_size)
        return total

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._handle_at = _INF

    # -- internals ---------------------------------------------------------------------
    def _admit(self, seq: Sequence, now: float) -> None:
        seq.state = ACTIVE
        self.n_active += 1
        self.blocks_used += seq.blocks
        self.active.append(seq)
        if seq.prefill_tokens > 0 and self.chunk_tokens:
            # Chunked prefill: computed through the steps; ready when its last chunk ran.
            seq.ready_at = _INF
            self.prefilling.append(seq)
            self._wake_for(now)
        elif seq.needs_load:
            seq.loading = True
            self.n_loading += 1
            seq.ready_at = _INF
            if seq.admitted is not None and not seq.admitted.done():
                seq.admitted.set_result(None)
        else:
            seq.ready_at = now + seq.ttft
            self._wake_for(seq.ready_at)

    def _admit_waiting(self) -> None:
        now = self.loop.time()
        waiting = self.waiting
        while waiting and self.n_active < self.max_num_seqs:
            seq = waiting[0]
            if seq.state != WAITING:
                waiting.popleft()
                continue
            if not self._fits(seq):
                break  # the KV cache is full: the head of the queue waits, and all behind it
            waiting.popleft()
            self.n_waiting -= 1
            self._admit(seq, now)

    def _wake_for(self, t: float) -> None:
        tick = self._last_tick + self.itl if self._busy else -_INF
        self._schedule(t if t > tick else tick)

    def _schedule(self, at: float) -> None:
        if self._handle is not None:
            if at >= self._handle_at:
                return
            self._handle.cancel()
        self._handle_at = at
        if at <= self.loop.time():
            self._handle = self.loop.call_soon(self._step)
        else:
            self._handle = self.loop.call_at(at, self._step)

    def _step(self) -> None:
        self._handle = None
        self._handle_at = _INF
        now = self.loop.time()
        if self._busy and now + self._slack < self._last_tick + self.itl:
            self._schedule(self._last_tick + self.itl)
            return
        prev_tick = self._last_tick
        self.steps += 1
        self._last_tick = now
        active = self.active
        self.active = []  # sequences admitted during this step land here
        keep: list[Sequence] = []
        nxt = _INF
        emitting = False
        worked = ran = False
        gap, self._extra = self.itl + self._extra, 0.0
        inter = 0  # stream tokens after their first, stepped here
        for seq in active:
            if seq.state != ACTIVE:
                continue
            if seq.ready_at > now + self._slack:
                if seq.ready_at < nxt:
                    nxt = seq.ready_at
                keep.append(seq)
                continue
            if seq.next_at > now + self._slack:
                if seq.next_at < nxt:
                    nxt = seq.next_at
                keep.append(seq)
                continue
            worked = True
            if seq.stream and 0 < seq.emitted < seq.n:
                inter += 1
            if seq.step(now):
                self.retire(seq)
                continue
            if seq.state != ACTIVE:
                continue
            ran = True
            keep.append(seq)
            if seq.next_at > now:
                if seq.next_at < nxt:
                    nxt = seq.next_at
            else:
                emitting = True
        if inter:
            key = round(gap * 10000)
            self.gaps[key] = self.gaps.get(key, 0) + inter
        if self.active:
            keep.extend(self.active)
        self.active = keep
        if self.prefilling:
            ready = self._prefill_chunk(now)
            worked = ran = True
            if ready < nxt:
                nxt = ready
        if not worked:
            # The timer fired before anything was due (uvloop's clock and timers have
            # millisecond resolution): that was no engine step, so it must not push the
            # next one a whole ``itl`` away. An idle vLLM engine starts a step as soon as
            # a request is ready.
            self.steps -= 1
            self._last_tick = prev_tick
        else:
            self._busy = ran
        if emitting or self.prefilling:
            nxt = now
        if nxt < _INF:
            self._wake_for(nxt)

    def _prefill_chunk(self, now: float) -> float:
        """This step's prefill: up to ``chunk_tokens`` prompt tokens of the prefilling
        sequences, in order; the step lasts that much longer (the next tick moves). Returns
        when the earliest sequence finished here is ready (inf if none)."""
        budget = self.chunk_tokens
        taken = 0
        done: list[Sequence] = []
        queue = self.prefilling
        while queue and budget > 0:
            seq = queue[0]
            if seq.state != ACTIVE:
                queue.popleft()
                continue
            n = min(seq.prefill_tokens, budget)
            seq.prefill_tokens -= n
            budget -= n
            taken += n
            if seq.prefill_tokens <= 0:
                queue.popleft()
                done.append(seq)
        extra = taken * self.per_token
        self._extra = extra
        self.prefill_steps += 1
        self._last_tick = now + extra
        ready = _INF
        for seq in done:
            seq.ready_at = now + extra + seq.ttft
            if seq.ready_at < ready:
                ready = seq.ready_at
        return ready
