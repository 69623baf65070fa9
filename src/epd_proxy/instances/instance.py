"""One upstream vLLM instance, with all its state: its spec, connections, health, load
signals, where it came from, since when it is out, and whether it is leaving.

The life of an instance, and who moves each edge::

    registered ──(membership: flag, API, cluster file, DNS, another worker)──▶ in the pool
        │  never yet healthy: probed at the fast interval (pool.py)
        ▼
    healthy ◀──(probe success / trial request succeeds: pool.py via health.py)── half-open
        │                                                                         ▲
        │ failures past the rules (health.py's outlier rules, fed by upstream.py) │ ejection time over
        ▼                                                                         │ (pool.py's timer)
    ejected ──────────────────────────────────────────────────────────────────────┘
        │ out longer than --evicted-ttl (membership.py's sweeper): forgotten
        ▼
    draining (membership.drain: admin API, a source that dropped it) ── no new requests
        │ in flight reaches 0
        ▼
    leaving (membership.unregister / forgotten: out of the routing lists, requests finish)
        │ in flight reaches 0 (membership.py's sweeper)
        ▼
    gone (connections closed; subscribers told ``left``)

States are ``health.py``'s named constants (``HEALTHY``, ``EJECTED``, ``HALF_OPEN``,
``DRAINING``); ``source``, ``out_since`` and ``leaving`` are membership's, kept here so
that one object says everything about one instance.
"""

from __future__ import annotations

import asyncio

from epd_proxy.config import InstanceSpec
from epd_proxy.http.client import ConnectionPool
from epd_proxy.instances.health import HEALTHY, Health
from epd_proxy.instances.load_signals import LoadSignals


class Instance:
    """One upstream vLLM instance: its connections and what we know of its state."""

    __slots__ = ("spec", "url", "role", "connections", "inflight", "health", "requests", "errors", "expiry",
                 "signals")

    def __init__(self, spec: InstanceSpec, connections: ConnectionPool) -> None:
        self.spec = spec
        self.url = spec.url
        self.role = spec.role
        self.connections = connections  # its keep-alive connections (http/client.py)
        self.inflight = 0
        self.health = Health()
        self.requests = 0
        self.errors = 0  # every failure seen (by kind in health.errors)
        self.expiry: asyncio.TimerHandle | None = None  # the end of an ejection
        self.signals = LoadSignals()  # its own load, from its /metrics (load_signals.py)

    @property
    def healthy(self) -> bool:
        """In full rotation."""
        return self.health.state is HEALTHY

    @property
    def state(self) -> str:
        return self.health.state

    @property
    def failures(self) -> int:
        return self.health.failures

    def __repr__(self) -> str:
        return f"<Instance {self.role} {self.url} inflight={self.inflight} {self.health.state}>"
