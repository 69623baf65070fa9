"""Routing policies: which instance of a role serves a request (or a media item).

The pool filters the candidates by health (healthy, half-open, panic rules);
a policy only picks among them, from two kinds of input:

* a small, pure view of the request (:class:`RequestView`) over the
  already-parsed body, each key computed once, on first use: the conversation
  *anchor* (a hash of the prompt's beginning), the media items' uuids, the
  prompt's size and its chained block hashes;
* each candidate's load: this proxy's in-flight count, plus the instance's
  own queue as last scraped from its ``/metrics`` (``LoadSignals``, kept
  fresh by ``load_signals.py`` in the background).

``cache-aware`` routes by rendezvous (highest-random-weight) hashing of the
anchor, or of an item's uuid for encoders: every proxy replica and every
``--workers`` process computes the same order from the instance URLs alone,
so they agree without a shared store, and an instance leaving moves only the
keys that were its own. Load bounds it: an instance loaded past the balance
thresholds relative to the least-loaded candidate is passed over, in
rendezvous order. A proxy also keeps each conversation where it sent the
conversation's previous turn, as long as that turn was its own (see
``CacheAware``), so conversations stay where their openings were spread.

Pure: no I/O, no clock; the only state is rotation cursors, a random
generator for ``power-of-two``, and ``cache-aware``'s seeds by URL, counts of
openings and spills, and a bounded map of conversations' last instances.
"""

from __future__ import annotations

import hashlib
import random
import zlib
from array import array
from typing import TYPE_CHECKING, Protocol, Sequence

from .encode.encoder_plan import assign_round_robin
from .encode.multimodal import EMBEDS_TYPES

if TYPE_CHECKING:  # pragma: no cover - typing only; pool.py imports this module
    from .encode.multimodal import MediaItem
    from .pool import Instance

_M64 = (1 << 64) - 1

# The anchor hashes at most this many characters of a chat's first turns and of a
# completions prompt (token-id prompts: ids): enough to tell conversations apart,
# bounded so a 100 KB first message costs no more than a short one.
CHAT_ANCHOR_CHARS = 4096
PROMPT_ANCHOR_CHARS = 1024
PROMPT_ANCHOR_IDS = 256
# Block hashes (the approximate prefix identity of the whole prompt): characters per
# block, and at most this many blocks.
BLOCK_CHARS = 1024
MAX_BLOCKS = 64

# Media part types whose item uuid stands for the part (the parts collect_media finds).
_MEDIA = frozenset(EMBEDS_TYPES)
# What a media part weighs in a chat's history share (``RequestView.reuse``), in characters:
# an image is hundreds to thousands of tokens, its uuid a few dozen characters.
MEDIA_CHARS = 1024
# Leading messages of these roles are the preamble: often shared by many conversations, so
# likely cached on every instance, and no reason to prefer one (``RequestView.reuse``).
_PREAMBLE = frozenset(("system", "developer"))


def mix64(x: int) -> int:
    """A 64-bit avalanche (murmur3's finaliser): deterministic across processes,
    unlike ``hash()`` of a ``str``."""
    x &= _M64
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & _M64
    x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def key_of(text: str) -> int:
    """The routing key of a string (an item uuid)."""
    return mix64(zlib.crc32(text.encode("utf-8", "surrogatepass")) | (len(text) << 32))


def instance_seed(url: str) -> int:
    """An instance's rendezvous seed: from its URL only, so replicas configured with the
    same URLs agree."""
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "big")


# --------------------------------------------------------------------------------------
# The request's view

class RequestView:
    """What a policy may know of a request: its routing keys, nothing else. Built by the
    pipeline over the parsed body (chat: after ``collect_media`` validated it).

    Each key is computed on first use, once: a request that meets no policy reading it
    (one instance, or a key-blind policy) costs one small object.

    ``anchor``: 0 when the request has none (then cache-aware falls back to load).
    ``items``: the media items' uuids, in the request's global order.
    ``size``: the prompt's size in characters; ``blocks()``: its chained block hashes.
    ``reuse``: the share of the conversation that earlier turns left in a cache (0..1).
    ``mark`` / ``previous``: the prompt's shape, and that of the turn before it (see
    :attr:`mark`).
    """

    __slots__ = ("_body", "_media", "_chat", "_anchor", "_items", "_size", "_blocks", "_reuse", "_mark",
                 "_previous")

    def __init__(self, body: dict | None = None, media: Sequence[MediaItem] = (), chat: bool = True, *,
                 anchor: int | None = None) -> None:
        self._body = body
        self._media = media
        self._chat = chat
        self._anchor = anchor if anchor is not None or body is not None else 0
        self._items: list[str] | None = None
        self._size: int | None = None
        self._blocks: list[int] | None = None
        self._reuse: float | None = None if body is not None else 1.0
        self._mark = self._previous = 0

    @property
    def anchor(self) -> int:
        anchor = self._anchor
        if anchor is None:
            body = self._body
            assert body is not None  # no anchor given: there is a body to compute it from
            try:
                anchor = (_chat_anchor(body.get("messages"), self.items) if self._chat
                          else _prompt_anchor(body.get("prompt")))
            except Exception:  # a body shape nobody foresaw routes by load; it never fails the request
                anchor = 0
            self._anchor = anchor
        return anchor

    @property
    def items(self) -> list[str]:
        if self._items is None:
            self._items = [it.uuid for it in self._media]
        return self._items

    @property
    def size(self) -> int:
        """The prompt's size in characters (media count as their uuid's length)."""
        if self._size is None:
            self._size = sum(len(p) for p in _pieces(self._body, self._chat)) if self._body else 0
        return self._size

    @property
    def reuse(self) -> float:
        """What the anchor's instance may hold that another does not, as a share of the
        conversation: for a chat, the messages between the preamble (leading system /
        developer messages, likely cached everywhere) and the last user message, over
        everything after the preamble. 0 for a conversation's opening turn, near 1 for a
        long history and a short new message. A completions prompt has no turns to tell
        apart: 1 (the whole prompt may be cached)."""
        reuse = self._reuse
        if reuse is None:
            try:
                if self._chat and self._body:
                    reuse, self._mark, self._previous = _chat_turns(self._body.get("messages"))
                else:
                    reuse = 1.0
            except Exception:  # an unforeseen shape counts as all history: routing as before
                reuse = 1.0
            self._reuse = reuse
        return reuse

    @property
    def mark(self) -> int:
        """A chat prompt's shape: its message count and size in characters, packed in one
        int (0: none, e.g. a completions prompt). The next turn's :attr:`previous` equals
        it, so a proxy can tell that the turn before a request was its own."""
        if self._reuse is None:
            self.reuse  # noqa: B018 - one pass computes the three
        return self._mark

    @property
    def previous(self) -> int:
        """The :attr:`mark` of the turn before this one: the messages before the last
        assistant message, which answered them (0 if there is none)."""
        if self._reuse is None:
            self.reuse  # noqa: B018
        return self._previous

    def blocks(self) -> list[int]:
        """Chained hashes of the canonical prompt's ``BLOCK_CHARS``-character blocks (the last,
        partial one included), at most ``MAX_BLOCKS``: two prompts share the first n hashes
        exactly when their first n blocks agree."""
        if self._blocks is None:
            self._blocks = _block_hashes(_pieces(self._body, self._chat)) if self._body else []
        return self._blocks


EMPTY_VIEW = RequestView()


def _chat_anchor(messages, uuids: list[str]) -> int:
    """The messages up to and including the first user turn (system prompt and the
    conversation's opening), at most ``CHAT_ANCHOR_CHARS`` characters of content: the same
    for every turn of one conversation, different between conversations."""
    if not isinstance(messages, list):
        return 0
    crc = 0
    budget = CHAT_ANCHOR_CHARS
    media = 0
    for msg in messages:
        if not isinstance(msg, dict):
            return 0
        role = msg.get("role")
        crc = zlib.crc32(b"\x00" + (role.encode() if isinstance(role, str) else b"?"), crc)
        content = msg.get("content")
        if isinstance(content, str):
            if budget > 0:
                piece = content[:budget]
                budget -= len(piece)
                crc = zlib.crc32(piece.encode("utf-8", "surrogatepass"), crc)
        elif isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    text = part.get("text")
                    if isinstance(text, str) and budget > 0:
                        piece = text[:budget]
                        budget -= len(piece)
                        crc = zlib.crc32(piece.encode("utf-8", "surrogatepass"), crc)
                elif kind in _MEDIA:
                    if media < len(uuids):
                        crc = zlib.crc32(uuids[media].encode(), crc)
                    media += 1
                elif isinstance(kind, str):
                    uuid = part.get("uuid")
                    crc = zlib.crc32((uuid if isinstance(uuid, str) else kind).encode(), crc)
        if role == "user":
            break
    return mix64(crc | (1 << 32))


def _chat_turns(messages) -> tuple[float, int, int]:
    """``RequestView.reuse``, ``mark`` and ``previous`` of a chat's messages (sizes in
    characters, media parts ``MEDIA_CHARS`` each), in one pass."""
    if not isinstance(messages, list):
        return 1.0, 0, 0
    total = 0  # characters after the preamble
    history = -1  # ... before the last user message (-1: no user message yet)
    chars = 0  # characters of every message so far
    previous = 0
    preamble = True
    for n, msg in enumerate(messages):
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        if role == "assistant":
            previous = _MARK_BIT | (n << 40) | chars
        content = msg.get("content")
        size = (len(content) if type(content) is str
                else _parts_chars(content) if isinstance(content, list) else 0)
        chars += size
        if preamble:
            if role in _PREAMBLE:
                continue
            preamble = False
        if role == "user":
            history = total
        total += size
    mark = _MARK_BIT | (len(messages) << 40) | chars
    if history < 0:
        return 1.0, mark, previous  # no user turn to call new: leave it to the anchor
    return (history / total if history else 0.0), mark, previous


# ``RequestView.mark``: message count above bit 40, characters below, and a bit that makes
# a mark of no messages non-zero.
_MARK_BIT = 1 << 62


def _parts_chars(parts: list) -> int:
    size = 0
    for part in parts:
        if isinstance(part, dict):
            text = part.get("text")
            size += len(text) if isinstance(text, str) else MEDIA_CHARS
    return size


def _prompt_anchor(prompt) -> int:
    """A completions prompt's first ``PROMPT_ANCHOR_CHARS`` characters (or
    ``PROMPT_ANCHOR_IDS`` token ids); a batch is anchored by its first prompt."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return mix64(zlib.crc32(prompt[:PROMPT_ANCHOR_CHARS].encode("utf-8", "surrogatepass")) | (2 << 32))
    if isinstance(prompt, list) and prompt:
        try:
            raw = array("q", prompt[:PROMPT_ANCHOR_IDS]).tobytes()
        except (TypeError, OverflowError):
            return 0
        return mix64(zlib.crc32(raw) | (3 << 32))
    return 0


def _pieces(body: dict, chat: bool) -> list[str]:
    """The canonical prompt as text pieces (media by uuid), for size and block hashes."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list):
            return [",".join(map(str, prompt))]
        return []
    out: list[str] = []
    for msg in body.get("messages") or ():
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        out.append(f"\x00{role}\x00")
        content = msg.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                kind = part.get("type")
                if kind == "text" and isinstance(part.get("text"), str):
                    out.append(part["text"])
                elif isinstance(part.get("uuid"), str):
                    out.append(part["uuid"])
                elif isinstance(kind, str):
                    out.append(f"\x00{kind}\x00")
    return out


def _block_hashes(pieces: list[str]) -> list[int]:
    out: list[int] = []
    crc = 0
    fill = 0  # characters in the current block so far
    for piece in pieces:
        pos = 0
        while pos < len(piece) and len(out) < MAX_BLOCKS:
            take = min(BLOCK_CHARS - fill, len(piece) - pos)
            crc = zlib.crc32(piece[pos:pos + take].encode("utf-8", "surrogatepass"), crc)
            pos += take
            fill += take
            if fill == BLOCK_CHARS:
                out.append(crc)
                fill = 0
    if fill and len(out) < MAX_BLOCKS:
        out.append(crc)
    return out


# --------------------------------------------------------------------------------------
# Load: the requests on an instance are this proxy's (``inflight``) plus others' as last
# scraped (``signals.others``); the policies add them up inline, per candidate.

def score_of(inst: Instance) -> float:
    """The load-aware score (lower is better): this proxy's in-flight requests, the others'
    (scraped), and a penalty for a nearly full KV cache (``load_signals.kv_penalty``)."""
    return inst.inflight + inst.signals.load


# --------------------------------------------------------------------------------------
# Policies

class RoutingPolicy(Protocol):
    """Picks among candidates (never empty) already filtered by health."""

    name: str  # as in POLICIES and the flags
    # Whether the pipeline must compute the request's view / the pool scrape load signals.
    uses_view: bool
    uses_signals: bool

    def choose(self, candidates: list[Instance], view: RequestView = EMPTY_VIEW) -> Instance:
        """The instance for the request (prefill, decode, PD)."""
        ...

    def assign(self, candidates: list[Instance], items: Sequence[MediaItem]) -> list[Instance]:
        """An instance per media item (encoders), in the items' order."""
        ...


class RoundRobin:
    """Strict rotation; the cursor persists across requests (for encoders: per item, which is
    the reference proxy's spread, #52484)."""

    name = "round-robin"
    uses_view = False
    uses_signals = False

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, candidates: list[Instance], view: RequestView = EMPTY_VIEW) -> Instance:
        inst = candidates[self._cursor % len(candidates)]
        self._cursor += 1
        return inst

    def assign(self, candidates: list[Instance], items: Sequence[MediaItem]) -> list[Instance]:
        indices, self._cursor = assign_round_robin(self._cursor, len(candidates), len(items))
        return [candidates[i] for i in indices]


class _Scored:
    """Lowest score wins; a tie goes to the instance that has served the fewest requests,
    so an idle cluster spreads requests evenly instead of piling on the first, and counts
    stay level when load is light (the search starts at a rotating position, so equal
    counts rotate too). Items of one request count against each other."""

    uses_view = False
    uses_signals = False

    def __init__(self) -> None:
        self._cursor = 0

    @staticmethod
    def score(inst: Instance) -> float:
        return inst.inflight

    def choose(self, candidates: list[Instance], view: RequestView = EMPTY_VIEW) -> Instance:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        start = self._cursor % n
        self._cursor += 1
        score = self.score
        best = candidates[start]
        low = score(best)
        for i in range(1, n):
            c = candidates[(start + i) % n]
            s = score(c)
            if s < low or (s == low and c.requests < best.requests):
                best, low = c, s
        return best

    def assign(self, candidates: list[Instance], items: Sequence[MediaItem]) -> list[Instance]:
        n = len(candidates)
        scores = [self.score(c) for c in candidates]
        out = []
        for _ in items:
            start = self._cursor % n
            self._cursor += 1
            best = start
            for i in range(1, n):
                j = (start + i) % n
                if scores[j] < scores[best] or (scores[j] == scores[best]
                                                and candidates[j].requests < candidates[best].requests):
                    best = j
            scores[best] += 1
            out.append(candidates[best])
        return out


class LeastLoaded(_Scored):
    """Fewest requests in flight from this proxy."""

    name = "least-loaded"


class LoadAware(_Scored):
    """This proxy's in-flight count plus the instance's scraped queue and KV-cache usage."""

    name = "load-aware"
    uses_signals = True
    score = staticmethod(score_of)


class PowerOfTwo:
    """Two candidates at random, the lower load-aware score wins: spreads like least-loaded
    without every replica herding onto the one instance that looked idle at the last scrape."""

    name = "power-of-two"
    uses_view = False
    uses_signals = True

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed).random

    def choose(self, candidates: list[Instance], view: RequestView = EMPTY_VIEW) -> Instance:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        r = self._random
        i = int(r() * n)
        j = int(r() * (n - 1))
        if j >= i:
            j += 1
        a, b = candidates[i], candidates[j]
        return b if score_of(b) < score_of(a) else a

    def assign(self, candidates: list[Instance], items: Sequence[MediaItem]) -> list[Instance]:
        return [self.choose(candidates) for _ in items]


class CacheAware:
    """Rendezvous affinity bounded by load.

    The preferred instance for a key is the candidate with the highest ``mix64(key ^
    seed(url))``; it is passed over, in rendezvous order, while its load exceeds both
    ``min_load + balance_abs`` and ``min_load * balance_rel`` (``min_load`` that of the
    least-loaded candidate): a hot prefix spills to its second instance, and so on. The
    least-loaded candidate always qualifies, so a pick always exists. A request without an
    anchor goes to the load-aware choice.

    The slack scales with what staying can gain: the request's ``reuse`` share (its
    history, which only the preferred instance is likely to hold). A conversation's
    opening turn has nothing there yet, so it goes to the least-loaded candidate (the
    preferred one among equals) instead of queueing behind another's long prefill; its
    next turn still finds the preferred instance, and loses at most the opening's own
    text. A long history keeps the full slack.

    Openings also keep the instances' shares level: among the least-loaded candidates only
    those whose recent openings are within ``OPEN_SLACK_REL`` (at least ``OPEN_SLACK_MIN``)
    of the fewest qualify. Rendezvous alone spreads n conversations over k instances with
    a spread of about sqrt(n/k), which on traffic of single prompts is the whole load.

    A conversation stays where this proxy sent its previous turn (its *home*, within the
    same load bound), so the level shares of openings stay level for the conversations'
    lives. The home counts only when the turn before the request was this proxy's own
    (``RequestView.previous`` equals the mark it kept): a turn another replica or
    ``--workers`` process served, or a restart, hands the conversation back to the
    rendezvous order that every replica computes alike, so replicas agree from the first
    turn any of them could not see (the same turn sent again keeps its home too). The
    homes are bounded (``HOMES``, oldest forgotten).
    """

    name = "cache-aware"
    uses_view = True
    uses_signals = True

    def __init__(self, balance_abs: float = 4, balance_rel: float = 1.5) -> None:
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._seeds: dict[str, int] = {}
        self._fallback = LoadAware()
        self._openings: dict[str, int] = {}  # recent opening turns per URL (halved as they grow)
        self._homes: dict[int, tuple[str, int]] = {}  # anchor -> (URL, mark) of the last turn routed
        self.spills = 0  # picks that passed over the preferred instance (for load, or an opening's count)

    def seed(self, url: str) -> int:
        seed = self._seeds.get(url)
        if seed is None:
            seed = self._seeds[url] = instance_seed(url)
        return seed

    def choose(self, candidates: list[Instance], view: RequestView = EMPTY_VIEW) -> Instance:
        if len(candidates) == 1:
            return candidates[0]
        key = view.anchor
        if not key:
            return self._fallback.choose(candidates)
        loads = [c.inflight + c.signals.others for c in candidates]
        reuse = view.reuse
        mark = view.mark
        if not reuse:
            inst = candidates[self._open(candidates, key, loads)]
        else:
            home = self._homes.get(key) if mark else None
            if home is not None and home[1] != view.previous and home[1] != mark:
                home = None  # another turn came between (not this proxy's): rendezvous, as any replica
            inst = candidates[self._pick(candidates, key, loads, reuse, home[0] if home is not None else None)]
        if mark:
            homes = self._homes
            homes.pop(key, None)  # re-inserted last: the dict's order is the turns' recency
            homes[key] = (inst.url, mark)
            if len(homes) > HOMES:
                del homes[next(iter(homes))]
        return inst

    def assign(self, candidates: list[Instance], items: Sequence[MediaItem]) -> list[Instance]:
        if len(candidates) == 1:
            return [candidates[0]] * len(items)
        loads = [c.inflight + c.signals.others for c in candidates]
        out = []
        seen: dict[str, int] = {}
        for item in items:
            i = seen.get(item.uuid)
            if i is None:  # the same item twice in one request is encoded once, on one encoder
                i = seen[item.uuid] = self._pick(candidates, key_of(item.uuid), loads)
                loads[i] += 1  # the request's own items count against each other
            out.append(candidates[i])
        return out

    def _pick(self, candidates: list[Instance], key: int, loads: list[float], reuse: float = 1.0,
              home: str | None = None) -> int:
        """The index of ``home`` if it is a candidate within the bound, else of the highest
        rendezvous score among those (``mix64`` inlined: this runs per candidate per
        request)."""
        low = min(loads)
        bound = low + reuse * max(self.balance_abs, low * (self.balance_rel - 1.0))
        seeds = self._seeds
        best = top = -1
        over = False
        for i, c in enumerate(candidates):
            if loads[i] <= bound:
                if c.url == home:
                    return i
                x = key ^ (seeds.get(c.url) or self.seed(c.url))
                x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & _M64
                x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & _M64
                x ^= x >> 33
                if x > top:
                    best, top = i, x
            else:
                over = True
        if over and any(mix64(key ^ self.seed(c.url)) > top
                        for i, c in enumerate(candidates) if loads[i] > bound):
            self.spills += 1  # the preferred instance was passed over for its load
        return best


    def _open(self, candidates: list[Instance], key: int, loads: list[float]) -> int:
        """The index for an opening turn: the preferred (rendezvous) candidate among the
        least-loaded ones whose recent openings are within the slack of the fewest.

        An instance new to the counts, or back after a while, is counted from twice the
        slack below the most: it catches up by at most one slack of openings, no flood."""
        counts = self._openings
        cs = [counts.get(c.url, 0) for c in candidates]
        top = max(cs)
        slack = max(OPEN_SLACK_MIN, OPEN_SLACK_REL * top)
        floor = top - 2 * slack
        low = min(loads)
        fewest = min(max(cs[i], floor) for i in range(len(candidates)) if loads[i] <= low)
        seeds = self._seeds
        best = -1
        top_score = first_score = -1
        for i, c in enumerate(candidates):
            x = key ^ (seeds.get(c.url) or self.seed(c.url))  # mix64, inlined as in _pick
            x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & _M64
            x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & _M64
            x ^= x >> 33
            if x > first_score:
                first_score = x
            if loads[i] <= low and max(cs[i], floor) <= fewest + slack and x > top_score:
                best, top_score = i, x
        if top_score < first_score:
            self.spills += 1
        url = candidates[best].url
        n = counts[url] = max(cs[best], int(floor)) + 1
        if n >= OPEN_WINDOW:  # keep the counts recent: halve them, and forget instances not here
            self._openings = {c.url: counts.get(c.url, 0) // 2 for c in candidates}
        return best


# Opening turns (``CacheAware._open``): the counts an instance's share may run ahead of the
# fewest, relative and at least; the counts are halved when one reaches the window, so they
# cover the last few hundred openings.
OPEN_SLACK_REL = 0.1
OPEN_SLACK_MIN = 4
OPEN_WINDOW = 512
# Conversations whose last turn's instance ``CacheAware`` keeps (about 130 bytes each, so
# under 10 MB when full, measured with tracemalloc).
HOMES = 65536


def rendezvous_order(urls: Sequence[str], key: int) -> list[str]:
    """The URLs in rendezvous order for ``key`` (what ``cache-aware`` tries first to last
    when every instance is within the load bound)."""
    return sorted(urls, key=lambda u: mix64(key ^ instance_seed(u)), reverse=True)


POLICIES: dict[str, type[RoutingPolicy]] = {
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    "load-aware": LoadAware,
    "power-of-two": PowerOfTwo,
    "cache-aware": CacheAware,
}


def make_policy(name: str, *, balance_abs: float = 4, balance_rel: float = 1.5) -> RoutingPolicy:
    """A policy by its name (``POLICIES``); ValueError names the known ones."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(POLICIES)})")
    if cls is CacheAware:
        return CacheAware(balance_abs, balance_rel)
    return cls()
