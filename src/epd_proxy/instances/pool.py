"""One role's host set: its instances, their health, and which of them a leg may use.

Each instance has one health state machine (``health.py``: healthy, ejected, half-open,
draining) fed by the active health checks (``probes.py``: ``GET /health``, then its
``/v1/models``) and by the outlier signals requests give (``record_*``). This module is its
shell: it keeps the lists a pick reads (in rotation, half-open, every one not draining; per
model, among the instances serving it: ``models.py``) in step with the states, re-admits an
instance (half-open) when its ejection time is over, fails the pending requests of an instance
ejected for not answering, and offers every instance when none is in rotation ("panic"
routing, counted and logged here) rather than nothing. It chooses nothing: a leg's pick
(the half-open trial share, LoRA affinity, the policy) is the placement's
(``placement/choose.py``); the role's policy and adapter affinity are carried here as its
configuration. Load signals are each instance's (``load_signals.py``, ``load_scraper.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterable

from epd_proxy.config import InstanceSpec
from epd_proxy.http import Headers
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import UpstreamError
from epd_proxy.instances.health import (
    DRAINING,
    HALF_OPEN,
    HEALTHY,
    WEDGED,
    Ejection,
    OutlierRules,
    OutlierSettings,
)
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.instance import now as _now  # the instances' one clock
from epd_proxy.instances.model_directory import ModelDirectory
from epd_proxy.instances.models import ModelKey, parse_models, pinned, serves
from epd_proxy.instances.probes import HealthChecks
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
        # A LoRA adapter's requests concentrated on few of its instances (None: the policy places them).
        self.affinity = affinity
        self.rules = OutlierRules(outlier or OutlierSettings())  # every ejection knob
        self.panics = 0  # requests routed with no instance in rotation
        self.local_errors = 0  # the proxy's own resource failures (never blamed on an instance)
        self._last_panic_log = -PANIC_LOG_INTERVAL
        self.picks = 0  # picks made while a half-open instance was there (the trial share's count)
        # The host set as a pick reads it (placement/choose.py): lists replaced, never changed in
        # place, on every state change (never per request): the instances in rotation, the
        # half-open ones, and every one not draining (panic routing's).
        self.in_rotation: list[Instance] = []
        self.half_open: list[Instance] = []
        self.every: list[Instance] = []
        # The three lists above per model a request named, built on first use after a change.
        self._by_model: dict[ModelKey, tuple[list[Instance], list[Instance], list[Instance]]] = {}
        self._out = 0
        self._homes_stale = True  # LoRA adapters' homes (affinity) to compute on the next adapter request
        self._headers = headers or []  # a /v1/models read's (--upstream-api-key)
        self.models = models or ModelDirectory()  # the cluster's models, told of every change here
        self._refresh()
        self.models.track(self)
        # Active health checking: GET /health and /v1/models per instance (probes.py).
        self.checks = HealthChecks(self, headers or [])

    def __len__(self) -> int:
        return len(self.instances)

    def __bool__(self) -> bool:
        return bool(self.instances)

    # -- the host set as one leg's pick reads it (placement/choose.py picks) ----------------
    def hosts(self, model: ModelKey | None = None) -> tuple[list[Instance], list[Instance], list[Instance]]:
        """The instances in rotation, the half-open ones and every one not draining (of those
        serving ``model``): lists replaced, never changed in place, on every change of state."""
        if model is None:
            return self.in_rotation, self.half_open, self.every
        return self._lists(model)

    def adapter_of(self, model: ModelKey) -> str | None:
        """The LoRA adapter a request's model key names (None: a base model)."""
        if isinstance(model, tuple):
            return model[0]
        return model if self.models.current.parents.get(model) else None

    def rehome(self) -> None:
        """The adapters' homes (affinity) computed again after a change of the roster."""
        if self._homes_stale and self.affinity is not None:
            self._homes_stale = False
            self.affinity.rehome(self._adapters_served())

    def candidates(self, exclude: Iterable[Instance] = (), model: ModelKey | None = None) -> list[Instance]:
        """The instances to route over: healthy ones not in ``exclude``; else a half-open
        one that might answer; else the healthy ones; else all of them (panic)."""
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

    def _adapters_served(self) -> dict[str, list[str]]:
        """Per LoRA adapter, the URLs of the instances (not draining) that serve it."""
        out: dict[str, list[str]] = {}
        for inst in self.every:
            if inst.served is not None:
                for name, parent in inst.served.parents.items():
                    if parent is not None:
                        out.setdefault(name, []).append(inst.url)
        return out

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

    def _refresh(self) -> None:
        insts = self.instances
        self.in_rotation = [i for i in insts if i.health.state is HEALTHY]
        self.half_open = [i for i in insts if i.health.state is HALF_OPEN]
        self._out = sum(1 for i in insts if i.health.out)
        # Draining instances get no new requests, not even in panic: otherwise one that
        # is the last of its role would never become idle and leave.
        self.every = [i for i in insts if i.health.state is not DRAINING]
        self._by_model = {}
        self._homes_stale = True  # adapter homes computed again on the next adapter request
        self.models.changed()

    # -- membership (membership.py decides; this keeps the routing lists in step) ------------
    def _new_instance(self, spec: InstanceSpec) -> Instance:
        return Instance(spec, ConnectionPool(spec.url, idle_timeout=self._idle,
                                             max_connections=self._max_connections))

    def add(self, spec: InstanceSpec) -> Instance:
        """A new instance, in rotation at once (and probed, if probing is on). The
        policy's cursor is left alone: a join never restarts the rotation."""
        inst = self._new_instance(spec)
        self.instances.append(inst)
        self._refresh()
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
        self._cancel_expiry(inst)
        self._refresh()

    def find(self, url: str) -> Instance | None:
        for inst in self.instances:
            if inst.url == url:
                return inst
        return None

    # -- what requests observe -----------------------------------------------------------
    def record_success(self, inst: Instance) -> None:
        """The instance answered (a 200, or a 4xx: the request's fault, not its)."""
        h = inst.health
        h.failures = 0
        h.window_requests += 1
        if h.state is not HEALTHY and self.rules.success(h, _now()):
            self._changed(inst, "answered again")

    def record_failure(self, inst: Instance, reason: str, kind: str = "connection", ctx=None) -> None:
        """An instance signal (connection failure, timeout, gateway status). With ``ctx``
        (the request's context) it counts once per client request."""
        if self._note(inst, kind, reason, ctx):
            return
        h = inst.health
        verdict = self.rules.instance_failure(h, _now(), kind=kind, size=len(self.instances), out=self._out)
        if verdict is not None:
            self._ejected(inst, verdict, reason)

    def record_request_failure(self, inst: Instance, reason: str, kind: str = "http_500", ctx=None) -> None:
        """A request signal (vLLM failed this one request): feeds the rate detector only."""
        if self._note(inst, kind, reason, ctx):
            return
        verdict = self.rules.request_failure(inst.health, _now(), size=len(self.instances), out=self._out)
        if verdict is not None:
            self._ejected(inst, verdict, f"{inst.health.window_failures} of {inst.health.window_requests} "
                                         f"requests failed; last: {reason}")

    def standing(self, inst: Instance, why: str | None) -> None:
        """What the load scrape says of the instance's queue (load_signals.py, ``wedged``):
        standing still (``why``), it leaves routing at once; running again, it is back."""
        h = inst.health
        if why is None:
            if self.rules.unwedged(h, _now()):
                self._changed(inst, "running again")
            return
        verdict = self.rules.wedged(h, _now(), size=len(self.instances), out=self._out)
        if verdict is not None:
            h.errors[WEDGED] = h.errors.get(WEDGED, 0) + 1
            h.last_error = why
            self._ejected(inst, verdict, why)

    def record_local_error(self) -> None:
        """The proxy itself ran out of something (descriptors, buffers, memory)."""
        self.local_errors += 1

    def _note(self, inst: Instance, kind: str, reason: str, ctx) -> bool:
        """Count the error; True if this request already blamed the instance."""
        inst.errors += 1
        h = inst.health
        h.errors[kind] = h.errors.get(kind, 0) + 1
        h.last_error = reason
        if ctx is None:
            return False
        if inst in ctx.excluded:
            return True
        ctx.failed(inst)
        return False

    def drain(self, inst: Instance) -> None:
        """Take an instance out of rotation for good (an operator's decision)."""
        self.rules.drain(inst.health)
        self._cancel_expiry(inst)
        self._refresh()

    # -- transitions (the I/O side) -------------------------------------------------------
    def _ejected(self, inst: Instance, verdict: Ejection, reason: str) -> None:
        self._refresh()
        h = inst.health
        log.warning("%s instance %s ejected for %.1f s (ejection %d, %s): %s", self.role, inst.url,
                    verdict.until - _now(), h.ejections, h.cause, reason)
        self._cancel_expiry(inst)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (pure use): re-admission on the next signal
            loop = None
        if loop is not None:
            inst.expiry = loop.call_at(verdict.until, self._expire, inst)
        if verdict.stalled:
            # It stopped answering: what it has not answered yet will not be answered
            # either. Fail it now, so those requests are retried elsewhere.
            n = inst.connections.fail_pending(lambda: UpstreamError(
                "instance taken out of rotation: it stopped answering", kind="ejected"))
            if n:
                log.warning("%s instance %s: failed over %d pending request(s)", self.role, inst.url, n)

    def _expire(self, inst: Instance) -> None:
        inst.expiry = None
        if self.rules.expire(inst.health, _now()):
            log.info("%s instance %s half-open: trying it again", self.role, inst.url)
            self._refresh()

    def _changed(self, inst: Instance, why: str) -> None:
        self._cancel_expiry(inst)
        self._refresh()
        log.info("%s instance %s is back in rotation (%s)", self.role, inst.url, why)

    @staticmethod
    def _cancel_expiry(inst: Instance) -> None:
        if inst.expiry is not None:
            inst.expiry.cancel()
            inst.expiry = None

    # -- probes ---------------------------------------------------------------------------
    def learned(self, inst: Instance, body: bytes) -> None:
        """``inst``'s /v1/models answer (``body``), within its ``models`` attribute; ValueError
        when it is not a model list."""
        served = parse_models(body, inst.spec.models, self.models.cards)
        if served != inst.served:
            if inst.spec.models and not served.parents:
                log.warning("%s instance %s serves none of its models (%s)", self.role, inst.url,
                            ", ".join(inst.spec.models))
            # What it serves at first is in /status; a change later is worth a line.
            log.log(logging.DEBUG if inst.served is None else logging.INFO, "%s instance %s serves %s", self.role,
                    inst.url, ", ".join(served.names) or "nothing")
            inst.served = served
            self._refresh()

    def pin_models(self, inst: Instance) -> None:
        """Its ``models`` attribute changed: what it serves is that (or unknown) until it answers again."""
        inst.served = pinned(inst.spec.models) if inst.spec.models else None
        self._refresh()

    def probe_answered(self, inst: Instance) -> None:
        """A health probe answered 200 (probes.py): the instance may come back at once."""
        if self.rules.success(inst.health, _now(), probe=True):
            self._changed(inst, "health probe answered")

    def probe_failed(self, inst: Instance, kind: str, reason: str) -> None:
        """A health probe failed (probes.py): an instance signal, never capped."""
        self._note(inst, kind, reason, None)
        verdict = self.rules.instance_failure(inst.health, _now(), kind=kind, size=len(self.instances),
                                              out=self._out, probe=True)
        if verdict is not None:
            self._ejected(inst, verdict, reason)

    async def close(self) -> None:
        await self.checks.close()
        for inst in self.instances:
            self._cancel_expiry(inst)
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
