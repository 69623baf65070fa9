"""Pure: where a LoRA adapter's requests go, so that instances do not thrash their adapter slots.

vLLM keeps ``--max-loras`` adapters active; a request for another one waits while it is
swapped in and pushes the least recently used one out. Spreading one adapter's requests over
every instance that has it (round-robin, least-loaded) makes each instance cycle through all
adapters. :class:`AdapterAffinity` concentrates them instead (llm-d's lora-affinity idea,
with this project's load bound, the one ``cache-aware`` uses):

* the candidates are the instances serving the adapter (the pool has filtered them);
* its home (:func:`assign_homes`) is the first instance in the rendezvous order of the
  adapter's name that has fewer than its share of homes (the adapters over the instances,
  rounded up): rendezvous alone gives one instance 6 of 8 adapters as easily as 4, and those
  6 then thrash its slots. The homes follow from the instances' URLs and the adapters they
  serve alone, so every proxy replica and ``--workers`` process agrees on them. The home
  takes the request while its load is within the bound (at most ``min + max(balance_abs,
  min x (balance_rel - 1))``); a home that is not a candidate (out of rotation) is replaced by
  the first candidate in the adapter's order;
* past the bound, among the candidates within it, an instance where the adapter is already
  active (running or waiting there, as its ``vllm:lora_requests_info`` said at the last
  scrape) comes first, then the rendezvous order: the set grows with load, one instance at a
  time, and shrinks back to the home when the load goes.

Activity decides only past the bound: preferring it always feeds on itself (an instance that
queues while it swaps shows many adapters running, draws more adapters, and swaps more).

The least-loaded candidate is always within the bound, so a pick always exists.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from epd_proxy.routing.candidate import C
from epd_proxy.routing.view import instance_seed, mix64


def adapter_key(name: str) -> int:
    """The adapter's rendezvous key (stable across processes and replicas)."""
    return instance_seed("lora:" + name)


def assign_homes(serving: Mapping[str, Iterable[str]], seed=instance_seed) -> dict[str, str]:
    """Pure: each adapter's home among the URLs serving it (``serving``: adapter -> URLs). In the
    order of the adapters' keys, each takes the first URL in its rendezvous order with fewer
    than ``ceil(adapters / URLs)`` homes, else the one with the fewest (first in its order)."""
    urls = {u for us in serving.values() for u in us}
    if not urls:
        return {}
    cap = -(-len(serving) // len(urls))
    count = dict.fromkeys(urls, 0)
    seeds = {u: seed(u) for u in urls}
    homes: dict[str, str] = {}
    for key, name in sorted((adapter_key(n), n) for n in serving):
        order = sorted(serving[name], key=lambda u: mix64(key ^ seeds[u]), reverse=True)
        if not order:
            continue
        home = next((u for u in order if count[u] < cap), None)
        if home is None:
            home = min(order, key=count.__getitem__)  # min keeps the first of equals: the order's
        count[home] += 1
        homes[name] = home
    return homes


class AdapterAffinity:
    """Picks the instance for one adapter's request (see the module docstring)."""

    def __init__(self, balance_abs: float = 4, balance_rel: float = 1.5) -> None:
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._seeds: dict[str, int] = {}
        self._keys: dict[str, int] = {}
        self.spills = 0  # picks that passed over the adapter's first instance for its load
        self.homes: dict[str, str] = {}  # adapter -> URL (rehome); without one, rendezvous's first

    def rehome(self, serving: Mapping[str, Iterable[str]]) -> None:
        """The adapters the instances serve changed (``serving``: adapter -> URLs): their homes again."""
        self.homes = assign_homes(serving, self._seed)

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
        scores = [mix64(key ^ self._seed(c.url)) for c in candidates]
        url = self.homes.get(adapter)
        home = next((i for i, c in enumerate(candidates) if c.url == url), -1) if url is not None else -1
        if home < 0:
            home = max(range(len(candidates)), key=scores.__getitem__)
        if loads[home] <= bound:
            return home
        self.spills += 1
        best, best_rank = -1, (-1, -1)
        for i, c in enumerate(candidates):
            if loads[i] <= bound:
                rank = (1 if adapter in c.signals.adapters else 0, scores[i])
                if rank > best_rank:
                    best, best_rank = i, rank
        return best

    def order(self, urls: Sequence[str], adapter: str) -> list[str]:
        """The URLs in the adapter's rendezvous order (where it goes first, second, ...)."""
        key = self.key(adapter)
        return sorted(urls, key=lambda u: mix64(key ^ self._seed(u)), reverse=True)


# Adapter names whose keys are kept (a client may name anything; the cache must not grow with it).
KEYS = 65536
