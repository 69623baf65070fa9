"""One roster over the role pools: every way an instance joins or leaves lands here.

Static flags, the registration API (``POST /instances``, vLLM's registrar),
a config file and DNS discovery all call :class:`Membership`, which owns
*which* instances exist and who put them there (their ``source``); the pools
own *how* they are routed to and their health (``health.py``'s one state
machine). vLLM's registry view maps onto that state machine: *live* is
healthy (in full rotation), *evicted* is ejected or half-open (out, still
probed; a probe success brings it back), and an instance that stays evicted
for ``evicted_ttl`` seconds is forgotten.

Leaving never cuts a request: an unregistered instance leaves the routing
lists at once but keeps its connections until the requests holding it have
finished; a drained one stays in the roster, gets no new requests, and leaves
by itself when its in-flight count reaches 0.

The decisions are pure functions over plain data (``parse_registration``,
``check_registration``, ``roster_diff``, ``infer_topology``); the class is the
thin shell that applies them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable
from urllib.parse import parse_qs

import msgspec

from .config import ROLES, InstanceSpec, ProxyConfig, parse_instance
from .pool import Instance, InstancePool

log = logging.getLogger("epd_proxy.membership")

# The roles an instance may announce (vLLM's names). ``prefill_decode`` is one
# instance doing both: it routes as decode, and cannot be mixed with split P/D.
REGISTRATION_ROLES = ("encode", "prefill", "decode", "prefill_decode")
# Sources whose instances the TTL never forgets: nothing would bring them back.
PINNED_SOURCES = frozenset({"static", "config"})
# Roles each topology needs an instance of before the proxy is ready.
TOPOLOGY_ROLES = {"PD": ("decode",), "E+PD": ("encode", "decode"), "P+D": ("prefill", "decode"),
                  "E+P+D": ("encode", "prefill", "decode")}
# How often leaving, draining and evicted instances are looked at.
SWEEP_INTERVAL = 0.1
IDLE_SWEEP_INTERVAL = 1.0


class RegistrationError(ValueError):
    """An unusable registration body (HTTP 422); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class MembershipConflict(ValueError):
    """A registration the roster cannot take as it stands (HTTP 409)."""


# -- pure decisions ------------------------------------------------------------------------------
_INT_FIELDS = ("dp_size", "kv_port", "tp", "pp", "bootstrap_port")
_STR_FIELDS = ("engine_id", "kv_host")


def parse_registration(body: bytes) -> InstanceSpec:
    """The instance a ``POST /instances`` (or ``DELETE``) body describes.

    vLLM's registrar sends ``{"role", "url", "ec_zmq_addrs", "dp_size"}``; the
    reference proxy's launchers the same, maybe with ``metadata``. The optional
    ``engine_id``, ``kv_host``, ``kv_port``, ``tp``, ``pp``, ``bootstrap_port``
    are what push and Mooncake connectors need (the ``;key=value`` attributes of
    the flags). Unknown keys are ignored, as the reference does."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise RegistrationError(f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RegistrationError("body must be a JSON object")
    role = data.get("role")
    if role not in REGISTRATION_ROLES:
        raise RegistrationError(f"'role' must be one of {', '.join(REGISTRATION_ROLES)}", "role")
    url = data.get("url")
    if not isinstance(url, str) or not url.strip():
        raise RegistrationError("'url' is required (e.g. http://10.0.0.5:8000)", "url")
    pool_role = "decode" if role == "prefill_decode" else role
    if ";" in url:
        raise RegistrationError("'url' must be a plain URL; give attributes as fields", "url")
    try:
        spec = parse_instance(url.strip(), pool_role)
    except ValueError as exc:
        raise RegistrationError(str(exc), "url") from None
    attrs: dict[str, object] = {"pd": role == "prefill_decode"}
    for name in _INT_FIELDS:
        value = data.get(name)
        if value is None:
            continue
        if type(value) is not int or value < 1 or value > (65535 if name.endswith("port") else 1 << 16):
            raise RegistrationError(f"'{name}' must be a positive integer"
                                    + (" (a port)" if name.endswith("port") else ""), name)
        attrs[name] = value
    for name in _STR_FIELDS:
        value = data.get(name)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise RegistrationError(f"'{name}' must be a non-empty string", name)
        attrs[name] = value
    addrs = data.get("ec_zmq_addrs")
    if addrs is not None:
        if not isinstance(addrs, list) or not all(isinstance(a, str) and a for a in addrs):
            raise RegistrationError("'ec_zmq_addrs' must be a list of addresses", "ec_zmq_addrs")
        if addrs and len(addrs) != attrs.get("dp_size", 1):
            raise RegistrationError(f"'ec_zmq_addrs' needs one address per DP replica ({attrs.get('dp_size', 1)}),"
                                    f" got {len(addrs)}", "ec_zmq_addrs")
        attrs["ec_zmq_addrs"] = tuple(addrs)
    return dataclasses.replace(spec, **attrs)  # type: ignore[arg-type]


def parse_url_param(query: str) -> str | None:
    """``url`` from a query string (``DELETE /instances?url=...``), normalised."""
    values = parse_qs(query).get("url")
    if not values:
        return None
    return normalise_url(values[0])


def normalise_url(url: str) -> str:
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def registered_role(spec: InstanceSpec) -> str:
    """The role as vLLM names it (``prefill_decode`` for a combined instance)."""
    return "prefill_decode" if spec.pd else spec.role


def check_registration(spec: InstanceSpec, roster: Iterable[InstanceSpec], topology: str = "auto") -> str | None:
    """Why ``spec`` cannot join a roster holding ``roster`` (None if it can).

    An instance changes role only by leaving first; ``prefill_decode`` cannot be
    mixed with split prefill/decode instances; a pinned topology takes only its roles."""
    role = registered_role(spec)
    mixing = False
    for other in roster:
        if other.url == spec.url:
            if registered_role(other) != role:
                return (f"instance is registered as {registered_role(other)}; unregister it before "
                        f"registering it as {role}")
            continue
        if spec.pd and (other.role == "prefill" or (other.role == "decode" and not other.pd)):
            mixing = True
        if (spec.role == "prefill" or (spec.role == "decode" and not spec.pd)) and other.pd:
            mixing = True
    if mixing:
        return "prefill_decode instances cannot be mixed with separate prefill and decode instances"
    if topology != "auto":
        needed = TOPOLOGY_ROLES[topology]
        if spec.role not in needed or (spec.pd and "prefill" in needed):
            return f"the topology is pinned to {topology}: it has no {role} instances"
    return None


def check_pinned_topology(config: ProxyConfig) -> None:
    """Raise ValueError when a configured instance has no place in a pinned ``--topology``
    (part of ``app.validate_config``; registrations meet the same rule in ``check_registration``)."""
    if config.topology == "auto":
        return
    for role in ROLES:
        for spec in getattr(config, role):
            reason = check_registration(spec, (), config.topology)
            if reason is not None:
                raise ValueError(f"{spec.url}: {reason}")


_DEFAULTS = InstanceSpec("", "")


def merge_announcement(known: InstanceSpec, new: InstanceSpec) -> InstanceSpec:
    """A re-announcement of a known instance: what it states replaces what was known,
    what it leaves out (at its default) is kept. vLLM's registrar sends only role, url,
    ec_zmq_addrs and dp_size every 30 s; it must not wipe the engine_id a launcher gave."""
    keep = {f.name: getattr(known, f.name) for f in dataclasses.fields(InstanceSpec)
            if f.name not in ("url", "role", "pd") and getattr(new, f.name) == getattr(_DEFAULTS, f.name)}
    return dataclasses.replace(new, **keep) if keep else new


def infer_topology(present: Iterable[str], pinned: str = "auto", configured: Iterable[str] = ()) -> str:
    """The topology: the pinned one, else what the roles with instances make, together
    with the roles the flags configured (``none`` while there is nothing at all)."""
    if pinned != "auto":
        return pinned
    roles = set(present) | set(configured)
    if not roles:
        return "none"
    if "prefill" in roles:
        return "E+P+D" if "encode" in roles else "P+D"
    return "E+PD" if "encode" in roles else "PD"


def required_roles(topology: str) -> tuple[str, ...]:
    """The roles that need an instance before the proxy is ready."""
    return TOPOLOGY_ROLES.get(topology, ("decode",))


@dataclass(slots=True)
class RosterDiff:
    """What applying a desired roster does. ``removed`` instances are drained (they
    leave when idle); ``changed`` are ``(old, new)`` pairs with the same URL;
    ``rejected`` are ``(spec, reason)`` that could not join (filled by ``apply``)."""

    added: list[InstanceSpec] = field(default_factory=list)
    removed: list[InstanceSpec] = field(default_factory=list)
    changed: list[tuple[InstanceSpec, InstanceSpec]] = field(default_factory=list)
    rejected: list[tuple[InstanceSpec, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.rejected)


def roster_diff(current: Iterable[InstanceSpec], desired: Iterable[InstanceSpec]) -> RosterDiff:
    """From ``current`` to ``desired`` (both one source's instances), by URL."""
    have = {s.url: s for s in current}
    want: dict[str, InstanceSpec] = {}
    for s in desired:
        want[s.url] = s
    diff = RosterDiff()
    for url, spec in want.items():
        old = have.get(url)
        if old is None:
            diff.added.append(spec)
        elif old != spec:
            diff.changed.append((old, spec))
    diff.removed = [s for url, s in have.items() if url not in want]
    return diff


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
        self._source: dict[Instance, str] = {}
        self._out_since: dict[Instance, float] = {}
        self._leaving: list[Instance] = []  # out of the roster, requests still in flight
        self._closing: set[asyncio.Task] = set()  # closing the connections of those that left
        self._subscribers: list[Callable[[Change], None]] = []
        self._sweeper: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None  # the idle sweeper's: something is leaving or draining
        self.registrations: dict[str, int] = {}  # by role: new instances
        self.removals: dict[tuple[str, str], int] = {}  # (role, why) -> instances that left
        for pool in pools.values():  # instances the pools were built with are static
            for inst in pool.instances:
                self._source[inst] = "static"

    # -- queries ----------------------------------------------------------------------------
    def instances(self) -> list[Instance]:
        return [i for pool in self.pools.values() for i in pool.instances]

    def find(self, url: str) -> Instance | None:
        url = normalise_url(url)
        for pool in self.pools.values():
            inst = pool.find(url)
            if inst is not None:
                return inst
        return None

    def source_of(self, inst: Instance) -> str | None:
        return self._source.get(inst)

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
            if inst in self._out_since:
                self._out_since[inst] = _now()
            if inst.spec != spec:
                inst.spec = spec
                log.info("%s instance %s: attributes updated (%s)", registered_role(spec), spec.url, source)
                self._emit("updated", spec, self._source.get(inst, source))
            else:
                self._emit("refreshed", spec, self._source.get(inst, source))
            return False
        inst = self.pools[spec.role].add(spec)
        self._source[inst] = source
        role = registered_role(spec)
        self.registrations[role] = self.registrations.get(role, 0) + 1
        log.info("%s instance %s joined (%s)", registered_role(spec), spec.url, source)
        self._emit("registered", spec, source)
        return True

    def unregister(self, url: str, *, source: str | None = None) -> bool:
        """Out of the roster now (requests in flight on it finish); False if unknown,
        or owned by another source than ``source``."""
        inst = self.find(url)
        if inst is None or (source is not None and self._source.get(inst) != source):
            return False
        self._remove(inst, "unregistered")
        return True

    def drain(self, url: str) -> bool:
        """No new requests; it leaves by itself once idle. False if unknown."""
        inst = self.find(url)
        if inst is None:
            return False
        pool = self.pools[inst.spec.role]
        if inst.state != "draining":
            pool.drain(inst)
            log.info("%s instance %s draining (%d in flight)", registered_role(inst.spec), inst.url, inst.inflight)
            self._emit("draining", inst.spec, self._source.get(inst, "api"))
        self._kick()
        return True

    def apply(self, desired: list[InstanceSpec], *, source: str) -> RosterDiff:
        """Make the instances owned by ``source`` exactly ``desired``: new ones join,
        missing ones are drained (they leave when idle), changed ones are updated (a
        role change leaves and joins again). Other sources' instances are untouched."""
        current = [i.spec for i, s in self._source.items() if s == source and i not in self._leaving
                   and i.state != "draining"]
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
                    owner = self._source.get(known)
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
            key = "draining" if h.state == "draining" else "evicted" if h.out else "live"
            out[role][key].append(inst.url)
            details.append(self._describe(inst, role, leaving=False))
        for inst in self._leaving:
            details.append(self._describe(inst, registered_role(inst.spec), leaving=True))
        out["topology"] = self.topology
        out["pinned"] = self.pinned != "auto"
        out["instances"] = details
        return out

    def _describe(self, inst: Instance, role: str, leaving: bool) -> dict:
        s = inst.spec
        d: dict[str, object] = {"url": inst.url, "role": role, "source": self._source.get(inst), "state": inst.state,
             "draining": inst.state == "draining", "leaving": leaving, "inflight": inst.inflight,
             "dp_size": s.dp_size}
        if s.ec_zmq_addrs:
            d["ec_zmq_addrs"] = list(s.ec_zmq_addrs)
        for name in ("engine_id", "kv_host", "kv_port", "bootstrap_port"):
            if getattr(s, name) is not None:
                d[name] = getattr(s, name)
        return d

    def counts(self) -> dict[tuple[str, str], int]:
        """Instances by (registered role, state): the roster gauge."""
        out: dict[tuple[str, str], int] = {}
        for inst in self.instances():
            key = (registered_role(inst.spec), inst.state)
            out[key] = out.get(key, 0) + 1
        for inst in self._leaving:
            key = (registered_role(inst.spec), "leaving")
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
            busy = self._leaving or any(i.state == "draining" for i in self.instances())
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
            if inst.state == "draining":
                if inst.inflight <= 0:
                    self._remove(inst, "drained")
                continue
            if self.evicted_ttl <= 0 or self._source.get(inst) in PINNED_SOURCES:
                continue
            if inst.health.out:
                since = self._out_since.setdefault(inst, now)
                if now - since >= self.evicted_ttl:
                    log.warning("%s instance %s stayed out of rotation for %.0f s: forgotten",
                                registered_role(inst.spec), inst.url, now - since)
                    self._remove(inst, "forgotten")
            else:
                self._out_since.pop(inst, None)
        if self._leaving:
            still = []
            for inst in self._leaving:
                if inst.inflight > 0:
                    still.append(inst)
                    continue
                task = asyncio.get_running_loop().create_task(inst.connections.close())
                self._closing.add(task)  # a strong reference until it is done
                task.add_done_callback(self._closing.discard)
                self._emit("left", inst.spec, self._source.pop(inst, "api"))
            self._leaving = still

    def _remove(self, inst: Instance, why: str) -> None:
        pool = self.pools[inst.spec.role]
        pool.remove(inst)
        self._out_since.pop(inst, None)
        self._leaving.append(inst)
        key = (registered_role(inst.spec), why)
        self.removals[key] = self.removals.get(key, 0) + 1
        log.info("%s instance %s left the roster (%s; %d in flight finish)", registered_role(inst.spec),
                 inst.url, why, inst.inflight)
        self._emit("forgotten" if why == "forgotten" else "removed", inst.spec, self._source.get(inst, "api"))
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


def _now() -> float:
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


__all__ = ["Membership", "Change", "RosterDiff", "RegistrationError", "MembershipConflict", "parse_registration",
           "parse_url_param", "check_registration", "roster_diff", "infer_topology", "required_roles",
           "registered_role", "REGISTRATION_ROLES", "ROLES"]
