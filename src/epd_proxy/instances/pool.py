"""One role's host set: its instances, and which of them a leg may use (Envoy's host set, as
its ``source/common/upstream/`` keeps it apart from health checking and outlier detection).

It keeps the lists a pick reads (in rotation, half-open, every one not draining; per model,
among the instances serving it: ``models.py``), rebuilt on every change of state or membership,
never per request, and offers every instance when none is in rotation ("panic" routing, counted
and logged here) rather than nothing, except those whose queue stands still (``wedged``: they
admit nothing, so a request sent there waits until their pinned KV expires; the placement
answers without them, ``placement/decision.py``). Its parts, one concern each, are made with it and reached
through it: the outlier signals requests and probes give and the ejection timers
(``outliers.py``: ``OutlierDetector``, over the pure health machine of ``health.py``), the
active health checks (``probes.py``: ``HealthChecks``), what each instance serves
(``served_models.py``: ``ServedModels``); each tells the host set to ``refresh`` when a state
changes. It chooses nothing: a leg's pick (the half-open trial share, LoRA affinity, the
policy) is the placement's (``placement/choose.py``); the role's policy is carried here as its
configuration, LoRA adapter affinity by ``served``. Load signals are each instance's
(``load_signals.py``, ``load_scraper.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Collection, Iterable

from epd_proxy.config import InstanceSpec
from epd_proxy.http import Headers
from epd_proxy.http.client import ConnectionPool
from epd_proxy.instances.health import BY_WEDGED, DRAINING, EJECTED, HALF_OPEN, HEALTHY, OutlierRules, OutlierSettings
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.instance import now as _now  # the instances' one clock
from epd_proxy.instances.model_directory import ModelDirectory
from epd_proxy.instances.models import ModelKey, serves
from epd_proxy.instances.outliers import OutlierDetector
from epd_proxy.instances.probes import HealthChecks
from epd_proxy.instances.served_models import ServedModels
from epd_proxy.routing import make_policy
from epd_proxy.routing.candidate import RoutingPolicy
from epd_proxy.routing.lora_affinity import AdapterAffinity
from epd_proxy.wire.errors import ProxyError

log = logging.getLogger("epd_proxy.pool")

# Panic routing is logged at most this often per role.
PANIC_LOG_INTERVAL = 10.0
# Per-model routing lists kept at most (a client may name any model while some instance's
# models are unknown: the cache must not grow with what clients send).
MODEL_LISTS = 256


class InstancePool:
    """All instances of one role."""

    def __init__(self, role: str, specs: Iterable[InstanceSpec], *, policy: str | RoutingPolicy = "least-loaded",
                 keep_alive: float = 5.0, outlier: OutlierSettings | None = None,
                 max_connections: int | None = None, models: ModelDirectory | None = None,
                 headers: Headers | None = None, affinity: AdapterAffinity | None = None) -> None:
        self.role = role
        # Retire pooled sockets at half the server's keep-alive, before it closes them.
        self._idle = keep_alive / 2 if keep_alive > 0 else 0.0
        # ``max_connections``: the per-instance cap on concurrent upstream connections (None: none).
        self._max_connections = max_connections
        self.instances = [self._new_instance(s) for s in specs]
        self.policy: RoutingPolicy = make_policy(policy) if isinstance(policy, str) else policy
        self.panics = 0  # requests routed with no instance in rotation
        self._last_panic_log = -PANIC_LOG_INTERVAL
        self.picks = 0  # picks made while a half-open instance was there (the trial share's count)
        # The host set as a pick reads it (placement/choose.py): lists replaced, never changed in
        # place, on every state change (never per request): the instances in rotation, the
        # half-open ones, and every one neither draining nor wedged (panic routing's).
        self.in_rotation: list[Instance] = []
        self.half_open: list[Instance] = []
        self.every: list[Instance] = []
        # Out because their queue stands still (requests waiting, none running): no pick, not even
        # in panic, takes one (placement/decision.py answers without them).
        self.wedged: list[Instance] = []
        # Requests placed while every instance of the role (for their model) stood still: answered
        # by another role's instance alone ("prefill_alone") or refused at once ("refused").
        self.wedged_routing = {"prefill_alone": 0, "refused": 0}
        # The three lists above per model a request named, built on first use after a change.
        self._by_model: dict[ModelKey, tuple[list[Instance], list[Instance], list[Instance]]] = {}
        self.out = 0  # instances out of rotation (ejected or half-open): the outlier rules' cap reads it
        # What each instance serves (/v1/models), told to the cluster's models on every change;
        # with ``affinity``, where each LoRA adapter's requests go.
        self.served = ServedModels(self, models or ModelDirectory(), affinity)
        # The outlier signals requests and probes give, and the ejection timers.
        self.outliers = OutlierDetector(self, OutlierRules(outlier or OutlierSettings()))
        for inst in self.instances:
            inst.detector = self.outliers
        self.refresh()
        # Active health checking: GET /health and /v1/models per instance (probes.py).
        self.checks = HealthChecks(self, self.outliers, self.served, headers or [])

    def __len__(self) -> int:
        return len(self.instances)

    def __bool__(self) -> bool:
        return bool(self.instances)

    # -- the host set as one leg's pick reads it (placement/choose.py picks) ----------------
    def hosts(self, model: ModelKey | None = None) -> tuple[list[Instance], list[Instance], list[Instance]]:
        """The instances in rotation, the half-open ones and every one neither draining nor
        wedged (of those serving ``model``): lists replaced, never changed in place, on every change of state."""
        if model is None:
            return self.in_rotation, self.half_open, self.every
        return self._lists(model)

    def candidates(self, exclude: Iterable[Instance] = (), model: ModelKey | None = None) -> list[Instance]:
        """The instances to route over: healthy ones not in ``exclude``; else a half-open
        one that might answer; else the healthy ones; else all of them but the wedged (panic)."""
        if model is None:
            return self._candidates(exclude, self.in_rotation, self.half_open, self.every, None)
        return self._candidates(exclude, *self._lists(model), model)

    def _candidates(self, exclude, healthy: list[Instance], half_open: list[Instance], panic_set: list[Instance],
                    model: ModelKey | None) -> list[Instance]:
        if healthy:
            if not exclude:
                return healthy
            preferred = [i for i in healthy if i not in exclude]
            if preferred:
                return preferred
            others = [i for i in half_open if i not in exclude]
            return others or healthy
        return self._panic(exclude, panic_set, model)

    def reachable(self, exclude: Iterable[Instance] = (), model: ModelKey | None = None) -> bool:
        """Whether an instance in rotation has not yet failed this request."""
        healthy = self.in_rotation if model is None else self._lists(model)[0]
        return any(i not in exclude for i in healthy)

    def spare(self, exclude: Iterable[Instance] = (), model: ModelKey | None = None) -> bool:
        """Whether ``choose(exclude)`` would pick an instance not in ``exclude`` (without
        counting a panic): a retry can go somewhere new, rather than back to an instance
        that already failed this request."""
        if model is None:
            healthy, half_open, panic_set = self.in_rotation, self.half_open, self.every
        else:
            healthy, half_open, panic_set = self._lists(model)
        if healthy:
            return any(i not in exclude for i in healthy) or any(i not in exclude for i in half_open)
        return any(i not in exclude for i in panic_set)

    def standing(self, model: ModelKey | None = None, exclude: Collection[Instance] = ()) -> bool:
        """Whether every instance (serving ``model``) that is neither draining nor in ``exclude``
        (those that failed the request) stands still: none in rotation, none half-open, none for
        panic routing, and at least one wedged."""
        wedged = self.wedged
        if not wedged:
            return False
        every = self.every if model is None else self._lists(model)[2]
        if any(i not in exclude for i in every):
            return False
        return model is None or any(serves(i.served, model) for i in wedged)

    def _lists(self, model: ModelKey) -> tuple[list[Instance], list[Instance], list[Instance]]:
        """The routing lists of the instances serving ``model`` (cached until the next change)."""
        lists = self._by_model.get(model)
        if lists is None:
            if len(self._by_model) >= MODEL_LISTS:
                self._by_model.clear()
            lists = self._by_model[model] = (
                [i for i in self.in_rotation if serves(i.served, model)],
                [i for i in self.half_open if serves(i.served, model)],
                [i for i in self.every if serves(i.served, model)])
        return lists

    def _panic(self, exclude, panic_set: list[Instance], model: ModelKey | None) -> list[Instance]:
        """Routing over instances out of rotation. It is panic routing (counted, logged) only when
        the instances it covers are out: the role's, or the model's own (those known to serve it).
        Instances whose models are not known yet, the only ones left when the role's instances in
        rotation serve other models, may be tried, but their being out says nothing of the role
        or the model."""
        name = None if model is None else model if isinstance(model, str) else model[0]
        if not panic_set:  # none at all, or every one draining
            serving = "" if name is None else f" serving model `{name}`"
            raise ProxyError(503, f"no {self.role} instance{serving} available", retryable=False)
        if model is None or not self.in_rotation or any(i.served is not None for i in panic_set):
            self.panics += 1
            now = time.monotonic()
            if now - self._last_panic_log >= PANIC_LOG_INTERVAL:
                self._last_panic_log = now
                serving = "" if name is None else f" serving model `{name}`"
                log.warning("no %s instance%s in rotation: routing over all %d of them (panic routing; "
                            "%d times so far)", self.role, serving, len(panic_set), self.panics)
        preferred = [i for i in panic_set if i not in exclude] if exclude else panic_set
        return preferred or panic_set

    def refresh(self) -> None:
        """The lists a pick reads rebuilt: a state, a member or what one serves changed."""
        insts = self.instances
        self.in_rotation = [i for i in insts if i.health.state is HEALTHY]
        self.half_open = [i for i in insts if i.health.state is HALF_OPEN]
        self.out = sum(1 for i in insts if i.health.out)
        # Draining instances get no new requests, not even in panic: otherwise one that
        # is the last of its role would never become idle and leave. Nor do wedged ones: a
        # request there waits in a queue that cannot move.
        self.wedged = [i for i in insts if i.health.state is EJECTED and i.health.cause is BY_WEDGED]
        self.every = [i for i in insts if i.health.state is not DRAINING and i not in self.wedged]
        self._by_model = {}
        self.served.changed()  # the cluster's models now, the adapters' homes on the next adapter request

    # -- membership (membership.py decides; this keeps the lists in step) -------------------
    def _new_instance(self, spec: InstanceSpec) -> Instance:
        return Instance(spec, ConnectionPool(spec.url, idle_timeout=self._idle,
                                             max_connections=self._max_connections))

    def add(self, spec: InstanceSpec) -> Instance:
        """A new instance, in rotation at once (and probed, if probing is on). The
        policy's cursor is left alone: a join never restarts the rotation."""
        inst = self._new_instance(spec)
        inst.detector = self.outliers
        self.instances.append(inst)
        self.refresh()
        self.checks.added(inst)
        return inst

    def remove(self, inst: Instance) -> None:
        """Out of the roster now: no new request picks it. Requests holding it carry on;
        the caller closes its connections (``inst.connections``) once it is idle."""
        try:
            self.instances.remove(inst)
        except ValueError:
            return
        self.checks.removed(inst)
        self.outliers.forget(inst)
        self.refresh()

    def find(self, url: str) -> Instance | None:
        for inst in self.instances:
            if inst.url == url:
                return inst
        return None

    async def close(self) -> None:
        await self.checks.close()
        for inst in self.instances:
            self.outliers.forget(inst)
            await inst.connections.close()

    def snapshot(self) -> list[dict]:
        """Per instance, for ``/status``."""
        now, wall = _now(), time.time()
        out = []
        for i in self.instances:
            h = i.health
            until = h.ejected_until if h.state is not HEALTHY and h.ejected_until > now else None
            out.append({"url": i.url, "state": h.state, "healthy": h.state is HEALTHY,
                        "consecutive_failures": h.failures, "ejections": h.ejections,
                        "ejected_until": None if until is None else round(wall + until - now, 3),
                        "inflight": i.inflight, "requests": i.requests, "errors": dict(h.errors),
                        "last_error": h.last_error, "models": None if i.served is None else i.served.names})
        return out
