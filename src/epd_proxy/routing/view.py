"""The request's view: what a policy may know of a request, computed once, on first use.

The conversation *anchor* (a hash of the prompt's beginning: the same for every turn of
one conversation), the media items' uuids, the *history share* that earlier turns left in
a cache, and the prompt's *mark* (its shape) with that of the turn before it. Pure: built
over the already-parsed body, no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import zlib
from array import array
from typing import TYPE_CHECKING, Sequence

import msgspec

from epd_proxy.encode.multimodal import EMBEDS_TYPES

if TYPE_CHECKING:  # pragma: no cover - typing only
    from epd_proxy.encode.multimodal import MediaItem

M64 = (1 << 64) - 1
# The anchor hashes at most this many characters of a chat's first turns and of a
# completions prompt (token-id prompts: ids): enough to tell conversations apart,
# bounded so a 100 KB first message costs no more than a short one.
CHAT_ANCHOR_CHARS = 4096
PROMPT_ANCHOR_CHARS = 1024
PROMPT_ANCHOR_IDS = 256

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
    x &= M64
    x = ((x ^ (x >> 33)) * 0xFF51AFD7ED558CCD) & M64
    x = ((x ^ (x >> 33)) * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


def key_of(text: str) -> int:
    """The routing key of a string (an item uuid)."""
    return mix64(zlib.crc32(text.encode("utf-8", "surrogatepass")) | (len(text) << 32))


def instance_seed(url: str) -> int:
    """An instance's rendezvous seed: from its URL only, so replicas configured with the
    same URLs agree."""
    return int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "big")


class RequestView(msgspec.Struct, eq=False):
    """What a policy may know of a request: its routing keys, nothing else. Built by the
    pipeline over the parsed body (chat: after ``collect_media`` validated it).

    Each key is computed on first use, once: a request that meets no policy reading it
    (one instance, or a key-blind policy) costs one small object.

    ``anchor``: 0 when the request has none (then cache-aware falls back to load).
    ``items``: the media items' uuids, in the request's global order.
    ``reuse``: the share of the conversation that earlier turns left in a cache (0..1).
    ``mark`` / ``previous``: the prompt's shape, and that of the turn before it (see
    :attr:`mark`).
    ``held``: with KV events, the prompt tokens each instance holds (by URL, from the block
    index: ``placement/kv_lookup.py``), over ``live``, the instances the index speaks for;
    ``tokens`` the prompt's length in tokens. None without (approximate routing).
    ``recalled``: with a shared state store, the instances another replica sent the turn
    before this one to (``placement/shared_homes.py``).

    Made as ``RequestView(body, media, chat)`` (or :func:`anchored_view`); a ``msgspec.Struct``:
    built in C, without the ``__init__`` frame a class pays on every request.
    """

    _body: dict | None = None
    _media: Sequence[MediaItem] = ()
    chat: bool = True  # a chat's messages (else a completions prompt)
    _anchor: int | None = None  # computed on first use (0 without a body: see anchored_view)
    _items: list[str] | None = None
    _reuse: float | None = None
    _mark: int = 0
    _previous: int = 0
    held: dict[str, int] | None = None
    live: frozenset[str] = frozenset()
    tokens: int = 0
    kv_keys: list[int] = []  # the prompt's block keys (the speculative entries of the choice)
    # Where another replica sent the turn before this one, read from the shared state store
    # (placement/shared_homes.py): None until looked up.
    recalled: tuple[str, ...] | None = None

    def exact(self, urls) -> bool:
        """Whether the block index speaks for every one of ``urls`` (then ``held`` is exact)."""
        return self.held is not None and all(u in self.live for u in urls)

    @property
    def anchor(self) -> int:
        anchor = self._anchor
        if anchor is None:
            body = self._body
            if body is None:  # no request to compute it from (EMPTY_VIEW): none
                return 0
            try:
                anchor = (_chat_anchor(body.get("messages"), self.items) if self.chat
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
                if self.chat and self._body:
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



EMPTY_VIEW = RequestView()


def anchored_view(anchor: int) -> RequestView:
    """A request known only by its anchor (no body: all history, the full slack)."""
    return RequestView(_anchor=anchor)


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
