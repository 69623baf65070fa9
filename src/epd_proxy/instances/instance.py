"""One upstream vLLM instance, with all its state: its spec, connections, health, load
signals, what it serves (``served``), where it came from (``source``), since when it is out
(``out_since``), and whether it is leaving.

The life of an instance::

                   ┌────────────────(4)─────────────────┐
                   │  ┌──────(3)──────┐                 │
                   ▼  ▼               │                 │
    registered ──▶ HEALTHY ──(1)──▶ EJECTED ──(2)──▶ HALF_OPEN
                                      ▲                 │
                                      └───────(5)───────┘

    HEALTHY, EJECTED, HALF_OPEN ──(6)──▶ DRAINING ──(7)──▶ LEAVING ──(10)──▶ gone
    any of the four above ────────(8)────────────────────▶ LEAVING
    EJECTED, HALF_OPEN (out) ─────(9)────────────────────▶ LEAVING

Who moves each edge:

- registered: ``InstancePool(specs)`` for the flags (``Membership`` sets their ``source``
  to ``static``), else ``Membership.register`` → ``InstancePool.add`` (the API, through
  ``api/admin.py``; a reloaded cluster file and DNS, through ``Membership.apply``; another
  worker, through ``shared.py``). It starts ``HEALTHY`` but not ``seen_healthy``: ``probes.py``
  probes it at the fast interval until a probe answers.
- (1) failures past ``health.py``'s outlier rules (``instance_failure``,
  ``request_failure``), fed by the probes (``probes.py``) and the requests' ``record_*``
  (called from ``request/legs/upstream.py``) through ``outliers.py``, which arms the
  re-admission timer (``expiry``).
- (2) the ejection time is over: ``outliers.py``'s timer (``OutlierRules.expire``).
- (3) a probe or request success, when probes caused or confirmed the ejection
  (``OutlierRules.success``, through ``outliers.py``).
- (4) the first success: a request (``placement/choose.py`` gives it one pick in ``HALF_OPEN_SHARE``)
  or a probe, but only a request when request failures caused the ejection
  (``OutlierRules.success``, through ``outliers.py``).
- (5) the first failure: out again, for longer (the outlier rules, through ``outliers.py``).
- (6) ``Membership.drain`` → ``OutlierDetector.drain`` (``OutlierRules.drain``): the admin
  API, a source whose set no longer has it (``Membership.apply``), another worker. No
  rule moves it out of ``DRAINING``; it gets no new requests, not even in panic routing.
- (7) in flight reaches 0: ``Membership.sweep`` (removal reason ``drained``).
- (8) ``Membership.unregister`` (reason ``unregistered``): the admin API, another worker,
  ``Membership.apply`` on a role change or when a source adds back one it was draining.
- (9) out since ``out_since`` for ``--evicted-ttl`` (sources in ``PINNED_SOURCES``
  never): ``Membership.sweep`` (reason ``forgotten``). A re-announcement restarts the clock.
- (7), (8), (9) take it out of the pool and its routing lists (``InstancePool.remove``,
  which stops its probes and its ejection timer: ``OutlierDetector.forget``); ``Membership`` sets ``leaving`` and
  keeps it until (10). Requests holding it carry on.
- (10) in flight reaches 0: ``Membership.sweep`` closes its connections and tells the
  subscribers ``left``.

``HEALTHY``, ``EJECTED``, ``HALF_OPEN`` and ``DRAINING`` are ``health.py``'s states (the
``state`` below); ``LEAVING`` is the roster's, after them, and ``leaving`` says it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from epd_proxy.config import InstanceSpec
from epd_proxy.http.client import ConnectionPool
from epd_proxy.instances.health import HEALTHY, Health
from epd_proxy.instances.load_signals import LoadSignals
from epd_proxy.instances.models import Served, pinned

# Out of the pool, its requests in flight finishing; the roster's state after health's four.
LEAVING = "leaving"


class Instance:
    """One upstream vLLM instance: its connections and what we know of its state."""

    __slots__ = ("spec", "url", "role", "connections", "inflight", "backlog", "health", "requests", "errors", "expiry",
                 "signals", "source", "out_since", "leaving", "stranded", "served", "detector")

    def __init__(self, spec: InstanceSpec, connections: ConnectionPool) -> None:
        self.spec = spec
        self.url = spec.url
        self.role = spec.role
        self.connections = connections  # its keep-alive connections (http/client.py)
        self.inflight = 0
        # Prompt tokens this proxy's requests in flight on it still compute, by the block index
        # (placement/kv_lookup.py): the queue ahead of the next prompt, in the unit its cost is.
        self.backlog = 0
        self.health = Health()
        self.requests = 0
        self.errors = 0  # every failure seen (by kind in health.errors)
        # A prefill's answers whose KV no decode took (pull: the decode leg failed after it):
        # blocks held on it until vLLM's lease on them runs out (docs/protocol.md §3.3).
        self.stranded = 0
        self.expiry: asyncio.TimerHandle | None = None  # the end of an ejection
        self.signals = LoadSignals()  # its own load, from its /metrics (load_signals.py)
        # What it serves (models.py): its /v1/models read after each probe (served_models.py), within its
        # ``models`` attribute; None until known (it counts as serving any model meanwhile).
        self.served: Served | None = pinned(spec.models) if spec.models else None
        # The roster's (membership.py): who put it there, since when it is out of rotation
        # (the evicted-TTL clock; None while in), and whether it has left the pool.
        self.source: str | None = None
        self.out_since: float | None = None
        self.leaving = False
        # Its role's outlier detector (``outliers.OutlierDetector``, set by its pool; not imported:
        # it imports this): what another role's leg saw of it (a prefill answering alone on the
        # decode stage) is told there.
        self.detector: Any = None

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


def now() -> float:
    """The clock of everything timed on an instance (``ejected_until``, ``out_since``): the
    event loop's, whose timers re-admit instances; monotonic without a running loop."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
