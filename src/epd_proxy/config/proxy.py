"""``ProxyConfig``: the instances of each role, and the settings of each concern.

The settings are one typed section per concern (``sections.py``), each checking its own
values; ``ProxyConfig.problems`` adds what spans two of them. Every section field is also
read as ``config.<its name>`` (``config.kv_reuse_ttl`` is ``config.multi_turn.kv_reuse_ttl``)
and given by that name to the constructor and ``replace``: the name is the flag's and the
cluster file's, so a caller that knows the flag needs no map of the sections. The request
path reads neither way per request: what it needs is bound when it is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from epd_proxy.config.checks import ConfigErrors, check_range
from epd_proxy.config.instances import ROLES, InstanceSpec
from epd_proxy.config.sections import (
    AccessConfig,
    AdmissionConfig,
    EncodersConfig,
    HealthConfig,
    KvEventsConfig,
    ListenerConfig,
    LoraConfig,
    MediaConfig,
    MembershipConfig,
    MultiTurnConfig,
    ObservabilityConfig,
    RoutingConfig,
    StageTimeouts,
    StateStoreConfig,
    UpstreamConfig,
)

LOG_LEVELS = ("debug", "info", "warning", "error")
# The measured best routing policy per role (docs/architecture.md, "Routing").
ROLE_POLICY_DEFAULTS = {"encode": "cache-aware", "prefill": "cache-aware", "decode": "load-aware"}
NO_DECODE = ("at least one --decode instance is required (or --dynamic-registration, or a dns+http:// "
             "decode instance)")

# ``ProxyConfig``'s sections: the attribute, and its type (``serve --help`` shows the flags in
# groups of the same names: cli/serve.py).
SECTIONS: dict[str, Any] = {
    "upstream": UpstreamConfig,
    "encoders": EncodersConfig,
    "media": MediaConfig,
    "policies": RoutingConfig,
    "lora": LoraConfig,
    "kv_events": KvEventsConfig,
    "multi_turn": MultiTurnConfig,
    "health": HealthConfig,
    "membership": MembershipConfig,
    "admission": AdmissionConfig,
    "listener": ListenerConfig,
    "access": AccessConfig,
    "observability": ObservabilityConfig,
    "store": StateStoreConfig,
}
# Every section field by its name: the section holding it.
SECTION_OF: dict[str, str] = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """How a ``serve`` process runs, beside what it proxies (``ProxyConfig``): where it
    listens, how many processes share the port, how much it logs. The flags' defaults."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1  # processes sharing the port (SO_REUSEPORT)
    log_level: str = "info"  # one of LOG_LEVELS

    def problems(self) -> list[str]:
        """What cannot work, one line each (empty: fine). A port beyond 65535 would be taken
        modulo 65536 by the socket layer and a negative one fail obscurely, so both are refused."""
        errors: list[str] = []
        check_range(errors, "--port", self.port, 1, 65535)
        check_range(errors, "--workers", self.workers, 1)
        return errors


class _SectionFields:
    """The sections' fields as ``ProxyConfig`` attributes, declared for type checkers (the
    descriptors are set below; ``tests/test_config.py`` keeps this list in step)."""

    __slots__ = ()
    # upstream
    kv_connector: str
    decode_retries: int
    hedging: bool
    hedge_budget: float
    hedge_min_delay: float
    hedge_max_delay: float
    hedge_max_per_instance: int
    stream_migration: bool
    migration_limit: int
    upstream_api_key: str | None
    forward_headers: tuple[str, ...]
    upstream_keep_alive: float
    max_upstream_connections: int
    timeouts: StageTimeouts
    # encoders
    encoder_max_batch_size: int
    encoder_max_outstanding: int
    encoder_fallback: str
    rewrite: bool
    ec_consumer_zmq_addrs: list[str]
    ec_consumer_dp_size: int
    # media
    ignore_client_uuids: bool
    max_media_items: int
    allowed_media_schemes: tuple[str, ...]
    allowed_media_hosts: tuple[str, ...]
    # policies
    routing: str | None
    prefill_policy: str | None
    decode_policy: str | None
    encode_policy: str | None
    balance_abs: float
    balance_rel: float
    scrape_interval: float
    # lora
    lora_affinity: bool
    lora_sources: dict[str, str]
    lora_dir: str | None
    lora_load_timeout: float
    max_lora_loads: int
    # kv_events
    kv_events_port: int | None
    kv_index_max_blocks: int
    # multi_turn
    kv_reuse: bool
    kv_reuse_ttl: float
    kv_reuse_margin: float
    kv_reuse_max_held_tokens: int
    local_prefill_max_tokens: int
    local_prefill_max_streams: int
    # health
    probe_interval: float
    probe_timeout: float
    fail_threshold: int
    outlier_failure_percent: float
    outlier_min_requests: int
    outlier_interval: float
    ejection_time: float
    max_ejection_time: float
    max_ejection_percent: int
    # membership
    dynamic_registration: bool
    registration_allow: tuple[str, ...]
    evicted_ttl: float
    topology: str
    dns_interval: float
    dns_server: str | None
    allow_empty_roles: tuple[str, ...]
    # admission
    max_inflight: int
    queue_size: int
    queue_timeout: float
    max_inflight_per_role: dict[str, int]
    # listener
    max_body_size: int
    max_buffered_bytes: int
    max_connections: int
    header_timeout: float
    body_timeout: float
    shutdown_grace: float
    shutdown_timeout: float
    # access
    api_keys: tuple[str, ...]
    api_key_file: str | None
    cache_salt_per_key: bool
    admin_api_key: str | None
    protect_metrics: bool
    ssl_certfile: str | None
    ssl_keyfile: str | None
    # observability
    log_requests: bool
    access_log: bool
    log_format: str
    trusted_proxies: tuple[str, ...]
    metrics_max_models: int
    # store
    state_store: str
    state_store_password_file: str | None
    state_store_prefix: str
    state_store_timeout: float


@dataclass(slots=True, init=False)
class ProxyConfig(_SectionFields):
    """What the proxy serves and how. Built with sections, with section fields by name, or
    both (``ProxyConfig(decode=[...], kv_reuse=False)``); a field named twice is the name's."""

    encode: list[InstanceSpec] = field(default_factory=list)
    prefill: list[InstanceSpec] = field(default_factory=list)
    decode: list[InstanceSpec] = field(default_factory=list)
    # DNS discovery (docs/architecture.md, "Discovery and reload"): templates whose host is a DNS name.
    discover: list[InstanceSpec] = field(default_factory=list)
    # Tenants (docs/architecture.md, "Tenants"): the cluster file's [tenants] and [model_aliases]
    # tables as read from TOML; checked and read by tenants/ (table.py, aliases.py). Reloadable.
    tenants: dict | None = None
    model_aliases: dict | None = None
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    encoders: EncodersConfig = field(default_factory=EncodersConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    policies: RoutingConfig = field(default_factory=RoutingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    listener: ListenerConfig = field(default_factory=ListenerConfig)
    access: AccessConfig = field(default_factory=AccessConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    store: StateStoreConfig = field(default_factory=StateStoreConfig)

    def __init__(self, *, encode: list[InstanceSpec] | None = None, prefill: list[InstanceSpec] | None = None,
                 decode: list[InstanceSpec] | None = None, discover: list[InstanceSpec] | None = None,
                 tenants: dict | None = None, model_aliases: dict | None = None, **settings: Any) -> None:
        self.encode = [] if encode is None else encode
        self.prefill = [] if prefill is None else prefill
        self.decode = [] if decode is None else decode
        self.discover = [] if discover is None else discover
        self.tenants = tenants
        self.model_aliases = model_aliases
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            if name in SECTIONS:
                continue
            section = SECTION_OF.get(name)
            if section is None:
                raise TypeError(f"ProxyConfig() got an unexpected keyword argument {name!r}")
            by_section.setdefault(section, {})[name] = value
        for name, cls in SECTIONS.items():
            given = settings.get(name)
            if given is None:
                value = cls(**by_section.get(name, {}))
            elif not isinstance(given, cls):
                raise TypeError(f"ProxyConfig() {name} must be a {cls.__name__}, not {type(given).__name__}")
            else:
                value = dataclasses.replace(given, **by_section[name]) if name in by_section else given
            setattr(self, name, value)

    def validate(self) -> None:
        """Raise ``ConfigErrors`` naming every knob of this config that cannot work (the
        checks of what other modules own run beside them: ``api.app.validate_config``)."""
        errors = self.problems()
        if errors:
            raise ConfigErrors(errors)

    def problems(self) -> list[str]:
        """Every mistake in this config's own settings, one line each, naming the flag: each
        section's, then what spans sections or concerns the instances."""
        errors: list[str] = []
        add = errors.append
        membership, encoders = self.membership, self.encoders
        if not self.decode and not membership.dynamic_registration and not any(s.role == "decode"
                                                                               for s in self.discover):
            add(NO_DECODE)
        if membership.dynamic_registration and not (self.access.admin_api_key or membership.registration_allow):
            add("--dynamic-registration needs --admin-api-key (or $ADMIN_API_KEY) or "
                "--registration-allow CIDR: otherwise nothing may register")
        for name in SECTIONS:
            errors += getattr(self, name).problems()
        if encoders.ec_consumer_zmq_addrs:
            if self.prefill:
                add("--ec-consumer-zmq-addrs supports E+PD only (the consumer is decode)")
            want = len(self.decode) * encoders.ec_consumer_dp_size
            if len(encoders.ec_consumer_zmq_addrs) != want:
                add(f"--ec-consumer-zmq-addrs needs {want} addresses "
                    f"({len(self.decode)} decode x dp {encoders.ec_consumer_dp_size}), "
                    f"got {len(encoders.ec_consumer_zmq_addrs)}")
        roles: dict[str, str] = {}
        for role in ROLES:
            urls = [s.url for s in getattr(self, role)]
            dup = {u for u in urls if urls.count(u) > 1}
            if dup:
                add(f"{role} instance listed twice: {', '.join(sorted(dup))}")
            for url in dict.fromkeys(urls):
                if url in roles:
                    # One process serving both is one PD (or E+PD) instance: requests would
                    # otherwise prefill and decode on it twice over, through the KV connector.
                    add(f"{url} is given as both {roles[url]} and {role} instance: an instance has "
                        f"one role (one that prefills and decodes is given as --decode only)")
                else:
                    roles[url] = role
        return errors

    def policy_for(self, role: str) -> str:
        """The routing policy of a role: its own flag, else ``--routing``, else its default
        (decode without a prefill pool is PD: it prefills, so prefix affinity pays there). Decided
        at start: with an empty roster, from ``--topology`` (``auto`` counts as PD until a prefill
        is configured)."""
        policies = self.policies
        own = getattr(policies, f"{role}_policy")
        if own:
            return own
        if policies.routing:
            return policies.routing
        if role == "decode" and not self.prefill and self.membership.topology in ("auto", "PD", "E+PD"):
            return ROLE_POLICY_DEFAULTS["prefill"]
        return ROLE_POLICY_DEFAULTS[role]

    def replace(self, **changes: Any) -> ProxyConfig:
        """A copy with ``changes``: fields, sections, or section fields by name."""
        return dataclasses.replace(self, **changes)


for _name, _section in SECTION_OF.items():
    setattr(ProxyConfig, _name, property(attrgetter(f"{_section}.{_name}"),
                                         doc=f"``{_section}.{_name}``, read by its flag's name."))
del _name, _section
