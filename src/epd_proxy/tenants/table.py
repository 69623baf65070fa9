"""Pure: the cluster file's ``[tenants]`` table read into what each client key may do.

::

    [tenants]
    store_failure = "open"          # a shared store that fails: "open" (admit) or "closed" (503)
    priority_header = "x-priority"  # a request may lower its own class with this header (optional)
    engine_priority = true          # the instances run --scheduling-policy priority: classes reach them

    [tenants.default]               # keys without an entry of their own (and requests without a key)
    requests_per_minute = 600

    [[tenants.keys]]
    name = "team-a"                 # the key's name in --api-key-file (never the secret)
    requests_per_second = 5
    concurrent = 8
    input_tokens_per_minute = 200000
    output_tokens_per_minute = 40000
    tokens_per_day = 5000000
    class = "critical"
    weight = 2
    models = ["qwen3-8b", "claude-sonnet-4"]

A key's entry overrides the default field by field; a limit it leaves out is the
default's, and ``0`` lifts it (no limit), as ``--max-inflight 0`` does. The classes are
``critical``, ``standard`` (the default) and ``sheddable``, the Gateway API inference
extension's criticalities, unless ``[tenants.classes]`` names others
(``name = {rank = N, sheddable = bool}``, higher rank first). With ``engine_priority``, a
request's class is also the ``priority`` its instances get (vLLM runs lower values first):
the highest rank minus the class's rank (``critical`` 0, ``standard`` 1, ``sheddable`` 2);
without, it stays the proxy's (instances without priority scheduling refuse any value but 0).
Every mistake of the table is reported at once (:meth:`TenantTable.read` raises ``ConfigErrors``):
the classes, each entry and the table's own settings each name their own, from the dataclass they make.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from epd_proxy.config import ConfigErrors

# The limits a key may have, in the order the rate-limit headers and /status show them:
# (field, counted in, window). "requests" counts requests, "input"/"output"/"tokens" tokens.
LIMITS = (
    ("requests_per_second", "requests", "second"),
    ("requests_per_minute", "requests", "minute"),
    ("input_tokens_per_minute", "input", "minute"),
    ("output_tokens_per_minute", "output", "minute"),
    ("tokens_per_day", "tokens", "day"),
    ("tokens_per_month", "tokens", "month"),
)
LIMIT_FIELDS = tuple(name for name, _, _ in LIMITS) + ("concurrent",)
STORE_FAILURE = ("open", "closed")


@dataclass(frozen=True, slots=True)
class TrafficClass:
    """A priority class: higher ``rank`` is served first when saturated; a ``sheddable``
    request never waits for a slot (refused at once when none is free)."""

    name: str
    rank: int
    sheddable: bool = False

    @staticmethod
    def read_all(table: object, source: str, errors: list[str]) -> dict[str, TrafficClass]:
        """``[tenants.classes]`` (``name = {rank = N, sheddable = bool}``), its mistakes appended
        to ``errors``; the default classes without one."""
        if table is None:
            return {c.name: c for c in DEFAULT_CLASSES}
        if not isinstance(table, dict) or not table:
            errors.append(f"{source}.classes must be a table of classes (name = {{rank = N}}), got {table!r}")
            return {c.name: c for c in DEFAULT_CLASSES}
        out = {}
        for name, spec in table.items():
            where = f"{source}.classes.{name}"
            if not isinstance(spec, dict) or set(spec) - {"rank", "sheddable"}:
                errors.append(f"{where} must be a table with 'rank' (and 'sheddable'), got {spec!r}")
                continue
            rank, shed = spec.get("rank"), spec.get("sheddable", False)
            if isinstance(rank, bool) or not isinstance(rank, int):
                errors.append(f"{where}.rank must be an integer, got {rank!r}")
                continue
            if not isinstance(shed, bool):
                errors.append(f"{where}.sheddable must be true or false, got {shed!r}")
                continue
            out[name.lower()] = TrafficClass(name.lower(), rank, shed)
        return out or {c.name: c for c in DEFAULT_CLASSES}


DEFAULT_CLASSES = (TrafficClass("critical", 2), TrafficClass("standard", 1), TrafficClass("sheddable", 0, True))

_KEY_FIELDS = set(LIMIT_FIELDS) | {"name", "class", "weight", "models"}


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """What one key (or the default) may do. ``limits``: field -> limit (absent: none);
    ``models``: the models it may name (None: any); ``label``: its name in metrics (its
    own for a key with an entry, ``default`` for the others)."""

    label: str
    limits: dict[str, int] = field(default_factory=dict)
    traffic: TrafficClass = DEFAULT_CLASSES[1]
    weight: float = 1.0
    models: frozenset[str] | None = None

    def over(self, entry: object, classes: dict[str, TrafficClass], where: str, errors: list[str], *,
             named: bool) -> KeyPolicy:
        """This policy with one entry's fields over it (``[tenants.default]`` over the base, a
        key's over the default), its mistakes appended to ``errors``."""
        if not isinstance(entry, dict):
            errors.append(f"{where} must be a table, got {entry!r}")
            return self
        allowed = _KEY_FIELDS if named else _KEY_FIELDS - {"name"}
        for key in entry:
            if key not in allowed:
                errors.append(f"{where}: unknown key {key!r} (one of {', '.join(sorted(allowed))})")
        limits = dict(self.limits)
        for name in LIMIT_FIELDS:
            if name not in entry:
                continue
            value = entry[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                errors.append(f"{where}: {name} must be a whole number >= 0 (0: no limit), got {value!r}")
            elif value == 0:
                limits.pop(name, None)
            else:
                limits[name] = value
        traffic = self.traffic
        if "class" in entry:
            chosen = classes.get(str(entry["class"]).lower())
            if chosen is None:
                errors.append(f"{where}: class must be one of {', '.join(classes)}, got {entry['class']!r}")
            else:
                traffic = chosen
        weight = entry.get("weight", self.weight)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1000:
            errors.append(f"{where}: weight must be a number in (0, 1000], got {weight!r}")
            weight = self.weight
        models = self.models
        if "models" in entry:
            names = entry["models"]
            if not isinstance(names, list) or not names or not all(isinstance(m, str) and m for m in names):
                errors.append(f"{where}: models must be a non-empty list of model names, got {names!r}")
            else:
                models = frozenset(names)
        return KeyPolicy(self.label, limits, traffic, float(weight), models)

    @staticmethod
    def read_keys(entries: object, default: KeyPolicy, classes: dict[str, TrafficClass], source: str,
                  errors: list[str]) -> dict[str, KeyPolicy]:
        """``[[tenants.keys]]``: each named key's policy over the default's."""
        keys: dict[str, KeyPolicy] = {}
        if not isinstance(entries, list):
            errors.append(f"{source}.keys must be an array of tables ([[{source}.keys]]), got {entries!r}")
            return keys
        for n, entry in enumerate(entries, 1):
            name = entry.get("name") if isinstance(entry, dict) else None
            if not isinstance(name, str) or not name:
                errors.append(f"{source}.keys #{n}: needs a 'name' (the key's name in --api-key-file)")
                continue
            where = f"{source}.keys {name!r}"
            if name in keys:
                errors.append(f"{where}: named twice")
                continue
            keys[name] = replace(default, label=name).over(entry, classes, where, errors, named=True)
        return keys


_TOP_FIELDS = {"default", "keys", "classes", "store_failure", "priority_header", "store", "store_timeout",
               "reserved_slots", "engine_priority"}


@dataclass(frozen=True, slots=True)
class TenantTable:
    """The whole ``[tenants]`` table: every key's policy, the default's, the classes."""

    default: KeyPolicy = field(default_factory=lambda: KeyPolicy("default"))
    keys: dict[str, KeyPolicy] = field(default_factory=dict)
    classes: dict[str, TrafficClass] = field(default_factory=lambda: {c.name: c for c in DEFAULT_CLASSES})
    store_failure: str = "open"
    priority_header: bytes | None = None
    store: str | None = None  # a redis:// URL for counters shared between replicas (None: in-process)
    store_timeout: float = 0.25
    reserved_slots: int = 0  # admission slots only the top class may take
    engine_priority: bool = False  # the class sets the instances' ``priority`` too

    @property
    def top_rank(self) -> int:
        return max(c.rank for c in self.classes.values())

    def priority_of(self, traffic: TrafficClass) -> int:
        """The engine ``priority`` of a class (lower runs first); 0 without ``engine_priority``."""
        return self.top_rank - traffic.rank if self.engine_priority else 0

    def policy(self, key: str | None) -> KeyPolicy:
        """The policy of the key named ``key`` (None: a request without one)."""
        if key is None:
            return self.default
        return self.keys.get(key, self.default)

    def traffic(self, policy: KeyPolicy, asked: bytes | None) -> TrafficClass:
        """The class of one request: the key's, or the one its priority header names when that
        is not above the key's own (a client may lower its priority, never raise it)."""
        if asked is None:
            return policy.traffic
        chosen = self.classes.get(asked.decode("latin-1").strip().lower())
        if chosen is None or chosen.rank > policy.traffic.rank:
            return policy.traffic
        return chosen

    @classmethod
    def read(cls, table: object, source: str = "tenants") -> TenantTable:
        """The ``[tenants]`` table as read from TOML; ``ConfigErrors`` lists every mistake, each
        part (the classes, the default, the keys, the table's own settings) naming its own."""
        errors: list[str] = []
        if not isinstance(table, dict):
            raise ConfigErrors([f"{source} must be a table, got {table!r}"])
        for key in table:
            if key not in _TOP_FIELDS:
                errors.append(f"{source}: unknown key {key!r} (one of {', '.join(sorted(_TOP_FIELDS))})")
        classes = TrafficClass.read_all(table.get("classes"), source, errors)
        default_class = classes.get("standard") or min(classes.values(), key=lambda c: c.rank)
        default = KeyPolicy("default", traffic=default_class).over(table.get("default", {}), classes,
                                                                   f"{source}.default", errors, named=False)
        keys = KeyPolicy.read_keys(table.get("keys", []), default, classes, source, errors)
        failure = table.get("store_failure", "open")
        if failure not in STORE_FAILURE:
            errors.append(f"{source}.store_failure must be one of {', '.join(STORE_FAILURE)}, got {failure!r}")
        header = table.get("priority_header")
        if header is not None and (not isinstance(header, str) or not header or not header.isascii()
                                   or any(c.isspace() or c == ":" for c in header)):
            errors.append(f"{source}.priority_header must be a header name, got {header!r}")
        store = table.get("store")
        if store is not None and (not isinstance(store, str)
                                  or not store.startswith(("redis://", "rediss://", "unix://"))):
            errors.append(f"{source}.store must be a redis://, rediss:// or unix:// URL, got {store!r}")
        timeout = table.get("store_timeout", 0.25)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 10:
            errors.append(f"{source}.store_timeout must be a number of seconds in (0, 10], got {timeout!r}")
        reserved = table.get("reserved_slots", 0)
        if isinstance(reserved, bool) or not isinstance(reserved, int) or reserved < 0:
            errors.append(f"{source}.reserved_slots must be a whole number >= 0, got {reserved!r}")
        engine = table.get("engine_priority", False)
        if not isinstance(engine, bool):
            errors.append(f"{source}.engine_priority must be true or false, got {engine!r}")
        if errors:
            raise ConfigErrors(errors)
        return cls(default=default, keys=keys, classes=classes, store_failure=failure,
                   priority_header=header.lower().encode() if header else None, store=store,
                   store_timeout=float(timeout), reserved_slots=reserved, engine_priority=engine)


def read_tenants(table: object, source: str = "tenants") -> TenantTable:
    """The ``[tenants]`` table as a :class:`TenantTable` (:meth:`TenantTable.read`)."""
    return TenantTable.read(table, source)
