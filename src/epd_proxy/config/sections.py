"""The proxy's settings, one dataclass per concern; each checks its own values.

A field is named as its ``serve`` flag's destination and its cluster-file key
(``kv_reuse_ttl`` is ``--kv-reuse-ttl`` and ``kv_reuse_ttl = 480``), except where
``cli/serve.py`` says otherwise; every default is here and nowhere else.
``problems()`` returns every mistake of the concern's own values, one line each, naming the
flag. What depends on two concerns is checked by ``ProxyConfig`` (``proxy.py``); what
another module owns is checked beside it (the policy names in ``routing/``, the DNS server
in ``instances/discovery.py``, the media hosts in ``encode/media_policy.py``, the connector
in ``request/legs/connectors.py``: ``api.app.validate_config`` gathers them).
"""

from __future__ import annotations

import difflib
import ipaddress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from epd_proxy.config.checks import check_range
from epd_proxy.config.instances import ROLES

# --encoder-fallback: an item no encoder can take fails the request, or goes raw to the consumer.
ENCODER_FALLBACKS = ("none", "local")
# What the roster may be: inferred from what registered ("auto"), or pinned.
TOPOLOGIES = ("auto", "PD", "E+PD", "P+D", "E+P+D")
LOG_FORMATS = ("text", "json")
# Client headers every stage gets (trace context), whatever --forward-header adds.
ALWAYS_FORWARDED = ("traceparent", "tracestate")


def _ranges(errors: list[str], checks: tuple[tuple[str, float, float, bool], ...]) -> None:
    """(flag, value, lowest, exclusive) for every number a flag sets."""
    for flag, value, low, above in checks:
        check_range(errors, flag, value, low, above=above)


def _networks(errors: list[str], flag: str, cidrs: tuple[str, ...]) -> None:
    for cidr in cidrs:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            errors.append(f"{flag} {cidr!r}: not a network (e.g. 10.0.0.0/8)")


@dataclass(slots=True)
class StageTimeouts:
    """Bounds on every wait, in seconds (stage waits end in a 504).

    Stage defaults follow what each call does on vLLM (docs/architecture.md,
    "Overload, deadlines and shutdown"): an encoder call is short, a prefill is one
    forward pass over the prompt plus its queueing, decode's first event in push
    mode waits for that prefill. ``first_byte`` bounds the whole pre-commit phase
    (every stage and retry) of one request; 0 turns it off.
    """

    connect: float = 5.0
    encode: float = 10.0  # one image's sub-request; others scale it (encoder_plan.sub_request_timeout)
    prefill: float = 120.0  # until prefill's whole answer
    decode_first: float = 120.0  # until decode's headers and first event
    stream_idle: float = 600.0  # longest silence inside decode's stream
    first_byte: float = 180.0  # from the request's admission to its status line

    def problems(self) -> list[str]:
        errors: list[str] = []
        _ranges(errors, (
            ("--connect-timeout", self.connect, 0, True),
            ("--encode-timeout", self.encode, 0, True),
            ("--prefill-timeout", self.prefill, 0, True),
            ("--decode-timeout", self.decode_first, 0, True),
            ("--stream-idle-timeout", self.stream_idle, 0, True),
            ("--first-byte-timeout", self.first_byte, 0, False),
        ))
        return errors


# Headers --forward-header may not copy from a client to the backends: hop-by-hop headers
# (RFC 9110 §7.6.1) and framing, which describe one connection, not the request; and the
# headers the proxy writes itself, which would reach a backend twice.
REFUSED_FORWARD_HEADERS = {
    "connection": "hop-by-hop",
    "keep-alive": "hop-by-hop",
    "proxy-connection": "hop-by-hop",
    "te": "hop-by-hop",
    "trailer": "hop-by-hop",
    "upgrade": "hop-by-hop",
    "proxy-authorization": "hop-by-hop (credentials for this proxy's hop)",
    "proxy-authenticate": "hop-by-hop",
    "transfer-encoding": "message framing",
    "content-length": "message framing",
    "content-encoding": "message framing (the proxy sends a re-encoded JSON body)",
    "expect": "message framing",
    "host": "set by the proxy for each backend",
    "content-type": "set by the proxy",
    "x-request-id": "set by the proxy (the client's, if valid, is passed on already)",
    "x-data-parallel-rank": "set by the proxy (it routes to a data-parallel replica)",
}
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz")


def check_forward_headers(names, upstream_api_key: str | None) -> None:
    """Raise ValueError for a --forward-header the proxy must not copy to backends."""
    for name in names:
        low = name.strip().lower()
        if not low or not set(low) <= _TOKEN_CHARS:
            raise ValueError(f"--forward-header {name!r} is not a valid header name")
        why = REFUSED_FORWARD_HEADERS.get(low)
        if why:
            raise ValueError(f"--forward-header {name!r} is refused: {why}")
        if low == "authorization" and upstream_api_key:
            raise ValueError("--forward-header authorization cannot be combined with --upstream-api-key: "
                             "backends would get two Authorization headers")


@dataclass(slots=True)
class UpstreamConfig:
    """How the proxy calls the instances: the KV connector joining P and D, retries, the
    credentials and headers every stage gets, its connections, and every wait's bound."""

    kv_connector: str = "nixl"  # its name is checked beside the connectors (request/legs/connectors.py)
    decode_retries: int = 1
    # Hedged prefills and encoder calls (docs/architecture.md, "Hedging"): one that has not
    # answered within the p95 of its recent answers (bounded by the two delays) gets a second
    # attempt on the placement's next alternative; at most hedge_budget percent of a role's
    # calls are hedged, at most hedge_max_per_instance hedges in flight to one instance.
    hedging: bool = True
    hedge_budget: float = 5.0
    hedge_min_delay: float = 0.1
    hedge_max_delay: float = 2.0
    hedge_max_per_instance: int = 4
    # A committed chat or completions stream whose decode breaks off is continued on another
    # decode (request/migration.py), at most this many times per request.
    stream_migration: bool = True
    migration_limit: int = 2
    upstream_api_key: str | None = None
    forward_headers: tuple[str, ...] = ALWAYS_FORWARDED  # and those --forward-header names
    # vLLM closes idle keep-alive connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    # (5 s); the pool retires them well before.
    upstream_keep_alive: float = 5.0
    # Concurrent connections to one instance (in use or idle); more requests wait in line.
    max_upstream_connections: int = 1024
    timeouts: StageTimeouts = field(default_factory=StageTimeouts)

    def problems(self) -> list[str]:
        errors: list[str] = []
        _ranges(errors, (
            ("--decode-retries", self.decode_retries, 0, False),
            ("--hedge-budget", self.hedge_budget, 0, False),
            ("--hedge-min-delay", self.hedge_min_delay, 0, True),
            ("--hedge-max-delay", self.hedge_max_delay, 0, True),
            ("--hedge-max-per-instance", self.hedge_max_per_instance, 0, False),
            ("--migration-limit", self.migration_limit, 0, False),
            ("--max-upstream-connections", self.max_upstream_connections, 1, False),
            ("--upstream-keep-alive", self.upstream_keep_alive, 0, False),
        ))
        errors += self.timeouts.problems()
        for name in self.forward_headers:
            try:
                check_forward_headers([name], self.upstream_api_key)
            except ValueError as exc:
                errors.append(str(exc))
        return errors


@dataclass(slots=True)
class EncodersConfig:
    """The encode stage (docs/architecture.md, "The encode stage"): batching, what one encoder
    may hold, the fallback, the rewrite to ``*_embeds``, and E+PD's push consumers."""

    encoder_max_batch_size: int = 0
    # Media items this process keeps in flight to one encoder; more wait in the proxy, up to
    # the encode timeout. 0 = no bound.
    encoder_max_outstanding: int = 64
    # What to do with an item no encoder can take: "none" fails the request, "local" sends
    # the raw media to the consumer, which encodes it itself.
    encoder_fallback: str = "none"
    rewrite: bool = True
    ec_consumer_zmq_addrs: list[str] = field(default_factory=list)
    ec_consumer_dp_size: int = 1

    def problems(self) -> list[str]:
        errors: list[str] = []
        _ranges(errors, (
            ("--encoder-max-batch-size", self.encoder_max_batch_size, 0, False),
            ("--encoder-max-outstanding", self.encoder_max_outstanding, 0, False),
            ("--ec-consumer-dp-size", self.ec_consumer_dp_size, 1, False),
        ))
        if self.encoder_fallback not in ENCODER_FALLBACKS:
            errors.append(f"--encoder-fallback must be one of {', '.join(ENCODER_FALLBACKS)}, "
                          f"not {self.encoder_fallback!r}")
        return errors


@dataclass(slots=True)
class MediaConfig:
    """The trust boundary's media half (docs/architecture.md): what a client's body may ask
    for. The hosts are checked beside the policy that parses them (encode/media_policy.py)."""

    ignore_client_uuids: bool = False  # use content-derived keys even when a client sends a uuid
    # Media parts per request, all modalities together; vLLM's --limit-mm-per-prompt
    # defaults to 999 per modality.
    max_media_items: int = 999
    allowed_media_schemes: tuple[str, ...] = ("http", "https", "data")
    # Hosts or networks media URLs may name even when they are loopback, private, link-local...
    allowed_media_hosts: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        errors: list[str] = []
        check_range(errors, "--max-media-items", self.max_media_items, 0)
        return errors


@dataclass(slots=True)
class RoutingConfig:
    """Routing (docs/architecture.md, "Routing"): a policy per role (None = ``routing`` if set,
    else the role's default, ``ProxyConfig.policy_for``), cache-aware's load bound, and the
    load signals' scrape. The names and the bound are checked beside the policies
    (``routing.check_config``)."""

    routing: str | None = None
    prefill_policy: str | None = None
    decode_policy: str | None = None
    encode_policy: str | None = None
    balance_abs: float = 4.0  # cache-aware passes over an instance loaded beyond the least loaded + this ...
    balance_rel: float = 1.5  # ... and beyond the least loaded x this
    scrape_interval: float = 1.0  # the background /metrics scrape of load signals (0 = off)

    def problems(self) -> list[str]:
        errors: list[str] = []
        check_range(errors, "--scrape-interval", self.scrape_interval, 0)
        return errors


@dataclass(slots=True)
class LoraConfig:
    """LoRA adapters (docs/architecture.md, "LoRA adapters"): an adapter's requests placed with
    affinity (routing/lora_affinity.py); where an adapter no instance has may be loaded from
    (name -> path as the instances see it, and a directory of adapters by name, as vLLM's
    filesystem resolver's VLLM_LORA_RESOLVER_CACHE_DIR); a load's bound, and loads at once."""

    lora_affinity: bool = True
    lora_sources: dict[str, str] = field(default_factory=dict)
    lora_dir: str | None = None
    lora_load_timeout: float = 30.0
    max_lora_loads: int = 4

    def problems(self) -> list[str]:
        errors: list[str] = []
        _ranges(errors, (
            ("--lora-load-timeout", self.lora_load_timeout, 0, True),
            ("--max-lora-loads", self.max_lora_loads, 1, False),
        ))
        for name, path in self.lora_sources.items():
            if not name or "/" in name or name in (".", "..") or not path:
                errors.append(f"--lora-source {name}={path}: expected NAME=PATH with a name without '/'")
        return errors


@dataclass(slots=True)
class KvEventsConfig:
    """vLLM's KV cache events (docs/architecture.md, "KV events and the block index"): the port
    every prefill/decode instance without its own ``kv_events`` attribute publishes on (its
    replay socket on the next port); None = only instances that name theirs. The block
    index's bound, in (instance, block) pairs."""

    kv_events_port: int | None = None
    kv_index_max_blocks: int = 1_000_000

    def problems(self) -> list[str]:
        errors: list[str] = []
        if self.kv_events_port is not None and not 1 <= self.kv_events_port <= 65534:
            errors.append(f"--kv-events-port must be in 1..65534 (its replay socket is on the next port), "
                          f"not {self.kv_events_port}")
        if self.kv_index_max_blocks < 1:
            errors.append(f"--kv-index-max-blocks must be >= 1, not {self.kv_index_max_blocks}")
        return errors


@dataclass(slots=True)
class MultiTurnConfig:
    """Multi-turn KV reuse (docs/architecture.md, "Multi-turn KV reuse"): on when decode answers
    with kv_transfer_params (vLLM's bidirectional_kv_xfer); --no-kv-reuse turns it off. And
    when a turn's prefill is left to the decode that holds the rest of its prompt."""

    kv_reuse: bool = True
    kv_reuse_ttl: float = 480.0  # decode's decoder_kv_blocks_ttl (vLLM's default)
    kv_reuse_margin: float = 15.0  # parameters are used only until TTL - margin after receipt
    kv_reuse_max_held_tokens: int = 262144  # per decode, what kept parameters hold (0 = no bound)
    # A turn whose prefill would compute at most this many tokens goes to the decode that
    # holds the rest of its prompt, alone (0 = never) ...
    local_prefill_max_tokens: int = 64
    # ... when that decode runs at most this many other requests: a local prefill lengthens
    # the steps of every stream batched with it (docs/benchmarks.md, "multiturn").
    local_prefill_max_streams: int = 0

    def problems(self) -> list[str]:
        errors: list[str] = []
        _ranges(errors, (
            ("--kv-reuse-ttl", self.kv_reuse_ttl, 0, True),
            ("--kv-reuse-margin", self.kv_reuse_margin, 0, False),
            ("--kv-reuse-max-held-tokens", self.kv_reuse_max_held_tokens, 0, False),
            ("--local-prefill-max-tokens", self.local_prefill_max_tokens, 0, False),
            ("--local-prefill-max-streams", self.local_prefill_max_streams, 0, False),
        ))
        return errors


@dataclass(slots=True)
class HealthConfig:
    """Probes and outlier detection (docs/architecture.md, "Health: ejection, panic routing and
    recovery"); ``instances.health.OutlierSettings`` is read from here."""

    probe_interval: float = 5.0
    probe_timeout: float = 2.0
    fail_threshold: int = 3
    outlier_failure_percent: float = 85.0  # request failures (HTTP 500) that eject, in % ...
    outlier_min_requests: int = 20  # ... of at least this many requests ...
    outlier_interval: float = 10.0  # ... within this many seconds of the first failure
    ejection_time: float = 10.0  # base ejection time, times the number of ejections in a row
    max_ejection_time: float = 300.0
    max_ejection_percent: int = 50  # of a role, by passive signals (rounded down)

    def problems(self) -> list[str]:
        errors: list[str] = []
        _ranges(errors, (
            ("--probe-interval", self.probe_interval, 0, False),
            ("--probe-timeout", self.probe_timeout, 0, True),
            ("--fail-threshold", self.fail_threshold, 1, False),
            ("--outlier-min-requests", self.outlier_min_requests, 1, False),
            ("--outlier-interval", self.outlier_interval, 0, True),
            ("--ejection-time", self.ejection_time, 0, True),
        ))
        check_range(errors, "--outlier-failure-percent", self.outlier_failure_percent, 0, above=True)
        if self.outlier_failure_percent > 100:
            errors.append(f"--outlier-failure-percent must be in (0, 100], not {self.outlier_failure_percent:g}")
        check_range(errors, "--max-ejection-percent", self.max_ejection_percent, 0, 100)
        check_range(errors, "--max-ejection-time", self.max_ejection_time)
        if self.ejection_time > 0 and self.max_ejection_time < self.ejection_time:
            errors.append(f"--max-ejection-time must be >= --ejection-time ({self.ejection_time:g}), "
                          f"not {self.max_ejection_time:g}")
        return errors


@dataclass(slots=True)
class MembershipConfig:
    """Membership and discovery (docs/architecture.md, "Membership", "Discovery and reload"):
    registration at run time, who may register without a key, how long an instance out of
    rotation is remembered, a pinned topology, and DNS names' re-resolution. The DNS server is
    checked beside the resolver (``instances.discovery.check_config``)."""

    dynamic_registration: bool = False  # may start with no instance; they register at run time
    registration_allow: tuple[str, ...] = ()  # CIDRs that may register without a key
    evicted_ttl: float = 900.0  # an instance out of rotation this long is forgotten (0 = never)
    topology: str = "auto"  # or pinned: PD, E+PD, P+D, E+P+D
    dns_interval: float = 10.0  # longest wait between re-resolutions (a shorter TTL is honoured)
    dns_server: str | None = None  # HOST:PORT; None = the system's resolver
    # Roles a reload may leave with no instance (runtime/reload.py); any other is never emptied by one.
    allow_empty_roles: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        errors: list[str] = []
        for role in self.allow_empty_roles:
            if role not in ROLES:
                close = difflib.get_close_matches(role, ROLES, n=1)
                errors.append(f"--allow-empty-roles {role!r}: not a role"
                              + (f" (did you mean {close[0]!r}?)" if close else f" ({', '.join(ROLES)})"))
        if self.topology not in TOPOLOGIES:
            errors.append(f"--topology must be one of {', '.join(TOPOLOGIES)}, not {self.topology!r}")
        _networks(errors, "--registration-allow", self.registration_allow)
        _ranges(errors, (
            ("--dns-interval", self.dns_interval, 0, True),
            ("--evicted-ttl", self.evicted_ttl, 0, False),
        ))
        return errors


@dataclass(slots=True)
class AdmissionConfig:
    """Admission control (request/admission.py): 0 = unlimited; see docs/architecture.md."""

    max_inflight: int = 0
    queue_size: int = 0
    queue_timeout: float = 10.0
    max_inflight_per_role: dict[str, int] = field(default_factory=dict)  # encode/prefill -> cap (0 = none)

    def problems(self) -> list[str]:
        errors: list[str] = []
        _ranges(errors, (
            ("--max-inflight", self.max_inflight, 0, False),
            ("--queue-size", self.queue_size, 0, False),
            ("--queue-timeout", self.queue_timeout, 0, False),
        ))
        for role, n in self.max_inflight_per_role.items():
            if role not in ("encode", "prefill") or n < 0:
                errors.append(f"--max-inflight-per-role {role}={n}: the role must be encode or prefill "
                              f"(decode's cap is --max-inflight) and the cap >= 0")
        return errors


@dataclass(slots=True)
class ListenerConfig:
    """The front door (http/server.py): what one client may send and how slowly, how much all
    of them together may hold; and the graceful shutdown (runtime/running.py): /ready is 503
    and the listener open for the grace period, then in-flight requests finish until
    ``shutdown_timeout`` (from the signal)."""

    max_body_size: int = 64 * 1024 * 1024  # one request body (413 beyond)
    max_buffered_bytes: int = 512 * 1024 * 1024  # request bodies held at once (503 beyond)
    max_connections: int = 0  # client connections; 0 = derived from RLIMIT_NOFILE at start-up
    header_timeout: float = 10.0  # a request's first byte to the end of its head (408)
    body_timeout: float = 60.0  # the end of the head to the end of the body (408)
    shutdown_grace: float = 5.0
    shutdown_timeout: float = 25.0

    def problems(self) -> list[str]:
        errors: list[str] = []
        _ranges(errors, (
            ("--max-body-size", self.max_body_size, 0, False),
            ("--max-buffered-bytes", self.max_buffered_bytes, 0, False),
            ("--max-connections", self.max_connections, 0, False),
            ("--header-timeout", self.header_timeout, 0, False),
            ("--body-timeout", self.body_timeout, 0, False),
            ("--shutdown-grace", self.shutdown_grace, 0, False),
            ("--shutdown-timeout", self.shutdown_timeout, 0, False),
        ))
        return errors


@dataclass(slots=True)
class AccessConfig:
    """Access and TLS (docs/architecture.md, "Access and TLS"): the clients' keys, the
    operator's key, and the listener's certificate. The key file is read beside its use
    (``api.client_auth.ClientKeys``)."""

    api_keys: tuple[str, ...] = ()  # client keys ("Authorization: Bearer") on every path but probes (none: open)
    api_key_file: str | None = None  # more keys, one per line, read again on SIGHUP
    # With client keys: vLLM's cache_salt set from each key's scope on chat and completions, so
    # no key's requests share (or can probe) another key's prefix cache (tenants/key_scope.py).
    cache_salt_per_key: bool = False
    admin_api_key: str | None = None  # X-API-Key for roster changes, /instances, /status, profiling
    protect_metrics: bool = False  # /metrics needs the admin key
    ssl_certfile: str | None = None  # the listener speaks TLS with this certificate (PEM) ...
    ssl_keyfile: str | None = None  # ... and this private key (PEM; default: in the certificate file)

    def problems(self) -> list[str]:
        errors: list[str] = []
        if self.protect_metrics and not self.admin_api_key:
            errors.append("--protect-metrics needs --admin-api-key (or $ADMIN_API_KEY)")
        if self.cache_salt_per_key and not (self.api_keys or self.api_key_file):
            errors.append("--cache-salt-per-key needs client keys (--api-key or --api-key-file): it salts each "
                          "key's prefix cache, and without keys there is none")
        if self.ssl_keyfile and not self.ssl_certfile:
            errors.append("--ssl-keyfile needs --ssl-certfile")
        return errors


@dataclass(slots=True)
class ObservabilityConfig:
    """Logs and metrics (observe/): a line per request at INFO and the format of every line,
    the access log's client behind trusted proxies, and per-model metric labels."""

    log_requests: bool = False
    access_log: bool = True
    log_format: str = "text"  # or "json"
    # The access log's client: X-Forwarded-For's when the peer is one of these (CIDRs).
    trusted_proxies: tuple[str, ...] = ()
    metrics_max_models: int = 32  # per-model metric labels (adapters included) per process; later: "other"

    def problems(self) -> list[str]:
        errors: list[str] = []
        if self.log_format not in LOG_FORMATS:
            errors.append(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
        _networks(errors, "--trusted-proxies", self.trusted_proxies)
        check_range(errors, "--metrics-max-models", self.metrics_max_models, 1)
        return errors


@dataclass(slots=True)
class StateStoreConfig:
    """The shared state store (docs/architecture.md, "What is known, and where it lives"):
    redis://host:port/db or rediss:// (Redis or Valkey); none: this process's memory (with
    --workers, the parent's). The password from the file or $EPD_PROXY_STATE_STORE_PASSWORD."""

    state_store: str = ""
    state_store_password_file: str | None = None
    state_store_prefix: str = "epd-proxy:"  # every key's prefix (several proxies may share one server)
    state_store_timeout: float = 0.05  # seconds a call may take before it counts as failed

    def problems(self) -> list[str]:
        errors: list[str] = []
        if self.state_store:
            parts = urlsplit(self.state_store)
            if parts.scheme not in ("redis", "rediss") or not parts.hostname:
                errors.append(f"--state-store must be redis://HOST:PORT/DB or rediss://..., "
                              f"not {self.state_store!r}")
            elif parts.password:
                errors.append("--state-store: no password in the URL; use --state-store-password-file or "
                              "$EPD_PROXY_STATE_STORE_PASSWORD")
        check_range(errors, "--state-store-timeout", self.state_store_timeout, 0, above=True)
        return errors
