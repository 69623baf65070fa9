"""An encoder instance's own cache of encoder outputs, keyed by the item's hash.

vLLM keeps encoder outputs by the item's multimodal hash (its ``uuid``, or a
hash of its content) and reuses them when the same item comes again, so an
encoder that sees an image twice encodes it once. The simulator's encoders do
the same: a hit costs nothing, a miss costs the encoding time, and the cache
holds at most ``capacity`` tokens of outputs, least recently used out first.

This is not the cluster's :class:`~epd_proxy.sim.ec_store.EcStore` (the
hand-off store that EC consumers read), only the encoder's memory of what it
already computed. Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCache:
    """Item hash -> output size in tokens, in LRU order; ``queries`` and ``hits`` count items."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self._items: OrderedDict[str, int] = OrderedDict()
        self._tokens = 0
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    @property
    def tokens(self) -> int:
        return self._tokens

    def lookup(self, key: str, tokens: int) -> bool:
        """Whether the item is cached (then it becomes the most recent); a miss stores it,
        evicting the least recently used items beyond capacity. An item larger than the
        whole cache is never kept."""
        items = self._items
        self.queries += 1
        if key in items:
            items.move_to_end(key)
            self.hits += 1
            return True
        if tokens > self.capacity:
            return False
        items[key] = tokens
        self._tokens += tokens
        while self._tokens > self.capacity:
            _, size = items.popitem(last=False)
            self._tokens -= size
        return False

    def clear(self) -> None:
        self._items.clear()
        self._tokens = 0
