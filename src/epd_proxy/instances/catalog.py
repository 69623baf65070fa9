"""The cluster's models: one :class:`~epd_proxy.instances.models.Catalog` over every pool's
live instances, rebuilt when an instance's models or a pool's states change (the pools
say so), so a request reads a ready answer (``current``) and never walks the roster."""

from __future__ import annotations

from typing import Protocol, Sequence

from epd_proxy.instances.health import DRAINING
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import NOTHING_KNOWN, Catalog, catalog_of


class Members(Protocol):
    """A pool, as far as the catalog reads it."""

    @property
    def instances(self) -> Sequence[Instance]: ...


class ModelDirectory:
    """What the pools serve together. A draining instance serves nothing new, so its models
    leave the catalog with it; an ejected one still counts (it may come back, and panic
    routing may need it)."""

    def __init__(self) -> None:
        self._pools: list[Members] = []
        self.current: Catalog = NOTHING_KNOWN

    def track(self, pool: Members) -> None:
        """A pool whose instances count (it calls ``changed`` on every change)."""
        self._pools.append(pool)
        self.changed()

    def changed(self) -> None:
        self.current = catalog_of(inst.served for pool in self._pools for inst in pool.instances
                                  if inst.health.state is not DRAINING)
