"""Where a conversation's turns went, shared between replicas through the state store.

``cache-aware`` keeps a conversation on the instance its previous turn went to, when this
proxy routed that turn; a turn another replica routed goes by the rendezvous order, which
every replica computes alike. The two disagree when a replica placed a turn off that order:
an opening on the least-loaded instance (to keep the instances level), a turn spilled for
load. With a state store (``--state-store``, or the parent's with ``--workers``), each such
placement is written under the conversation's anchor and the turn's mark, and a replica
routing a turn whose previous turn it did not see reads it back first: one read of the
store for such turns only (a conversation that stays on one replica, an opening, a request
the block index speaks for: none), one write per placement off the rendezvous order, in the
background. A store that is down costs nothing but the agreement (``state/guard.py``).
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING

from epd_proxy.routing.cache_aware import CacheAware

if TYPE_CHECKING:  # pragma: no cover - typing only
    from epd_proxy.instances.pool import InstancePool
    from epd_proxy.routing.view import RequestView
    from epd_proxy.state.guard import GuardedStore

# How long a placement is kept in the store: longer than a conversation's pause between
# turns that an instance's prefix cache outlives.
HOME_TTL = 900.0
# Writes in flight at most; past it a placement is not shared (counted in ``dropped``).
MAX_WRITES = 256


class SharedHomes:
    """The shell between ``cache-aware``'s homes and the shared store, for every pool whose
    policy is ``cache-aware``. Counters: ``recalls`` (turns looked up), ``found`` (a
    placement found), ``published`` (placements written), ``dropped`` (not written: too
    many writes in flight)."""

    def __init__(self, store: GuardedStore, pools: dict[str, InstancePool]) -> None:
        self.store = store
        self._pools: list[tuple[bytes, InstancePool, CacheAware]] = []
        for role, pool in pools.items():
            policy = pool.policy
            if isinstance(policy, CacheAware):
                policy.learned = functools.partial(self._publish, role.encode())
                self._pools.append((role.encode(), pool, policy))
        self._writes: set[asyncio.Task] = set()
        self.recalls = self.found = self.published = self.dropped = 0

    async def recall(self, view: RequestView) -> None:
        """``view.recalled``: where another replica sent the turn before this one, for the
        pools that do not know (once per request: a retry keeps the answer)."""
        if view.recalled is not None:
            return
        view.recalled = ()
        keys = [self._key(role, view.anchor, view.previous) for role, pool, policy in self._pools
                if len(pool.instances) > 1 and policy.unknown_home(view)]
        if not keys:
            return
        self.recalls += 1
        found = tuple(v.decode() for v in await self.store.get_many(keys) if v)
        if found:
            self.found += 1
            view.recalled = found

    def _publish(self, role: bytes, anchor: int, mark: int, url: str) -> None:
        if len(self._writes) >= MAX_WRITES:
            self.dropped += 1
            return
        self.published += 1
        task = asyncio.get_running_loop().create_task(
            self.store.put(self._key(role, anchor, mark), url.encode(), HOME_TTL))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def _key(self, role: bytes, anchor: int, mark: int) -> bytes:
        return self.store.key(b"home-" + role, anchor.to_bytes(16, "big") + mark.to_bytes(16, "big"))

    def collect(self, f: dict[str, list]) -> None:
        """What ``/metrics`` shows: ``epd_proxy_shared_homes_total`` by event."""
        f["epd_proxy_shared_homes"] += [["published", self.published], ["dropped", self.dropped],
                                        ["recalled", self.recalls], ["found", self.found]]


def shared_homes(store: GuardedStore | None, pools: dict[str, InstancePool]) -> SharedHomes | None:
    """The shell when there is a store and a ``cache-aware`` pool, else None (nothing paid)."""
    if store is None or not any(isinstance(p.policy, CacheAware) for p in pools.values()):
        return None
    return SharedHomes(store, pools)

