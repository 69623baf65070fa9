"""The block index consulted for one request: the prompt's tokens as the engine will see
them, and the prefix each instance holds of them (``RequestView.held``), before the
policy chooses; the blocks the chosen instance is about to compute counted as held there
for a while after (speculative entries).

The tokens: a completions prompt of token ids is used as it is; a text prompt or a chat
is tokenized by one instance of the model (vLLM's ``POST /tokenize``, the chat template
applied there, exactly as the generation request will be), the least loaded one. That
costs one round trip to an instance per request, paid only while the index speaks for
some instance (KV events on and live). Requests with media, and the APIs the proxy
rewrites (Messages, Responses, generate), keep approximate routing: their tokens are not
what a text-only tokenization gives. Anything that fails costs the lookup, never the
request: the view stays without ``held`` and the policy routes as before.

The index's answer is an input of the placement (``decision.py``): a P/D request some decode
already holds all but a few tokens of is sent to that decode alone. The same index tells the
multi-turn reuse whether the decode holding a conversation's previous turn still holds its
blocks (``holds``). This module is the lookup's I/O (the ``/tokenize`` call) and the index's
bookkeeping after a placement (``chosen``); it decides nothing.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol, Sequence

import msgspec

from epd_proxy.http import Headers
from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import ModelKey
from epd_proxy.instances.pool import InstancePool
from epd_proxy.kvcache.feed import EventFeed
from epd_proxy.kvcache.streams import instance_of
from epd_proxy.routing.view import RequestView
from epd_proxy.wire.errors import ProxyError

log = logging.getLogger("epd_proxy.kv_events")

# A /tokenize call's bound: past it the request routes approximately.
TOKENIZE_TIMEOUT = 2.0
# The chat fields that shape the prompt's tokens (vLLM's tokenize request takes them all).
_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                "chat_template_kwargs", "tools", "add_special_tokens")
_JSON = [(b"content-type", b"application/json")]
# The paths whose prompt is looked up (request/ingress.py's names).
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# A kept turn younger than this (past the feed's heartbeat) is not judged by the index: the
# events of its blocks may still be on their way (a live message lost is replayed at the next
# heartbeat), and a client's next turn can come before they arrive.
SETTLE_MARGIN = 1.0
# What a lookup came to (``epd_proxy_kv_lookups``).
OUTCOMES = ("indexed", "not_live", "media", "api", "no_prompt", "tokenize_failed")


class Looking(Protocol):
    """What a lookup reads of a request and writes to it (``request/context.RequestContext``)."""

    @property
    def request_id(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def api(self) -> object: ...
    @property
    def view(self) -> RequestView: ...

    def model_for(self, role: str) -> ModelKey | None: ...
    def queue(self, inst: Instance, tokens: int) -> None: ...


class _Tokens(msgspec.Struct):
    tokens: list[int]


_decode_tokens = msgspec.json.Decoder(_Tokens).decode


class KvLookup:
    """Per request: the prompt's tokens and what each live instance holds of them."""

    def __init__(self, feed: EventFeed, tokenizers: InstancePool, headers: Headers, *,
                 timeout: float = TOKENIZE_TIMEOUT, clock: Callable[[], float] = time.monotonic) -> None:
        self.feed = feed
        self.index = feed.index
        self.tokenizers = tokenizers  # the pool whose instances tokenize (decode: every topology has it)
        self._headers = _JSON + list(headers)
        self._timeouts = TransportTimeouts(connect=timeout, headers=timeout, idle=timeout)
        self._clock = clock
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.tokenized = 0  # /tokenize calls that answered
        self.tokenize_seconds = 0.0  # their time, summed
        self.settle = feed.heartbeat + SETTLE_MARGIN  # a kept turn's age before the index judges it (holds_turn)

    async def prepare(self, ctx: Looking, body: dict, media: bool) -> None:
        """Fill ``ctx.view``'s ``held``, ``live``, ``tokens`` and ``kv_keys`` (once)."""
        view = ctx.view
        if view.held is not None or not self.feed.readers:
            return
        live = self.feed.live()
        outcomes = self.outcomes
        if not live:
            outcomes["not_live"] += 1
            return
        if media:
            outcomes["media"] += 1
            return
        if ctx.api is not None or ctx.path not in (CHAT, COMPLETIONS):
            outcomes["api"] += 1
            return
        ids = await self._tokens(ctx, body)
        if ids is None:
            return
        model = body.get("model")
        # An adapter's blocks are keyed under its name (the events' lora_name).
        adapter = self.tokenizers.served.adapter_of(model) if isinstance(model, str) else None
        keys: dict[int, list[int]] = {}
        held: dict[str, int] = {}
        for source, tokens in self.index.longest_prefix(ids, adapter, self._clock(), keys).items():
            url = instance_of(source)
            if tokens > held.get(url, 0):
                held[url] = tokens
        view.held = held
        view.live = live
        view.tokens = len(ids)
        view.kv_keys = [k for chain in keys.values() for k in chain]
        outcomes["indexed"] += 1

    def holds(self, url: str, ids: Sequence[int], model: object) -> tuple[int, int] | None:
        """What the instance at ``url`` holds of ``ids`` (tokens of their longest prefix, and its
        block size), the index says; None when its events are not live or it never stored a block
        (the index cannot speak for it). No speculative entries: only what its events said."""
        readers = self.feed.readers.get(url)
        if not readers or not all(r.connected for r in readers):
            return None
        index = self.index
        sizes = [size for src in index.sources() if instance_of(src.name) == url for size in src.block_sizes]
        if not sizes:
            return None
        adapter = self.tokenizers.served.adapter_of(model) if isinstance(model, str) else None
        held = max((tokens for source, tokens in index.longest_prefix(ids, adapter).items()
                    if instance_of(source) == url), default=0)
        return held, max(sizes)

    def chosen(self, inst: Instance, ctx: Looking) -> None:
        """``inst`` computes the prompt: its blocks count as held there until its events
        say so (or the entry expires), and what it computes of it is in its backlog (what
        ``cache-aware`` weighs a next prompt's wait by) until that leg ends."""
        view = ctx.view
        if view.held is not None and view.kv_keys:
            computes = view.tokens - view.held.get(inst.url, 0)
            if computes > 0:
                ctx.queue(inst, computes)
            self.index.speculate(inst.url, view.kv_keys, self._clock())

    async def _tokens(self, ctx: Looking, body: dict) -> list[int] | None:
        if ctx.path == COMPLETIONS:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                self.outcomes["no_prompt"] += 1
                return None
            ask: dict = {"model": body.get("model"), "prompt": prompt}
            if "add_special_tokens" in body:
                ask["add_special_tokens"] = body["add_special_tokens"]
        else:
            ask = {k: body[k] for k in _CHAT_FIELDS if k in body}
            ask["model"] = body.get("model")
        return await self._tokenize(ctx, ask)

    async def _tokenize(self, ctx: Looking, ask: dict) -> list[int] | None:
        try:
            candidates = self.tokenizers.candidates((), ctx.model_for("decode"))
        except ProxyError:  # none serves it: the request's own routing says so
            return None
        inst = min(candidates, key=lambda i: i.inflight)
        t = time.perf_counter()
        try:
            status, _, data = await inst.connections.fetch("POST", "/tokenize", headers=self._headers,
                                                           body=msgspec.json.encode(ask), timeouts=self._timeouts)
            if status != 200:
                raise ValueError(f"HTTP {status}: {data[:200]!r}")
            ids = _decode_tokens(data).tokens
        except (UpstreamError, OSError, ValueError, msgspec.DecodeError) as exc:
            self.outcomes["tokenize_failed"] += 1
            log.debug("request %s: /tokenize on %s failed (%s): routed without the block index",
                      ctx.request_id, inst.url, exc)
            return None
        finally:
            self.tokenize_seconds += time.perf_counter() - t
        self.tokenized += 1
        return ids

    def collect(self, f: dict[str, list]) -> None:
        for outcome, n in self.outcomes.items():
            f["epd_proxy_kv_lookups"].append([outcome, n])
        f["epd_proxy_kv_tokenize_seconds"].append([self.tokenize_seconds])


def holds_turn(held: int, ids: int, block_size: int, age: float, settle: float) -> bool:
    """Whether a decode holding ``held`` tokens of a kept turn's ``ids`` tokens (the index
    says) still holds the turn, kept ``age`` seconds ago: every full block of them but the last
    token's (the engine never computes the KV of the last token it sampled, so that block may
    never be stored); a turn younger than ``settle`` is taken as held (its events may be on
    their way)."""
    return age < settle or held >= (ids - 1) // block_size * block_size
