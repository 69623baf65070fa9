"""The block index: which instance holds which KV blocks, keyed on the blocks' tokens.

Every block an instance announces (``BlockStored``) is keyed by what it is: a chained hash
of its token ids and its parent's key, computed here, rooted in the adapter's name. The
engine's own block hashes depend on its hash algorithm and on ``PYTHONHASHSEED``; these
keys depend on neither (a tuple of ints hashes the same in every process), so two
instances holding the same prefix hold the same keys. A request's prompt is looked up
by computing the same keys over its token ids: the longest chain of keys an instance
holds is its cached prefix.

Per instance (a *source*: one event stream, so one data-parallel rank) the index keeps
the engine's hash of each block and its key, in the order stored: ``BlockRemoved``
names blocks by the engine's hash, and the order is the index's own LRU. The holders of
a key are a bit mask of source slots, so a block held by sixteen instances costs one
entry. Memory is bounded: past ``max_blocks`` (instance, block) pairs, the oldest blocks
of the source holding the most are forgotten first (``evicted``).

After a routing decision, the blocks the chosen instance is about to compute count as
held for ``speculative_ttl`` seconds (:meth:`speculate`): a burst of requests with one
prefix goes where the first went, before its events arrive. These entries are this
process's own; the stored ones are what every replica reads from the same events.

Blocks stored with extra keys beyond the adapter (media, a cache salt) are keyed with
them too: a text-only lookup never matches them, so media keep approximate routing.
Only the first KV cache group is indexed (``group_idx`` 0: hybrid models announce each
group; one tells the prefix).

Pure: no I/O; the clock is passed in.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

# Default bound on (instance, block) pairs: about 240 MB when full (243 bytes a pair, measured
# at 16 x 100,000 blocks: docs/benchmarks.md, "KV block index").
MAX_BLOCKS = 1_000_000
# How long a routing decision's blocks count as held on its instance, unconfirmed.
SPECULATIVE_TTL = 2.0
# Speculative keys kept at most (oldest first out).
MAX_SPECULATIVE = 65_536


def adapter_root(adapter: str | None) -> int:
    """The parent key of a prompt's first block: per adapter (a block computed under a
    LoRA adapter is not the base model's), the same in every process."""
    if not adapter:
        return 0
    return zlib.crc32(adapter.encode("utf-8", "surrogatepass")) | (1 << 40)


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """The key of one block: its tokens chained to its parent's key. The one rule: a prompt's
    keys (:func:`prompt_keys`) and an event's (:meth:`BlockIndex.stored`) must come out alike."""
    return hash((parent, *tokens))


def prompt_keys(token_ids: Sequence[int], block_size: int, adapter: str | None = None,
                limit: int | None = None) -> list[int]:
    """The keys of a prompt's full blocks (at most ``limit`` of them)."""
    keys: list[int] = []
    parent = adapter_root(adapter)
    end = len(token_ids) - block_size + 1
    if limit is not None:
        end = min(end, limit * block_size)
    key = block_key
    for start in range(0, end, block_size):
        parent = key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


@dataclass(slots=True)
class Source:
    """One event stream's blocks: engine hash -> key, oldest stored first."""

    name: str
    slot: int
    blocks: OrderedDict = field(default_factory=OrderedDict)
    block_sizes: set = field(default_factory=set)
    stored: int = 0  # BlockStored blocks applied (repeats included)
    removed: int = 0  # blocks removed by the engine
    orphans: int = 0  # blocks whose parent this index did not know (not indexed)
    cleared: int = 0  # AllBlocksCleared, restarts and resets


class BlockIndex:
    """Every source's blocks by key; :meth:`longest_prefix` per request."""

    def __init__(self, max_blocks: int = MAX_BLOCKS, speculative_ttl: float = SPECULATIVE_TTL,
                 max_speculative: int = MAX_SPECULATIVE) -> None:
        self.max_blocks = max_blocks
        self.speculative_ttl = speculative_ttl
        self.max_speculative = max_speculative
        self._holders: dict[int, int] = {}  # key -> bit mask of source slots
        self._sources: dict[str, Source] = {}
        self._by_slot: dict[int, Source] = {}
        self._free: list[int] = []
        self._next_slot = 0
        self._pairs = 0  # (source, block) pairs held
        self._spec: dict[int, dict[int, float]] = {}  # key -> {slot: expiry}
        self._spec_order: deque[tuple[float, int]] = deque()
        self.evicted = 0  # pairs forgotten for the bound
        self.lookups = 0

    # -- sources -------------------------------------------------------------------------
    def source(self, name: str) -> Source:
        """The source ``name``, added if new."""
        src = self._sources.get(name)
        if src is None:
            slot = self._free.pop() if self._free else self._next_slot
            if slot == self._next_slot:
                self._next_slot += 1
            src = self._sources[name] = self._by_slot[slot] = Source(name, slot)
        return src

    def sources(self) -> list[Source]:
        return list(self._sources.values())

    def drop(self, name: str) -> None:
        """Forget a source (its instance left the roster); its slot is reused."""
        src = self._sources.pop(name, None)
        if src is None:
            return
        self._clear(src)
        del self._by_slot[src.slot]
        for holders in self._spec.values():
            holders.pop(src.slot, None)
        self._free.append(src.slot)

    def clear(self, name: str) -> None:
        """Forget what a source holds (``AllBlocksCleared``, an engine restart, events lost)."""
        src = self._sources.get(name)
        if src is not None:
            self._clear(src)
            src.cleared += 1

    def _clear(self, src: Source) -> None:
        mask = ~(1 << src.slot)
        holders = self._holders
        for key in src.blocks.values():
            h = holders.get(key, 0) & mask
            if h:
                holders[key] = h
            else:
                holders.pop(key, None)
        self._pairs -= len(src.blocks)
        src.blocks.clear()

    # -- events --------------------------------------------------------------------------
    def stored(self, name: str, block_hashes: Sequence[Hashable], parent: Hashable | None,
               token_ids: Sequence[int], block_size: int, adapter: str | None = None,
               extra_keys: Sequence | None = None) -> int:
        """A ``BlockStored`` event: the blocks' keys chained from ``parent`` (the engine's
        hash of the block before the first, None for a prompt's first block). Storing a
        block again only refreshes it. Returns the blocks indexed."""
        src = self.source(name)
        blocks = src.blocks
        if parent is None:
            key = adapter_root(adapter)
        else:
            known = blocks.get(parent)
            if known is None:  # a parent this index never saw or forgot: the chain cannot be keyed
                src.orphans += len(block_hashes)
                return 0
            key = known
            blocks.move_to_end(parent)
        src.block_sizes.add(block_size)
        bit = 1 << src.slot
        holders = self._holders
        n = 0
        for i, engine_hash in enumerate(block_hashes):
            tokens = token_ids[i * block_size:(i + 1) * block_size]
            if len(tokens) < block_size:
                break
            key = block_key(key, tokens)
            extra = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
            if extra is not None:
                extra = _beyond_adapter(extra, adapter)
                if extra:
                    key = hash((key, zlib.crc32(repr(extra).encode("utf-8", "surrogatepass"))))
            old = blocks.get(engine_hash)
            if old is None:
                self._pairs += 1
            elif old != key:  # the same engine hash with other tokens: the engine restarted unseen
                self._unhold(old, bit)
            blocks[engine_hash] = key
            blocks.move_to_end(engine_hash)
            holders[key] = holders.get(key, 0) | bit
            n += 1
        src.stored += n
        if self._pairs > self.max_blocks:
            self._evict()
        return n

    def removed(self, name: str, block_hashes: Iterable[Hashable]) -> None:
        """A ``BlockRemoved`` event: blocks named by the engine's hash."""
        src = self._sources.get(name)
        if src is None:
            return
        blocks = src.blocks
        bit = 1 << src.slot
        for engine_hash in block_hashes:
            key = blocks.pop(engine_hash, None)
            if key is not None:
                self._pairs -= 1
                src.removed += 1
                self._unhold(key, bit)

    def _unhold(self, key: int, bit: int) -> None:
        h = self._holders.get(key, 0) & ~bit
        if h:
            self._holders[key] = h
        else:
            self._holders.pop(key, None)

    def _evict(self) -> None:
        """Past the bound: the oldest blocks of the largest source go first."""
        excess = self._pairs - self.max_blocks
        while excess > 0:
            src = max(self._sources.values(), key=lambda s: len(s.blocks))
            bit = 1 << src.slot
            blocks = src.blocks
            n = min(excess, max(1, len(blocks) // 64))
            for _ in range(n):
                _, key = blocks.popitem(last=False)
                self._unhold(key, bit)
            self._pairs -= n
            self.evicted += n
            excess -= n

    # -- speculation -----------------------------------------------------------------------
    def speculate(self, name: str, keys: Sequence[int], now: float) -> None:
        """A routing decision sent a prompt with these block keys to ``name``: count them
        as held there until ``now + speculative_ttl`` (or until its events say so)."""
        if not keys or self.speculative_ttl <= 0:
            return
        slot = self.source(name).slot
        expiry = now + self.speculative_ttl
        spec, order = self._spec, self._spec_order
        for key in keys:
            holders = spec.get(key)
            if holders is None:
                holders = spec[key] = {}
            holders[slot] = expiry
            order.append((expiry, key))
        self._expire(now)

    def _expire(self, now: float) -> None:
        spec, order = self._spec, self._spec_order
        while order and (order[0][0] <= now or len(order) > self.max_speculative):
            expiry, key = order.popleft()
            holders = spec.get(key)
            if holders is None:
                continue
            for slot, t in list(holders.items()):
                if t <= expiry:
                    del holders[slot]
            if not holders:
                del spec[key]

    # -- lookups ---------------------------------------------------------------------------
    def block_sizes(self) -> set[int]:
        sizes: set[int] = set()
        for src in self._sources.values():
            sizes |= src.block_sizes
        return sizes

    def longest_prefix(self, token_ids: Sequence[int], adapter: str | None = None, now: float | None = None,
                       keys: dict[int, list[int]] | None = None) -> dict[str, int]:
        """Per source holding the prompt's first block, the tokens of the longest prefix of
        ``token_ids`` it holds (speculative entries count while ``now`` is before their
        expiry). ``keys``, if given, receives the prompt's block keys per block size (for
        :meth:`speculate`)."""
        self.lookups += 1
        out: dict[str, int] = {}
        holders_of = self._holders
        spec = self._spec if now is not None else None
        if spec:
            self._expire(now)  # type: ignore[arg-type]
        for size in self.block_sizes():
            chain = prompt_keys(token_ids, size, adapter)
            if keys is not None:
                keys[size] = chain
            alive = -1  # every slot
            for i, key in enumerate(chain):
                held = holders_of.get(key, 0)
                if spec:
                    extra = spec.get(key)
                    if extra:
                        for slot in extra:
                            held |= 1 << slot
                left = alive & ~held if alive != -1 else 0
                alive = alive & held
                if left:
                    self._credit(out, left, i * size)
                if not alive:
                    break
            else:
                if alive and alive != -1:
                    self._credit(out, alive, len(chain) * size)
        return out

    def _credit(self, out: dict[str, int], mask: int, tokens: int) -> None:
        if not tokens:
            return
        by_slot = self._by_slot
        while mask:
            low = mask & -mask
            src = by_slot.get(low.bit_length() - 1)
            if src is not None and out.get(src.name, 0) < tokens:
                out[src.name] = tokens
            mask ^= low

    # -- what it holds ----------------------------------------------------------------------
    def __len__(self) -> int:
        """(source, block) pairs held."""
        return self._pairs

    @property
    def keys(self) -> int:
        """Distinct blocks held by any source."""
        return len(self._holders)

    def blocks_of(self, name: str) -> int:
        src = self._sources.get(name)
        return 0 if src is None else len(src.blocks)


def _beyond_adapter(extra: Sequence, adapter: str | None) -> tuple:
    """A block's extra keys without the adapter's name (which the root already carries)."""
    items = list(extra)
    if adapter and items and items[0] == adapter:
        items = items[1:]
    return tuple(items)
