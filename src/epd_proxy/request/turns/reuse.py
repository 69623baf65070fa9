"""The I/O shell of multi-turn KV reuse (``multiturn.py`` is the pure core): what the pipeline
asks before an attempt (the previous turn's parameters for the prefill, or the decode that
should serve the turn alone), what it hands over after decode's answer (kept for the next
turn), and the early release of parameters that will not be used."""

from __future__ import annotations

import asyncio
import logging
import time
from array import array

import msgspec

from epd_proxy.config import ProxyConfig
from epd_proxy.http import Headers
from epd_proxy.instances.catalog import ModelDirectory
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.request.context import RequestContext
from epd_proxy.request.ingress import CHAT, COMPLETIONS
from epd_proxy.request.legs.connectors import DecodeOnly, KVConnector, NixlPull
from epd_proxy.request.legs.stages import DecodeLeg
from epd_proxy.request.turns.multiturn import (
    DECODE_GONE,
    NO_IDS,
    TOKENIZE_FAILED,
    TOKENS,
    UNKNOWN,
    Entry,
    KVReuse,
    TurnStore,
    answer_message,
    estimate_new_tokens,
    keep_key,
    lookup_key,
    read_answer,
    reuse_params,
    skips_prefill,
    tokenize_body,
    tokens_of,
)
from epd_proxy.request.turns.prompts import (
    PROMPT_APIS,
    HeldTurn,
    candidate_keys,
    held_turn,
    prefix_key,
    prompt_ids,
    prompt_material,
    read_prompt_answer,
    tokenize_prompt_body,
)
from epd_proxy.request.turns.prompts import keep_key as prompt_keep_key
from epd_proxy.request.turns.shared_turns import SharedTurns
from epd_proxy.request.turns.streams import params_of, read_stream, strip_stream_params
from epd_proxy.routing.view import EMPTY_VIEW
from epd_proxy.state.guard import GuardedStore
from epd_proxy.wire.blobs import encode_json
from epd_proxy.wire.errors import ProxyError
from epd_proxy.wire.ids import hex_id

log = logging.getLogger("epd_proxy.pipeline")

# Background calls that free kept KV on decode early (``TurnReuse.release``) at once.
MAX_RELEASES = 64


class TurnReuse:
    """Multi-turn KV reuse for one proxy process (docs/architecture.md, "Multi-turn KV reuse").
    ``store`` is None with ``--no-kv-reuse``: answers still lose their parameters. With a
    ``shared`` state store (``--state-store``, the ``--workers`` parent) the kept parameters
    live there (``shared_turns.py``) and ``store`` keeps this process's counters."""

    def __init__(self, config: ProxyConfig, *, prefill: InstancePool, decode: InstancePool, connector: KVConnector,
                 decode_only: DecodeOnly, models: ModelDirectory, base_headers: Headers,
                 shared: GuardedStore | None = None) -> None:
        self.store = TurnStore(config.kv_reuse_ttl, config.kv_reuse_margin, config.kv_reuse_max_held_tokens) \
            if config.kv_reuse else None
        self.shared = SharedTurns(shared, self.store) if shared is not None and self.store is not None else None
        self.writes: set[asyncio.Task] = set()  # kept turns on their way to the shared store
        self.local_prefill_max = config.local_prefill_max_tokens
        self.local_prefill_streams = config.local_prefill_max_streams
        self.balance_abs = config.balance_abs
        self.prefill = prefill
        self.decode = decode
        self.connector = connector
        self.decode_only = decode_only
        self.models = models
        self.base_headers = base_headers
        self.releases: set[asyncio.Task] = set()
        # The decodes (URLs) seen to send their parameters in a chat or completions stream's last
        # event: asked for the stream's token ids from then on (asks_stream_ids). vLLM 0.32 never
        # sends them there, so its streams are never asked.
        self.stream_decodes: set[str] = set()

    def asks_stream_ids(self, ctx: RequestContext, body: dict, decode: Instance) -> bool:
        """Whether a chat or completions stream whose client did not ask for token ids should
        ask ``decode`` for them: a decode seen to send its parameters in a stream, and one
        choice without an echo (read_stream reads back nothing else)."""
        return (decode.url in self.stream_decodes and (ctx.path == CHAT or ctx.path == COMPLETIONS)
                and body.get("n") in (None, 1) and not body.get("echo"))

    async def previous_turn(self, ctx: RequestContext, turns: TurnStore, body: dict, p: Instance | None
                            ) -> Instance | None:
        """The previous turn's parameters, taken (once per request: never on a retry) for this
        attempt's prefill (``ctx.kv_reuse``); or the decode holding them, when the prefill would
        compute so little that it alone should serve the request."""
        ctx.turn_tried = True
        now = time.monotonic()
        asked: dict | None = None  # the /tokenize request for the new prompt
        tokens: list[int] | None = None  # or its tokens, when the request spells them
        if ctx.path == CHAT:
            found = lookup_key(body, ctx.conversation)
            if found is None:
                return None  # nothing answered before: an opening turn
            key, conversation, _, new_chars = found
            new_messages = _after_last_answer(body["messages"])  # lookup_key found an answer in them
            entry, reason, stale = await self._take(turns, key, conversation, now)
            if stale is not None:
                self.release(stale)
            asked = tokenize_body(body)
        else:  # completions, generate (turn_prompts.py)
            material = prompt_material(body, ctx.path)
            prefix = None if material is None else prefix_key(body, ctx.path, material[0])
            if material is None or prefix is None:
                return None
            entry, reason, new_chars, new_messages = None, UNKNOWN, 0, 0
            lengths = turns.lengths(prefix) if self.shared is None else await self.shared.lengths(prefix)
            for key, length in candidate_keys(body, ctx.path, material[0], lengths):
                entry, reason, _ = await self._take(turns, key, None, now)
                if entry is not None or reason != UNKNOWN:
                    new_chars = len(material[0]) - length
                    break
            else:
                # No held turn of this prompt here: an opening prompt cannot be told from a turn
                # another process kept, so neither is counted.
                return None
            if material[1]:
                asked = tokenize_prompt_body(body)
            else:
                tokens = prompt_ids(material[0])
        if entry is None:
            turns.fallback(reason)
            return None
        holder = self.decode.find(entry.decode)
        if holder is None or not holder.healthy or holder in ctx.excluded:
            turns.fallback(DECODE_GONE)
            return None
        if self.local_prefill_max and self._within_bound(ctx, holder):
            new = estimate_new_tokens(entry, new_chars, new_messages)
            if skips_prefill(new, holder.inflight + holder.signals.others, self.local_prefill_max,
                             self.local_prefill_streams):
                # Not released: the turn's own request on that decode shares those blocks
                # (prefix-cache hits), so freeing them early would save a block, for a prefill call.
                turns.local_prefills += 1
                return holder
            if new <= self.local_prefill_max:
                turns.local_busy += 1
        connector = self.connector
        if p is None or not isinstance(connector, NixlPull):
            turns.fallback("no_pull_prefill")
            self.release(entry)
            return None
        # vLLM reads what the parameters name without checking that the new prompt's tokens
        # extend them: the prompt is tokenized and only the tokens it shares with what decode
        # holds are read.
        if asked is not None:
            # The prefill that will run the prompt tokenizes it; if it cannot be reached, the
            # decode holding the history (the same model, the same tokenizer and template).
            for stage, inst in ((connector.prefill, p), (self.decode_only.decode, holder)):
                try:
                    data = await stage.exchange(ctx, inst, "/tokenize", encode_json(asked), ctx.upstream_headers())
                    tokens = tokens_of(data)
                    break
                except ProxyError as err:
                    if not err.unsent:
                        break
            if tokens is None:
                turns.fallback(TOKENIZE_FAILED)
                self.release(entry)
                return None
        params = reuse_params(entry, tokens) if tokens is not None else None
        if params is None:
            turns.fallback(TOKENS)
            self.release(entry)
            return None
        turns.used += 1
        ctx.kv_reuse = KVReuse(params, turns, entry)
        return None

    async def _take(self, turns: TurnStore, key: bytes, conversation: bytes | None, now: float
                    ) -> tuple[Entry | None, str, Entry | None]:
        """The kept turn under ``key``, from this process (popped before any await) or the
        shared store (taken atomically there)."""
        if self.shared is None:
            return turns.take(key, conversation, now)
        return await self.shared.take(key, conversation, now)

    def _put(self, turns: TurnStore, key: bytes, entry: Entry, now: float) -> None:
        """Keep ``entry`` for the next turn; what it supersedes or pushes past the bound is let go."""
        if self.shared is None:
            for old in turns.put(key, entry, now):
                self.release(old)
            return
        task = asyncio.get_running_loop().create_task(self._put_shared(self.shared, key, entry, now))
        self.writes.add(task)
        task.add_done_callback(self.writes.discard)

    async def _put_shared(self, shared: SharedTurns, key: bytes, entry: Entry, now: float) -> None:
        await shared.put(key, entry, now, self.release)

    async def written(self) -> None:
        """Wait until the turns kept so far are in the shared store (before the answer that
        made them is sent, so that a next turn on another replica finds them); each write
        is bounded by the store's budget."""
        if self.writes:
            await asyncio.gather(*list(self.writes), return_exceptions=True)

    def _activate(self, turns: TurnStore) -> None:
        """A decode answered with parameters: reuse is on here, and (shared) for every replica."""
        turns.active = True
        if self.shared is not None:
            self.shared.announce()

    def start(self) -> None:
        """With a shared store: learn from it that reuse is on (``SharedTurns.watch``)."""
        if self.shared is not None:
            self.shared.watch()

    def _within_bound(self, ctx: RequestContext, holder: Instance) -> bool:
        """Whether the decode holding a conversation is within the load bound routing keeps
        (``--balance-abs`` requests beyond the least-loaded candidate)."""
        candidates = self.decode.candidates(ctx.excluded, ctx.model_for("decode"))
        if holder not in candidates:
            return False
        low = min(c.inflight + c.signals.others for c in candidates)
        return holder.inflight + holder.signals.others <= low + self.balance_abs

    def keep(self, ctx: RequestContext, body: dict, leg: DecodeLeg, answer: bytes) -> bytes:
        """Decode's answer held blocks for a later reader: the parameters taken out of what
        the client gets, and kept for the conversation's next turn (chat)."""
        chat = ctx.path == CHAT and ctx.api is None
        read = read_answer(answer, chat, ctx.ids_asked)
        turns = self.store
        if turns is None or not isinstance(self.connector, NixlPull):
            return read.body  # reuse is for the pull connector (docs/protocol.md §2.10)
        self._activate(turns)
        now = time.monotonic()
        model = body.get("model")
        if ctx.path in PROMPT_APIS:
            self._keep_prompt(ctx, body, leg, turns, read_prompt_answer(body, ctx.path, answer), now)
            return read.body
        if not chat:
            # Messages and Responses: vLLM 0.32 answers them with decode's parameters but takes no
            # return_token_ids there, so no next prompt can be checked against what decode holds:
            # not reused, and the blocks let go at once (docs/protocol.md §2.10).
            self._let_go(leg, turns, _params_of(answer), model, now)
            return read.body
        if read.params is None or read.message is None:
            if read.reason:
                turns.fallback(read.reason)
            return read.body
        self._keep_chat(ctx, body, leg, turns, read.params, read.message, read.ids, now)
        return read.body

    def keep_stream(self, ctx: RequestContext, body: dict, leg: DecodeLeg, stream: bytes, whole: bool = True
                    ) -> None:
        """Decode's stream ended with its parameters (a later vLLM's chat or completions
        stream; 0.32's Responses stream): kept for the next turn when the stream carried the
        token ids decode holds (generate's always, chat's and completions' when the client
        asked for them, or the proxy did: a decode seen here to send its parameters in such a
        stream is asked from then on, asks_stream_ids), else let go at once. Only a ``whole``
        stream is read back: the ids of a stream's last events alone are not what decode holds."""
        turns = self.store
        params = params_of(strip_stream_params(stream)[1])
        if turns is None or params is None or not isinstance(self.connector, NixlPull):
            return
        self._activate(turns)
        if ctx.api is None and (ctx.path == CHAT or ctx.path == COMPLETIONS):
            self.stream_decodes.add(leg.inst.url)  # asked for a stream's token ids from now on
        now = time.monotonic()
        model = body.get("model")
        if not whole or (ctx.api is not None and ctx.path not in PROMPT_APIS):
            self._let_go(leg, turns, params, model, now)
            return
        answer = read_stream(stream)
        if ctx.path in PROMPT_APIS:
            held = held_turn(body, ctx.path, params, answer.text, answer.prompt_ids, answer.output) \
                if not answer.reason else None
            if held is None or held.params is None:
                self._let_go(leg, turns, params, model, now, answer.reason or (held.reason if held else ""))
                return
            self._keep_prompt(ctx, body, leg, turns, held, now)
            return
        tokens = params.get("remote_num_tokens")
        if answer.reason or answer.prompt_ids is None or answer.output is None or type(tokens) is not int:
            self._let_go(leg, turns, params, model, now, answer.reason or NO_IDS)
            return
        ids = array("l", answer.prompt_ids)
        ids.extend(answer.output)
        del ids[tokens:]
        self._keep_chat(ctx, body, leg, turns, params, answer_message(answer.text, None), ids, now)

    def _keep_chat(self, ctx: RequestContext, body: dict, leg: DecodeLeg, turns: TurnStore, params: dict,
                   message: bytes | None, ids: array | None, now: float) -> None:
        if message is None:
            self._let_go(leg, turns, params, body.get("model"), now, UNKNOWN)
            return
        tokens = params.get("remote_num_tokens")
        key, conversation, chars = keep_key(body, message, ctx.conversation)
        entry = Entry(params, leg.inst.url, tokens if type(tokens) is int else 0, chars, now + turns.life,
                      conversation, body.get("model"), ids)
        self._put(turns, key, entry, now)

    def _keep_prompt(self, ctx: RequestContext, body: dict, leg: DecodeLeg, turns: TurnStore, held: HeldTurn,
                     now: float) -> None:
        material = prompt_material(body, ctx.path) if held.held is not None else None
        prefix = None if material is None else prefix_key(body, ctx.path, material[0])
        if held.params is None or held.held is None or prefix is None:
            turns.fallback(held.reason or TOKENS)
            return
        tokens = held.params.get("remote_num_tokens")
        entry = Entry(held.params, leg.inst.url, tokens if type(tokens) is int else 0, len(held.held),
                      now + turns.life, prompt_keep_key(body, ctx.path, held.held), body.get("model"), held.ids,
                      prefix)
        self._put(turns, entry.conversation, entry, now)

    def _let_go(self, leg: DecodeLeg, turns: TurnStore, params: dict | None, model: object, now: float,
                reason: str = NO_IDS) -> None:
        """Parameters that cannot be kept: counted, and decode's blocks freed at once."""
        turns.fallback(reason)
        if params is not None:
            self.release(Entry(params, leg.inst.url, 0, 0, now + turns.life, b"", model))

    def ended(self, ctx: RequestContext) -> None:
        """The request is over: parameters it took for a prefill that never ran are let go."""
        reuse = ctx.kv_reuse
        if reuse is not None and reuse.entry is not None:
            reuse.store.used -= 1
            self.release(reuse.entry)

    def release(self, entry: Entry) -> None:
        """Kept parameters that will not be used. vLLM 0.32 has one way to free a finished
        request's blocks on decode before its TTL: a prefill request that carries them, which
        tells decode it is done with them even when it reads nothing (an abort of a finished
        request does nothing). So a 2-token prefill is sent with them, told to read nothing
        (``remote_num_tokens: 0``), in the background; when that cannot be done (no pull
        prefill, the decode gone, too many such calls at once), decode frees them at its TTL."""
        turns = self.store
        if (turns is None or not isinstance(self.connector, NixlPull) or not self.prefill
                or entry.deadline <= time.monotonic() or self.decode.find(entry.decode) is None
                or len(self.releases) >= MAX_RELEASES):
            return
        task = asyncio.get_running_loop().create_task(self._free(entry, turns))
        self.releases.add(task)
        task.add_done_callback(self.releases.discard)

    async def _free(self, entry: Entry, turns: TurnStore) -> None:
        ctx = RequestContext(f"kv-release-{hex_id(48)}", "/v1/completions", self.base_headers)
        connector, ids = self.connector, entry.ids
        assert isinstance(connector, NixlPull)  # release() checked
        first = ids[0] if ids else 0  # any token: nothing is read (an answer without ids: Messages, Responses)
        try:
            models = self.models.current.route(entry.model if isinstance(entry.model, str) else None)
            p = self.prefill.choose((), EMPTY_VIEW, None if models is None else models.get("prefill"))
            # Two tokens: less than a block (never cached), and a list vLLM reads as token ids.
            body = {"model": entry.model, "prompt": [first, first], "max_tokens": 1,
                    "kv_transfer_params": dict(entry.params, remote_num_tokens=0)}
            await connector.prefill.run(ctx, p, body)
            turns.freed += 1
        except ProxyError as err:
            log.debug("kept KV on %s not released early: %s", entry.decode, err.message)
        finally:
            ctx.release_all()

    async def close(self) -> None:
        if self.shared is not None:
            await self.shared.close()
        for task in list(self.releases | self.writes):
            task.cancel()
        if self.releases or self.writes:
            await asyncio.gather(*self.releases, *self.writes, return_exceptions=True)


def _after_last_answer(messages: list) -> int:
    """The messages after the last assistant message (the request's new part)."""
    for i in range(len(messages) - 1, -1, -1):
        msg = messages[i]
        if isinstance(msg, dict) and msg.get("role") == "assistant":
            return len(messages) - 1 - i
    return len(messages)


class _WithParams(msgspec.Struct):
    kv_transfer_params: dict | None = None


def _params_of(answer: bytes) -> dict | None:
    """Decode's parameters in an answer of any API, if it holds blocks for a later reader."""
    try:
        params = msgspec.json.decode(answer, type=_WithParams).kv_transfer_params
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return params if params is not None and params.get("do_remote_decode") is True else None
