"""One roster over the role pools: every way an instance joins or leaves lands here.

Static flags, the registration API (``POST /instances``, vLLM's registrar),
a config file and DNS discovery all call :class:`Membership`, which decides
*which* instances exist and writes the roster's part of each ``Instance``
(``source``, ``out_since``, ``leaving``); the pools own *how* they are routed
to and their health (``health.py``'s one state machine). vLLM's registry
view maps onto that state machine: *live* is healthy (in full rotation),
*evicted* is ejected or half-open (out, still probed; a probe success brings
it back), and an instance that stays evicted for ``evicted_ttl`` seconds is
forgotten. The whole life of an instance, and who moves each edge, is drawn
once, in ``instance.py``.

Leaving never cuts a request: an unregistered instance leaves the routing
lists at once but keeps its connections until the requests holding it have
finished; a drained one stays in the roster, gets no new requests, and leaves
by itself when its in-flight count reaches 0.

The decisions are pure functions over plain data in ``roster.py``
(``parse_registration``, ``check_registration``, ``roster_diff``,
``infer_topology``); the class is the thin shell that applies them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.health import DRAINING
from epd_proxy.instances.instance import LEAVING, Instance
from epd_proxy.instances.instance import now as _now
from epd_proxy.instances.pool import InstancePool
from epd_proxy.instances.roster import (
    PINNED_SOURCES,
    REGISTRATION_ROLES,
    MembershipConflict,
    RosterDiff,
    check_registration,
    infer_topology,
    merge_announcement,
    normalise_url,
    registered_role,
    required_roles,
    roster_diff,
)

log = logging.getLogger("epd_proxy.membership")

# How often leaving, draining and evicted instances are looked at.
SWEEP_INTERVAL = 0.1
IDLE_SWEEP_INTERVAL = 1.0


# -- the shell -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Change:
    """One roster change, as subscribers see it. ``event`` is one of ``registered``,
    ``refreshed``, ``updated``, ``draining``, ``removed`` (no new requests; its
    in-flight ones finish), ``forgotten`` (out longer than the TTL), ``left``
    (idle after removal or drain: its connections are closed)."""

    event: str
    spec: InstanceSpec
    source: str


class Membership:
    """The roster over ``pools`` (one per role, all present, possibly empty)."""

    def __init__(self, pools: dict[str, InstancePool], *, evicted_ttl: float = 900.0, topology: str = "auto",
                 check: Callable[[InstanceSpec], None] | None = None) -> None:
        self.pools = pools
        self.evicted_ttl = evicted_ttl
        self.pinned = topology
        # The roles the flags gave instances for stay part of the topology when their
        # instances leave: a P/D proxy whose prefills are gone is not ready, not PD.
        self.configured = tuple(r for r, p in pools.items() if p.instances)
        self._check = check  # connector-specific rules (raise ValueError): e.g. push needs engine_id
        # Out of the pools, requests still in flight: each ``leaving``, kept here until idle.
        self._leaving: list[Instance] = []
        self._closing: set[asyncio.Task] = set()  # closing the connections of those that left
        self._subscribers: list[Callable[[Change], None]] = []
        self._sweeper: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None  # the idle sweeper's: something is leaving or draining
        self.registrations: dict[str, int] = {}  # by role: new instances
        self.removals: dict[tuple[str, str], int] = {}  # (role, why) -> instances that left
        for pool in pools.values():  # instances the pools were built with are static
            for inst in pool.instances:
                inst.source = "static"

    # -- queries ----------------------------------------------------------------------------
    def instances(self) -> list[Instance]:
        return [i for pool in self.pools.values() for i in pool.instances]

    def departing(self) -> list[Instance]:
        """Instances out of their pool, their requests in flight finishing (``leaving``)."""
        return list(self._leaving)

    def find(self, url: str) -> Instance | None:
        url = normalise_url(url)
        for pool in self.pools.values():
            inst = pool.find(url)
            if inst is not None:
                return inst
        return None

    @staticmethod
    def source_of(inst: Instance) -> str | None:
        return inst.source

    @property
    def topology(self) -> str:
        return infer_topology((r for r, p in self.pools.items() if p.instances), self.pinned, self.configured)

    def required_roles(self) -> tuple[str, ...]:
        return required_roles(self.topology)

    # -- changes ----------------------------------------------------------------------------
    def register(self, spec: InstanceSpec, *, source: str = "api") -> bool:
        """Add ``spec``, or refresh it if known; True if it is new. Raises
        :class:`MembershipConflict` (role change, mixing PD with split P/D, outside
        a pinned topology) or ValueError (the connector cannot use it)."""
        inst = self.find(spec.url)
        if inst is not None:
            spec = merge_announcement(inst.spec, spec)
        reason = check_registration(spec, (i.spec for i in self.instances()), self.pinned)
        if reason is not None:
            raise MembershipConflict(reason)
        if self._check is not None:
            self._check(spec)
        if inst is not None:
            # Known: a re-announcement. Health stays the probes' business; an evicted
            # instance that still announces itself is not forgotten yet.
            if inst.out_since is not None:
                inst.out_since = _now()
            if inst.spec != spec:
                models_changed = inst.spec.models != spec.models
                inst.spec = spec
                if models_changed:
                    self.pools[spec.role].served.pin(inst)
                log.info("%s instance %s: attributes updated (%s)", registered_role(spec), spec.url, source)
                self._emit("updated", spec, _source(inst, source))
            else:
                self._emit("refreshed", spec, _source(inst, source))
            return False
        inst = self.pools[spec.role].add(spec)
        inst.source = source
        role = registered_role(spec)
        self.registrations[role] = self.registrations.get(role, 0) + 1
        log.info("%s instance %s joined (%s)", registered_role(spec), spec.url, source)
        self._emit("registered", spec, source)
        return True

    def unregister(self, url: str, *, source: str | None = None) -> bool:
        """Out of the roster now (requests in flight on it finish); False if unknown,
        or owned by another source than ``source``."""
        inst = self.find(url)
        if inst is None or (source is not None and inst.source != source):
            return False
        self._remove(inst, "unregistered")
        return True

    def drain(self, url: str) -> bool:
        """No new requests; it leaves by itself once idle. False if unknown."""
        inst = self.find(url)
        if inst is None:
            return False
        pool = self.pools[inst.spec.role]
        if inst.state is not DRAINING:
            pool.outliers.drain(inst)
            log.info("%s instance %s draining (%d in flight)", registered_role(inst.spec), inst.url, inst.inflight)
            self._emit("draining", inst.spec, _source(inst, "api"))
        self._kick()
        return True

    def apply(self, desired: list[InstanceSpec], *, source: str) -> RosterDiff:
        """Make the instances owned by ``source`` exactly ``desired``: new ones join,
        missing ones are drained (they leave when idle), changed ones are updated (a
        role change leaves and joins again). Other sources' instances are untouched."""
        current = [i.spec for i in self.instances() if i.source == source and i.state is not DRAINING]
        diff = roster_diff(current, desired)
        for spec in diff.removed:
            self.drain(spec.url)
        for old, new in diff.changed:
            try:
                if registered_role(old) != registered_role(new):
                    self.unregister(old.url, source=source)
                self.register(new, source=source)
            except ValueError as exc:
                diff.rejected.append((new, str(exc)))
        for spec in diff.added:
            known = self.find(spec.url)
            try:
                if known is not None:
                    owner = known.source
                    if owner != source:
                        raise MembershipConflict(f"instance already belongs to source {owner!r}")
                    # Ours, draining (an earlier apply dropped it): it comes back as a fresh
                    # instance; the old one's requests finish.
                    self._remove(known, "unregistered")
                self.register(spec, source=source)
            except ValueError as exc:
                diff.rejected.append((spec, str(exc)))
        for spec, reason in diff.rejected:
            log.warning("%s instance %s not taken from %s: %s", registered_role(spec), spec.url, source, reason)
        return diff

    def subscribe(self, callback: Callable[[Change], None]) -> None:
        """``callback(change)`` after each roster change (on the event loop's thread)."""
        self._subscribers.append(callback)

    # -- the view -----------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """vLLM's shape (``{role: {"live": [...], "evicted": [...]}}``, all four roles)
        with this proxy's additions: ``draining`` per role, and under ``instances``
        each one's source, state and in-flight count."""
        out: dict = {role: {"live": [], "evicted": [], "draining": []} for role in REGISTRATION_ROLES}
        details = []
        for inst in self.instances():
            role = registered_role(inst.spec)
            h = inst.health
            key = "draining" if h.state is DRAINING else "evicted" if h.out else "live"
            out[role][key].append(inst.url)
            details.append(self._describe(inst, role))
        for inst in self._leaving:
            details.append(self._describe(inst, registered_role(inst.spec)))
        out["topology"] = self.topology
        out["pinned"] = self.pinned != "auto"
        out["instances"] = details
        return out

    @staticmethod
    def _describe(inst: Instance, role: str) -> dict:
        s = inst.spec
        d: dict[str, object] = {"url": inst.url, "role": role, "source": inst.source, "state": inst.state,
             "draining": inst.state is DRAINING, "leaving": inst.leaving, "inflight": inst.inflight,
             "dp_size": s.dp_size}
        if s.ec_zmq_addrs:
            d["ec_zmq_addrs"] = list(s.ec_zmq_addrs)
        for name in ("engine_id", "kv_host", "kv_port", "bootstrap_port", "kv_events", "kv_events_replay"):
            if getattr(s, name) is not None:
                d[name] = getattr(s, name)
        if s.models:
            d["models"] = list(s.models)
        return d

    def counts(self) -> dict[tuple[str, str], int]:
        """Instances by (registered role, state): the roster gauge."""
        out: dict[tuple[str, str], int] = {}
        for inst in self.instances():
            key = (registered_role(inst.spec), inst.state)
            out[key] = out.get(key, 0) + 1
        for inst in self._leaving:
            key = (registered_role(inst.spec), LEAVING)
            out[key] = out.get(key, 0) + 1
        return out

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def close(self) -> None:
        task, self._sweeper = self._sweeper, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        leaving, self._leaving = self._leaving, []
        for inst in leaving:
            await inst.connections.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def _sweep_loop(self) -> None:
        while True:
            try:
                self.sweep(_now())
            except Exception:  # never let the sweeper die
                log.exception("membership sweep failed")
            busy = self._leaving or any(i.state is DRAINING for i in self.instances())
            if busy:
                await asyncio.sleep(SWEEP_INTERVAL)
                continue
            tick = IDLE_SWEEP_INTERVAL
            if self.evicted_ttl > 0:
                tick = max(SWEEP_INTERVAL / 2, min(tick, self.evicted_ttl / 4))
            # Until the tick, or until a removal or drain wakes it. A plain future and a
            # timer: no exception per tick (a timeout's would leave a cycle for the collector).
            loop = asyncio.get_running_loop()
            self._wake = loop.create_future()
            timer = loop.call_later(tick, _wake_up, self._wake)
            try:
                await self._wake
            finally:
                timer.cancel()

    def sweep(self, now: float) -> None:
        """Drained instances that are idle leave; removed ones that are idle close their
        connections; instances out of rotation longer than the TTL are forgotten."""
        for inst in self.instances():
            if inst.state is DRAINING:
                if inst.inflight <= 0:
                    self._remove(inst, "drained")
                continue
            if self.evicted_ttl <= 0 or inst.source in PINNED_SOURCES:
                continue
            if inst.health.out:
                if inst.out_since is None:
                    inst.out_since = now
                if now - inst.out_since >= self.evicted_ttl:
                    log.warning("%s instance %s stayed out of rotation for %.0f s: forgotten",
                                registered_role(inst.spec), inst.url, now - inst.out_since)
                    self._remove(inst, "forgotten")
            else:
                inst.out_since = None
        if self._leaving:
            still = []
            for inst in self._leaving:
                if inst.inflight > 0:
                    still.append(inst)
                    continue
                task = asyncio.get_running_loop().create_task(inst.connections.close())
                self._closing.add(task)  # a strong reference until it is done
                task.add_done_callback(self._closing.discard)
                self._emit("left", inst.spec, _source(inst, "api"))
            self._leaving = still

    def _remove(self, inst: Instance, why: str) -> None:
        pool = self.pools[inst.spec.role]
        pool.remove(inst)
        inst.out_since = None
        inst.leaving = True
        self._leaving.append(inst)
        key = (registered_role(inst.spec), why)
        self.removals[key] = self.removals.get(key, 0) + 1
        log.info("%s instance %s left the roster (%s; %d in flight finish)", registered_role(inst.spec),
                 inst.url, why, inst.inflight)
        self._emit("forgotten" if why == "forgotten" else "removed", inst.spec, _source(inst, "api"))
        self._kick()

    def _kick(self) -> None:
        _wake_up(self._wake)

    def _emit(self, event: str, spec: InstanceSpec, source: str) -> None:
        change = Change(event, spec, source)
        for callback in self._subscribers:
            try:
                callback(change)
            except Exception:
                log.exception("membership subscriber failed on %s", event)


def _wake_up(waiter: asyncio.Future | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _source(inst: Instance, default: str) -> str:
    """Who put ``inst`` in the roster; ``default`` for one added to a pool directly."""
    return inst.source if inst.source is not None else default

