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

``queries`` and ``hits`` count tokens, as ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` do. Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict

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
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, tokens found cached

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def lookup(self, hashes: list[int], num_tokens: int) -> int:
        """Tokens of the longest cached prefix of a prompt of ``num_tokens`` tokens whose
        full blocks hash to ``hashes``; counts the query and its hits."""
        blocks = self._blocks
        limit = min(len(hashes), (num_tokens - 1) // self.block_size) if num_tokens > 0 else 0
        n = 0
        while n < limit and hashes[n] in blocks:
            n += 1
        cached = n * self.block_size
        self.queries += num_tokens
        self.hits += cached
        return cached

    def peek(self, hashes: list[int], num_tokens: int) -> int:
        """What :meth:`lookup` would find, without counting a query."""
        blocks = self._blocks
        limit = min(len(hashes), (num_tokens - 1) // self.block_size) if num_tokens > 0 else 0
        n = 0
        while n < limit and hashes[n] in blocks:
            n += 1
        return n * self.block_size

    def store(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """The prompt's blocks are computed: keep them (most recently used), evicting the
        least recently used beyond capacity. Returns the hashes newly stored and those
        evicted."""
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
        return stored, removed

    def clear(self) -> int:
        """Forget everything (the instance restarted); returns how many blocks it held."""
        n = len(self._blocks)
        self._blocks.clear()
        return n
