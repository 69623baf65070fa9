"""A prefix cache like vLLM's automatic prefix caching, for one simulated instance.

vLLM keeps the KV of computed prompts in fixed-size blocks and finds a new
prompt's longest cached prefix by hashing its full blocks, each hash chained
to its parent's, so a block matches only when everything before it matched
too. This module does the same over the simulator's token ids:

* a prompt's full blocks are hashed as ``hash((parent_hash, block_tokens))``
  (a last, partial block is never cached);
* a lookup walks the chain from the first block and stops at the first miss;
  like vLLM it leaves at least one token to compute (a full hit on an exact
  block boundary recomputes the last block);
* a computed prompt's blocks are stored, and beyond ``capacity`` blocks the
  least recently used go first. A prompt's blocks are touched tail first, so
  the end of a chain is evicted before its beginning, as vLLM frees a
  request's blocks in reverse order.

Blocks held for another instance (a decode's kept blocks, bidirectional transfer) are
*pinned*: they stay findable whatever the LRU does, as vLLM finds a prefix in blocks a
request still holds.

``queries`` and ``hits`` count tokens, as ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` do. Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

# The parent of a prompt's first block (vLLM seeds the chain with a fixed value too).
ROOT_HASH = 0


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids``."""
    out: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        out.append(parent)
    return out


class PrefixCache:
    """Cached block hashes in LRU order, with vLLM's token counters."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._pinned: dict[int, int] = {}  # block hash -> how many holders pin it
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, tokens found cached
        # Told of each store (token ids, hashes, stored, evicted, adapter): the KV events' publisher.
        self.listener: Callable[[list[int], list[int], list[int], list[int], str | None], None] | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def lookup(self, hashes: list[int], num_tokens: int) -> int:
        """Tokens of the longest cached prefix of a prompt of ``num_tokens`` tokens whose
        full blocks hash to ``hashes``; counts the query and its hits."""
        cached = self.peek(hashes, num_tokens)
        self.queries += num_tokens
        self.hits += cached
        return cached

    def peek(self, hashes: list[int], num_tokens: int) -> int:
        """What :meth:`lookup` would find, without counting a query."""
        blocks, pinned = self._blocks, self._pinned
        limit = min(len(hashes), (num_tokens - 1) // self.block_size) if num_tokens > 0 else 0
        n = 0
        while n < limit and (hashes[n] in blocks or hashes[n] in pinned):
            n += 1
        return n * self.block_size

    @property
    def pinned_blocks(self) -> int:
        """Distinct blocks pinned (held for another instance)."""
        return len(self._pinned)

    def pin(self, hashes: list[int]) -> None:
        """Keep these blocks findable until :meth:`unpin` (held for another instance)."""
        pinned = self._pinned
        for h in hashes:
            pinned[h] = pinned.get(h, 0) + 1

    def unpin(self, hashes: list[int]) -> None:
        pinned = self._pinned
        for h in hashes:
            n = pinned.get(h, 0) - 1
            if n > 0:
                pinned[h] = n
            else:
                pinned.pop(h, None)

    def store(self, hashes: list[int], token_ids: list[int] | None = None,
              adapter: str | None = None) -> tuple[list[int], list[int]]:
        """The prompt's blocks (over ``token_ids``) are computed: keep them (most recently
        used), evicting the least recently used beyond capacity. Returns the hashes newly
        stored and those evicted; the listener hears of both."""
        blocks = self._blocks
        stored: list[int] = []
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                stored.append(h)
        stored.reverse()
        removed: list[int] = []
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            removed.append(h)
        if self.listener is not None and token_ids is not None and (stored or removed):
            self.listener(token_ids, hashes, stored, removed, adapter)
        return stored, removed

    def clear(self) -> int:
        """Forget everything (the instance restarted); returns how many blocks it held."""
        n = len(self._blocks)
        self._blocks.clear()
        self._pinned.clear()
        return n
