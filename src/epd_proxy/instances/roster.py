"""The roster's decisions, pure functions over plain data: what a registration says, whether
the roster can take it, which topology the present roles make, and the diff from one
roster to another. ``membership.py`` is the shell that applies them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable
from urllib.parse import parse_qs

import msgspec

from epd_proxy.config import ROLES, InstanceSpec, ProxyConfig, check_zmq_endpoint, parse_instance

# The roles an instance may announce (vLLM's names). ``prefill_decode`` is one
# instance doing both: it routes as decode, and cannot be mixed with split P/D.
REGISTRATION_ROLES = ("encode", "prefill", "decode", "prefill_decode")
# Sources whose instances the TTL never forgets: nothing would bring them back.
PINNED_SOURCES = frozenset({"static", "config"})
# Roles each topology needs an instance of before the proxy is ready.
TOPOLOGY_ROLES = {"PD": ("decode",), "E+PD": ("encode", "decode"), "P+D": ("prefill", "decode"),
                  "E+P+D": ("encode", "prefill", "decode")}


class RegistrationError(ValueError):
    """An unusable registration body (HTTP 422); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class MembershipConflict(ValueError):
    """A registration the roster cannot take as it stands (HTTP 409)."""


_INT_FIELDS = ("dp_size", "kv_port", "tp", "pp", "bootstrap_port")
_STR_FIELDS = ("engine_id", "kv_host", "kv_events", "kv_events_replay")


def parse_registration(body: bytes) -> InstanceSpec:
    """The instance a ``POST /instances`` (or ``DELETE``) body describes.

    vLLM's registrar sends ``{"role", "url", "ec_zmq_addrs", "dp_size"}``; the
    reference proxy's launchers the same, maybe with ``metadata``. The optional
    ``engine_id``, ``kv_host``, ``kv_port``, ``tp``, ``pp``, ``bootstrap_port``
    are what push and Mooncake connectors need (the ``;key=value`` attributes of
    the flags); ``kv_events`` and ``kv_events_replay`` where it publishes its KV cache
    events; ``models`` (a list of names) restricts what it is sent. Unknown
    keys are ignored, as the reference does."""
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
        if name.startswith("kv_events"):
            try:
                value = check_zmq_endpoint(value, f"'{name}'")
            except ValueError as exc:
                raise RegistrationError(str(exc), name) from None
        attrs[name] = value
    addrs = data.get("ec_zmq_addrs")
    if addrs is not None:
        if not isinstance(addrs, list) or not all(isinstance(a, str) and a for a in addrs):
            raise RegistrationError("'ec_zmq_addrs' must be a list of addresses", "ec_zmq_addrs")
        if addrs and len(addrs) != attrs.get("dp_size", 1):
            raise RegistrationError(f"'ec_zmq_addrs' needs one address per DP replica ({attrs.get('dp_size', 1)}),"
                                    f" got {len(addrs)}", "ec_zmq_addrs")
        attrs["ec_zmq_addrs"] = tuple(addrs)
    models = data.get("models")
    if models is not None:
        if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
            raise RegistrationError("'models' must be a non-empty list of model names", "models")
        attrs["models"] = tuple(dict.fromkeys(models))
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


def needs_role(config, role: str) -> bool:
    """Whether a stage is needed even while its pool is empty (its requests answered 503, not
    served without it): the topology is pinned to it, or the flags gave it instances; otherwise
    it runs while it has instances."""
    return role in TOPOLOGY_ROLES.get(config.topology, ()) or bool(getattr(config, role))
