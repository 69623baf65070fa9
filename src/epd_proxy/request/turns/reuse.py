"""The I/O shell of multi-turn KV reuse (``multiturn.py`` is the pure core): what the pipeline
asks before an attempt (the previous turn's parameters for the prefill, or the decode that
should serve the turn alone), what it hands over after decode's answer (kept for the next
turn), and the early release of parameters that will not be used."""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from dataclasses import dataclass
from typing import Callable

import msgspec

from epd_proxy.config import ProxyConfig
from epd_proxy.http import Headers
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.model_directory import ModelDirectory
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import choose
from epd_proxy.placement.decision import HOLDS_TURN, Placement, PreviousTurn
from epd_proxy.placement.kv_lookup import KvLookup, holds_turn
from epd_proxy.request.context import RequestContext
from epd_proxy.request.ingress import CHAT, COMPLETIONS
from epd_proxy.request.legs.connectors import DecodeOnly, KVConnector, NixlPull
from epd_proxy.request.legs.stage_bodies import decode_body
from epd_proxy.request.legs.stages import DecodeLeg
from epd_proxy.request.turns.answers import read_answer, reuse_params, tokenize_body, tokens_of
from epd_proxy.request.turns.kv_budget import NOT_KEPT
from epd_proxy.request.turns.kv_guard import KvGuard
from epd_proxy.request.turns.multiturn import (
    BOUND,
    EDITED,
    LOCAL_PREFILL_PARAMS,
    NO_IDS,
    UNKNOWN,
    USED,
    Entry,
    KVReuse,
    TurnStore,
    answer_message,
    earlier_keys,
    estimate_new_tokens,
    keep_key,
    lookup_key,
)
from epd_proxy.request.turns.outcomes import (
    ALREADY_USED,
    DECODE_DROPPED,
    DECODE_GONE,
    EVICTED,
    INVALID,
    KEPT,
    LOCAL_PREFILL,
    MEDIA,
    NO_PULL_PREFILL,
    NOT_HELD,
    NOT_KEYED,
    OLDER_TURN,
    OPENING,
    REQUEST_FAILED,
    RETRIED,
    REUSED,
    SHORT,
    STREAM_NO_PARAMS,
    TOKENIZE_FAILED,
    TOKENS,
    UNMATCHED,
    TurnCounts,
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
from epd_proxy.request.turns.read_back import DecodeAddresses
from epd_proxy.request.turns.shared_turns import SharedTurns
from epd_proxy.request.turns.streams import params_of, read_stream, strip_stream_params
from epd_proxy.request.turns.unkept import UnkeptStreams
from epd_proxy.routing.view import EMPTY_VIEW
from epd_proxy.state.guard import GuardedStore
from epd_proxy.wire.blobs import encode_json
from epd_proxy.wire.errors import ProxyError
from epd_proxy.wire.ids import hex_id

log = logging.getLogger("epd_proxy.pipeline")

# Background calls that free kept KV on decode early (``TurnReuse.release``) at once.
MAX_RELEASES = 64

# A turn's outcome (outcomes.py) from why the store had nothing for it (TurnStore.take); the
# other reasons (expired, superseded, decode_gone, edited) are their own outcome's name.
_OUTCOME_OF = {UNKNOWN: NOT_HELD, USED: ALREADY_USED, BOUND: EVICTED}


@dataclass(slots=True)
class FoundTurn(PreviousTurn):
    """A previous turn taken for a request: what the placement reads (``PreviousTurn``), and what
    its use needs after (the kept entry; the new prompt's tokens, or the request to tokenize it)."""

    entry: Entry
    asked: dict | None = None
    tokens: list[int] | None = None


class TurnReuse:
    """Multi-turn KV reuse for one proxy process (docs/architecture.md, "Multi-turn KV reuse").
    ``store`` is None with ``--no-kv-reuse``: answers still lose their parameters. With a
    ``shared`` state store (``--state-store``, the ``--workers`` parent) the kept parameters
    live there (``shared_turns.py``) and ``store`` keeps this process's counters."""

    def __init__(self, config: ProxyConfig, *, prefill: InstancePool, decode: InstancePool, connector: KVConnector,
                 decode_only: DecodeOnly, models: ModelDirectory, base_headers: Headers,
                 shared: GuardedStore | None = None, kv: KvLookup | None = None) -> None:
        self.store = TurnStore(config.kv_reuse_ttl, config.kv_reuse_margin, config.kv_reuse_max_held_tokens) \
            if config.kv_reuse else None
        # The NIXL addresses each decode sent this process in its own answers: what a kept turn
        # read back from the shared store must point at (read_back.py).
        self.addresses = DecodeAddresses()
        self.shared = SharedTurns(shared, self.store, self.verify) \
            if shared is not None and self.store is not None else None
        self.writes: set[asyncio.Task] = set()  # kept turns on their way to the shared store
        self.prefill = prefill
        self.decode = decode
        self.connector = connector
        self.decode_only = decode_only
        self.models = models
        self.base_headers = base_headers
        self.releases: set[asyncio.Task] = set()
        # What kept turns may pin of each decode's KV cache (kv_budget.py), checked every scrape.
        self.guard = KvGuard(self.store, self.shared, decode, config.scrape_interval, self.release,
                             lambda: MAX_RELEASES - len(self.releases)) if self.store is not None else None
        self.pull = isinstance(connector, NixlPull)  # reuse is for the pull connector (protocol.md §2.10)
        self.counts = TurnCounts()
        # The KV block index (KV events): whether the decode holding a turn still holds its blocks.
        self.kv = kv
        # The decodes (URLs) seen to send their parameters in a chat or completions stream's last
        # event: asked for the stream's token ids from then on (asks_stream_ids). vLLM 0.32 never
        # sends them there, so its streams are never asked.
        self.stream_decodes: set[str] = set()
        # The decodes seen to end such a stream without parameters, when asked for its token ids
        # to learn it (asks_stream_ids): not asked again. A decode in neither set is asked once,
        # so that the first stream it gives this process can be kept too.
        self.stream_plain: set[str] = set()
        # Turns answered by a stream without parameters: their next turn's outcome says so.
        self.unkept = UnkeptStreams()
        # Per decode URL, whether its answers through the pull connector hold blocks for a later
        # reader (True: one came with parameters; False: one came without). A decode not in it is
        # asked for token ids (probes) until it answers, so the first answer it gives this process
        # can be kept too. Forgotten when the decode joins anew or leaves (forget).
        self.decodes: dict[str, bool] = {}

    def probes(self, decode: Instance) -> bool:
        """Whether a P/D answer from ``decode`` should carry the token ids the next turn is
        checked against before any decode has answered with parameters: it has not answered
        this process yet (reuse on, the pull connector). Costs decode's ids in one answer per
        decode and process when decode keeps no blocks (docs/protocol.md §2.10)."""
        return self.store is not None and self.pull and decode.url not in self.decodes

    def answered_plain(self, ctx: RequestContext, decode: Instance) -> None:
        """Decode's whole answer, through the pull connector's prefill (``ctx.prefill_report``),
        came without parameters: it keeps no blocks, and is not asked for token ids to learn it."""
        if ctx.prefill_report is not None and decode.url not in self.decodes and self.pull:
            self.decodes[decode.url] = False

    def forget(self, url: str) -> None:
        """The decode at ``url`` left or joined anew (maybe another engine, another config)."""
        self.decodes.pop(url, None)
        self.addresses.forget(url)
        self.stream_decodes.discard(url)
        self.stream_plain.discard(url)
        if self.store is not None:
            self.store.drop_decode(url)

    def verify(self, entry: Entry) -> str:
        """Whether a kept turn read back from the shared store points at its decode, at an
        address that decode sent this process itself: "" if so, else what it is counted as
        (``epd_proxy_state_store_invalid_total{entry}``): ``turn`` (another address),
        ``turn_unverified`` (a decode of the pool that has not answered this process with
        parameters yet). A turn naming a decode not in the pool passes here and is never sent
        anywhere: not read (``decode_gone``), not released (``release``)."""
        if self.decode.find(entry.decode) is None:
            return ""
        if not self.addresses.knows(entry.decode):
            return "turn_unverified"
        return "" if self.addresses.has(entry.decode, entry.params) else "turn"

    def status(self) -> dict[str, dict]:
        """Per decode URL, what ``/status`` shows of its reuse: whether it keeps blocks (None:
        not known yet), and the tokens and conversations kept here for a next turn."""
        if self.store is None:
            return {}
        held = self.store.holding()
        out = {}
        for url in set(held) | set(self.decodes):
            tokens, conversations = held.get(url, (0, 0))
            out[url] = {"keeps_blocks": self.decodes.get(url), "held_tokens": tokens,
                        "held_conversations": conversations,
                        "kv_budget": self.guard.status(url) if self.guard is not None else None}
        return out

    def collector(self) -> Callable[[dict[str, list]], None]:
        """What multi-turn KV reuse tells ``/metrics`` (``epd_proxy_kv_reuse_*``)."""
        store, counts, guard = self.store, self.counts, self.guard

        def collect(f: dict[str, list]) -> None:
            if store is None:
                return
            f["epd_proxy_kv_reuse_turns"] += [[o, n] for o, n in counts.turns.items()]
            f["epd_proxy_kv_reuse_answers"] += [[r, n] for r, n in counts.answers.items()]
            f["epd_proxy_kv_reuse_local_prefill_declined"].append([counts.declined])
            f["epd_proxy_kv_reuse_freed"].append([counts.freed])
            f["epd_proxy_kv_reuse_released"] += [[r, n] for r, n in store.released.items()]
            f["epd_proxy_kv_reuse_held_tokens"] += [[u, n] for u, n in store.held.items()]
            if guard is not None:
                f["epd_proxy_kv_reuse_pressure"] += [[u, r, n] for (u, r), n in guard.let_go.items()]
        return collect

    def asks_stream_ids(self, ctx: RequestContext, body: dict, decode: Instance) -> bool:
        """Whether a chat or completions stream whose client did not ask for token ids should
        ask ``decode`` for them: a decode seen to send its parameters in a stream, or one not
        seen to end such a stream yet (the pull connector: its first stream may be kept; vLLM
        0.32's streams carry no parameters, so it costs one stream's ids per decode and
        process), and one choice without an echo (read_stream reads back nothing else)."""
        url = decode.url
        return ((url in self.stream_decodes or (self.pull and url not in self.stream_plain))
                and (ctx.path == CHAT or ctx.path == COMPLETIONS)
                and body.get("n") in (None, 1) and not body.get("echo"))

    def stream_ended_plain(self, ctx: RequestContext, decode: Instance, body: dict) -> None:
        """A stream ended without parameters: nothing kept for its next turn, which is told
        why (``unkept``). If the proxy asked for its token ids, ``decode`` sends none in its
        streams, and is not asked again (until it joins anew)."""
        if ctx.ids_asked and decode.url not in self.stream_decodes:
            self.stream_plain.add(decode.url)
        if ctx.turn_tried:  # a turn of a conversation, as reuse reads them
            if ctx.path == CHAT:
                self.unkept.add_chat(body)
            elif ctx.path in PROMPT_APIS:
                self.unkept.add_prompt(body, ctx.path)

    async def lookup(self, ctx: RequestContext, body: dict, media: bool) -> FoundTurn | None:
        """Before the placement (reuse active): the previous turn kept for this request
        (:meth:`find_turn`), looked for once per request; a later attempt's outcome adjusted."""
        if ctx.turn_tried:
            self.again(ctx)
            return None
        assert self.store is not None
        return await self.find_turn(ctx, self.store, body, media)

    async def prepare(self, ctx: RequestContext, body: dict, placed: Placement, found: FoundTurn | None,
                      media: bool) -> dict:
        """After the placement, while reuse is active (or, before that, for a decode not heard from
        yet that ``probes`` says to ask: its first answer may be kept, and the first conversation's
        second turn reuses): the body decode gets. Decode is asked for the token ids the next turn's
        prompt is checked against, and the previous turn is used as placed (:meth:`use_turn`)."""
        if body.get("stream") is not True and not body.get("return_token_ids") and ctx.api is None:
            # The tokens decode will hold: what the next turn's prompt is checked against.
            body = dict(body, return_token_ids=True)
            ctx.ids_asked = True
        if found is not None:
            await self.use_turn(ctx, found, placed)
        if (ctx.api is None and body.get("stream") is True and not body.get("return_token_ids") and not media
                and self.asks_stream_ids(ctx, body, placed.decode)):
            # A decode that sends its parameters in a stream: asked for the token ids the next
            # turn is checked against, taken out of what the client gets (IdStrippingRelay).
            body = dict(body, return_token_ids=True)
            ctx.ids_asked = True
        if placed.decode_why is HOLDS_TURN:  # the prefill skipped: the decode holding the rest computes it
            body = decode_body(body, kv=LOCAL_PREFILL_PARAMS)
        return body

    async def find_turn(self, ctx: RequestContext, turns: TurnStore, body: dict, media: bool = False
                        ) -> FoundTurn | None:
        """The previous turn kept for this request, taken (once per request: never on a retry),
        with the decode holding it: the placement's input (placement/decision.py decides whether
        that decode computes the turn alone or the prefill reads it there). None, with the turn's
        outcome in ``ctx.kv_outcome`` (outcomes.py), when there is none to use."""
        ctx.turn_tried = True
        if media:
            ctx.kv_outcome = MEDIA
            return None
        now = time.monotonic()
        asked: dict | None = None  # the /tokenize request for the new prompt
        tokens: list[int] | None = None  # or its tokens, when the request spells them
        if ctx.path == CHAT:
            scope = ctx.scope or b""  # the client key's (tenants/key_scope.py)
            found = lookup_key(body, ctx.conversation, scope)
            if found is None:
                messages = body.get("messages")
                answered = isinstance(messages, list) and _after_last_answer(messages) < len(messages)
                ctx.kv_outcome = NOT_KEYED if answered else OPENING
                return None
            key, conversation, _, new_chars = found
            new_messages = _after_last_answer(body["messages"])  # lookup_key found an answer in them
            entry, reason, stale = await self._take(ctx, turns, key, conversation, now)
            if stale is not None:
                if reason == EDITED and stale.key is not None and stale.key in earlier_keys(body, scope):
                    reason = OLDER_TURN  # its later turns were served elsewhere, or not kept
                self.release(stale)
            asked = tokenize_body(body)
        else:  # completions, generate (turns/prompts.py)
            material = prompt_material(body, ctx.path)
            scope = ctx.scope or b""
            prefix = None if material is None else prefix_key(body, ctx.path, material[0], scope)
            if material is None or prefix is None:
                ctx.kv_outcome = NOT_KEYED
                return None
            entry, reason, new_chars, new_messages = None, UNKNOWN, 0, 0
            lengths = turns.lengths(prefix) if self.shared is None else await self.shared.lengths(prefix)
            for key, length in candidate_keys(body, ctx.path, material[0], lengths, scope):
                entry, reason, _ = await self._take(ctx, turns, key, None, now)
                if entry is not None or reason != UNKNOWN:
                    new_chars = len(material[0]) - length
                    break
            else:
                # No held turn of this prompt here: an opening prompt cannot be told from a turn
                # another process kept (a stream without parameters can: it is remembered).
                ctx.kv_outcome = STREAM_NO_PARAMS if self.unkept.prompt_follows(body, ctx.path) else UNMATCHED
                return None
            if material[1]:
                asked = tokenize_prompt_body(body)
            else:
                tokens = prompt_ids(material[0])
        if entry is None:
            ctx.kv_outcome = _OUTCOME_OF.get(reason, reason)
            if reason == UNKNOWN and ctx.path == CHAT and self.unkept.chat_follows(
                    body, len(body["messages"]) - 1 - _after_last_answer(body["messages"])):
                ctx.kv_outcome = STREAM_NO_PARAMS
            return None
        holder = self.decode.find(entry.decode)
        if holder is None or not holder.healthy or holder in ctx.excluded:
            ctx.kv_outcome = DECODE_GONE
            return None
        # A cache_salt's blocks are keyed with it in the index, where a lookup of tokens never finds them.
        if (self.kv is not None and entry.ids is not None and self.kv.feed.readers and "cache_salt" not in body
                and self._dropped(entry, holder, now - (entry.deadline - turns.life))):
            ctx.kv_outcome = DECODE_DROPPED
            return None
        return FoundTurn(holder, estimate_new_tokens(entry, new_chars, new_messages), entry, asked, tokens)

    async def use_turn(self, ctx: RequestContext, found: FoundTurn, placed: Placement) -> None:
        """The placement's answer for a previous turn: computed on its decode (``placed.decode``
        holds it), read by the prefill (``placed.kv_from``: the token check first), or let go."""
        if placed.declined:
            self.counts.declined += 1
        if placed.prefill is None and placed.decode is found.holder:
            # Not released: the turn's own request on that decode shares those blocks
            # (prefix-cache hits), so freeing them early would save a block, for a prefill call.
            ctx.kv_outcome = LOCAL_PREFILL
            return
        entry = found.entry
        if placed.kv_from is None or placed.prefill is None:
            ctx.kv_outcome = NO_PULL_PREFILL
            self.release(entry)
            return
        connector = self.connector
        assert isinstance(connector, NixlPull)  # placed.kv_from: the pull connector
        # vLLM reads what the parameters name without checking that the new prompt's tokens
        # extend them: the prompt is tokenized and only the tokens it shares with what decode
        # holds are read.
        tokens = found.tokens
        if found.asked is not None:
            # The prefill that will run the prompt tokenizes it; if it cannot be reached, the
            # decode holding the history (the same model, the same tokenizer and template).
            asked = encode_json(found.asked)
            for stage, inst in ((connector.prefill, placed.prefill), (self.decode_only.decode, found.holder)):
                called, t = len(ctx.legs), time.perf_counter()
                try:
                    data = await stage.exchange(ctx, inst, "/tokenize", asked, ctx.upstream_headers())
                    tokens = tokens_of(data)
                    break
                except ProxyError as err:
                    if not err.unsent:
                        break
                finally:
                    tokenize_leg(ctx, called, time.perf_counter() - t)
            if tokens is None:
                ctx.kv_outcome = TOKENIZE_FAILED
                self.release(entry)
                return
        params = reuse_params(entry, tokens) if tokens is not None else None
        if params is None:
            ctx.kv_outcome = TOKENS
            self.release(entry)
            return
        ctx.kv_outcome = REUSED
        ctx.kv_reuse = KVReuse(params, entry)

    @staticmethod
    def again(ctx: RequestContext) -> None:
        """A later attempt of a request that looked for its previous turn: a read or a skipped
        prefill already spent on a failed attempt is not this attempt's (it computes the history)."""
        if ctx.kv_reuse is None and (ctx.kv_outcome == REUSED or ctx.kv_outcome == LOCAL_PREFILL):
            ctx.kv_outcome = RETRIED

    async def _take(self, ctx: RequestContext, turns: TurnStore, key: bytes, conversation: bytes | None,
                    now: float) -> tuple[Entry | None, str, Entry | None]:
        """The kept turn under ``key``, from this process (popped before any await) or the
        shared store (taken atomically there, and then only the request's key's: key_scope.py)."""
        if self.shared is None:
            return turns.take(key, conversation, now)
        entry, reason, stale = await self.shared.take(key, conversation, now)
        if entry is not None and entry.owner != ctx.scope:  # written there under another key's turn key
            self.shared.store.invalid("turn")
            return None, INVALID, None
        return entry, reason, stale

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
        if self.guard is not None:
            self.guard.start()

    def _dropped(self, entry: Entry, holder: Instance, age: float) -> bool:
        """Whether ``holder``'s own KV events (live) say it no longer holds ``entry``'s blocks,
        kept ``age`` seconds ago (it evicted them, restarted, cleared its cache): the turn is not
        sent to read them.
        What it still holds of them is let go (``release``); when it holds none of them there
        is nothing pinned left to free (a restarted engine would fail the release call on the
        prefill, and vLLM clears a cache only when no block is in use)."""
        assert self.kv is not None and entry.ids is not None
        said = self.kv.holds(holder.url, entry.ids, entry.model)
        if said is None or holds_turn(said[0], len(entry.ids), said[1], age, self.kv.settle):
            return False
        if said[0]:
            self.release(entry)
        return True

    def keep(self, ctx: RequestContext, body: dict, leg: DecodeLeg, answer: bytes) -> bytes:
        """Decode's answer held blocks for a later reader: the parameters taken out of what
        the client gets, and kept for the conversation's next turn (chat)."""
        chat = ctx.path == CHAT and ctx.api is None
        read = read_answer(answer, chat, ctx.ids_asked)
        turns = self.store
        if turns is None or not self.pull:
            return read.body  # reuse is for the pull connector (docs/protocol.md §2.10)
        self._activate(turns)
        self.decodes[leg.inst.url] = True
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
                self.counts.answer(read.reason)
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
        if turns is None or params is None or not self.pull:
            return
        self._activate(turns)
        self.decodes[leg.inst.url] = True
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
        if self.guard is not None and not self.guard.admit(leg.inst, tokens if type(tokens) is int else 0):
            self._let_go(leg, turns, params, body.get("model"), now, NOT_KEPT)  # its KV cannot take more
            return
        self.addresses.learn(leg.inst.url, params)
        key, conversation, chars = keep_key(body, message, ctx.conversation, ctx.scope or b"")
        entry = Entry(params, leg.inst.url, tokens if type(tokens) is int else 0, chars, now + turns.life,
                      conversation, body.get("model"), ids, key=key, owner=ctx.scope)
        self.counts.answer(KEPT)
        self._put(turns, key, entry, now)

    def _keep_prompt(self, ctx: RequestContext, body: dict, leg: DecodeLeg, turns: TurnStore, held: HeldTurn,
                     now: float) -> None:
        material = prompt_material(body, ctx.path) if held.held is not None else None
        scope = ctx.scope or b""
        prefix = None if material is None else prefix_key(body, ctx.path, material[0], scope)
        if held.params is None or held.held is None or prefix is None:
            self.counts.answer(held.reason or SHORT)
            return
        tokens = held.params.get("remote_num_tokens")
        if self.guard is not None and not self.guard.admit(leg.inst, tokens if type(tokens) is int else 0):
            self._let_go(leg, turns, held.params, body.get("model"), now, NOT_KEPT)
            return
        self.addresses.learn(leg.inst.url, held.params)
        entry = Entry(held.params, leg.inst.url, tokens if type(tokens) is int else 0, len(held.held),
                      now + turns.life, prompt_keep_key(body, ctx.path, held.held, scope), body.get("model"), held.ids,
                      prefix, owner=ctx.scope)
        self.counts.answer(KEPT)
        self._put(turns, entry.conversation, entry, now)

    def _let_go(self, leg: DecodeLeg, turns: TurnStore, params: dict | None, model: object, now: float,
                reason: str = NO_IDS) -> None:
        """Parameters that cannot be kept: counted, and decode's blocks freed at once."""
        self.counts.answer(reason)
        if params is not None:
            self.addresses.learn(leg.inst.url, params)
            self.release(Entry(params, leg.inst.url, 0, 0, now + turns.life, b"", model))

    def ended(self, ctx: RequestContext) -> None:
        """The request is over: its turn's outcome counted, and parameters it took for a
        prefill that never ran let go."""
        reuse = ctx.kv_reuse
        if reuse is not None and reuse.entry is not None:
            ctx.kv_outcome = REQUEST_FAILED
            self.release(reuse.entry)
        if ctx.kv_outcome is not None:
            self.counts.turn(ctx.kv_outcome)

    def release(self, entry: Entry) -> None:
        """Kept parameters that will not be used. vLLM 0.32 has one way to free a finished
        request's blocks on decode before its TTL: a prefill request that carries them, which
        tells decode it is done with them even when it reads nothing (an abort of a finished
        request does nothing). So a 2-token prefill is sent with them, told to read nothing
        (``remote_num_tokens: 0``), in the background; when that cannot be done (no pull
        prefill, the decode gone, too many such calls at once), decode frees them at its TTL."""
        turns = self.store
        if (turns is None or not self.pull or not self.prefill
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
            p = choose(self.prefill, (), EMPTY_VIEW, None if models is None else models.get("prefill"))
            # Two tokens: less than a block (never cached), and a list vLLM reads as token ids.
            body = {"model": entry.model, "prompt": [first, first], "max_tokens": 1,
                    "kv_transfer_params": dict(entry.params, remote_num_tokens=0)}
            await connector.prefill.run(ctx, p, body)
            self.counts.freed += 1
        except ProxyError as err:
            log.debug("kept KV on %s not released early: %s", entry.decode, err.message)
        finally:
            ctx.release_all()

    async def close(self) -> None:
        if self.guard is not None:
            await self.guard.close()
        if self.shared is not None:
            await self.shared.close()
        for task in list(self.releases | self.writes):
            task.cancel()
        if self.releases or self.writes:
            await asyncio.gather(*self.releases, *self.writes, return_exceptions=True)


def tokenize_leg(ctx: RequestContext, called: int, seconds: float) -> None:
    """A ``/tokenize`` call made for the token check: its instance named apart from the
    stages' (the access log's ``tok=``: it is no prefill, nor a retry), its time a stage's."""
    ctx.tokenized = (ctx.tokenized or []) + ctx.legs[called:]
    del ctx.legs[called:]
    ctx.timing("tokenize", seconds)
    ctx.upstream += seconds


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
