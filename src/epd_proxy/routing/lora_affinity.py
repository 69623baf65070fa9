"""Pure: where a LoRA adapter's requests go, so that instances do not thrash their adapter slots.

vLLM keeps ``--max-loras`` adapters active; a request for another one waits while it is
swapped in and pushes the least recently used one out. Spreading one adapter's requests over
every instance that has it (round-robin, least-loaded) makes each instance cycle through all
adapters. :class:`AdapterAffinity` concentrates them instead (llm-d's lora-affinity idea,
with this project's load bound, the one ``cache-aware`` uses):

* the candidates are the instances serving the adapter (the pool has filtered them);
* among those within the load bound (load at most ``min + max(balance_abs, min x
  (balance_rel - 1))``), an instance where the adapter is already active (running or waiting
  there, as its ``vllm:lora_requests_info`` said at the last scrape) comes first;
* then rendezvous order of the adapter's name: every proxy replica and ``--workers`` process
  ranks the instances alike, so the adapter has one home, and a second instance only takes
  its requests while the first is over the bound (the set grows with load, one by one, and
  shrinks back when the load goes).

The least-loaded candidate is always within the bound, so a pick always exists.
"""

from __future__ import annotations

from typing import Sequence

from epd_proxy.routing.policy import C
from epd_proxy.routing.view import instance_seed, mix64


def adapter_key(name: str) -> int:
    """The adapter's rendezvous key (stable across processes and replicas)."""
    return instance_seed("lora:" + name)


class AdapterAffinity:
    """Picks the instance for one adapter's request (see the module docstring)."""

    def __init__(self, balance_abs: float = 4, balance_rel: float = 1.5) -> None:
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._seeds: dict[str, int] = {}
        self._keys: dict[str, int] = {}
        self.spills = 0  # picks that passed over the adapter's first instance for its load

    def _seed(self, url: str) -> int:
        seed = self._seeds.get(url)
        if seed is None:
            seed = self._seeds[url] = instance_seed(url)
        return seed

    def key(self, name: str) -> int:
        key = self._keys.get(name)
        if key is None:
            if len(self._keys) >= KEYS:
                self._keys.clear()
            key = self._keys[name] = adapter_key(name)
        return key

    def choose(self, candidates: list[C], adapter: str) -> C:
        return candidates[self.pick(candidates, adapter)] if len(candidates) > 1 else candidates[0]

    def pick(self, candidates: Sequence[C], adapter: str) -> int:
        """The index of the instance for a request naming ``adapter``."""
        key = self.key(adapter)
        loads = [c.inflight + c.signals.others for c in candidates]
        low = min(loads)
        bound = low + max(self.balance_abs, low * (self.balance_rel - 1.0))
        best, best_rank = -1, (-1, -1)
        first, first_score = -1, -1
        for i, c in enumerate(candidates):
            score = mix64(key ^ self._seed(c.url))
            if score > first_score:
                first, first_score = i, score
            if loads[i] > bound:
                continue
            rank = (1 if adapter in c.signals.adapters else 0, score)
            if rank > best_rank:
                best, best_rank = i, rank
        if best != first and loads[first] > bound:
            self.spills += 1
        return best

    def order(self, urls: Sequence[str], adapter: str) -> list[str]:
        """The URLs in the adapter's rendezvous order (where it goes first, second, ...)."""
        key = self.key(adapter)
        return sorted(urls, key=lambda u: mix64(key ^ self._seed(u)), reverse=True)


# Adapter names whose keys are kept (a client may name anything; the cache must not grow with it).
KEYS = 65536
