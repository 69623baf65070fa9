"""What an operator configures: the instances of each role and the proxy's knobs.

An instance is a URL with optional ``;key=value`` attributes, e.g.::

    http://p1:8100;engine_id=prefill-0;kv_host=10.0.0.1;kv_port=5600;tp=1;pp=1;models=a|b

The attributes carry what a KV connector must know about an instance before
it answers (push mode dispatches decode before prefill has said anything), and
which models it may be sent (``models``; otherwise what its /v1/models says).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable
from urllib.parse import urlsplit

ROLES = ("encode", "prefill", "decode")
# --encoder-fallback: an item no encoder can take fails the request, or goes raw to the consumer.
ENCODER_FALLBACKS = ("none", "local")
# What the roster may be: inferred from what registered ("auto"), or pinned.
TOPOLOGIES = ("auto", "PD", "E+PD", "P+D", "E+P+D")

# The measured best routing policy per role (docs/architecture.md, "Routing").
ROLE_POLICY_DEFAULTS = {"encode": "cache-aware", "prefill": "cache-aware", "decode": "load-aware"}

_INT_ATTRS = {"kv_port", "tp", "pp", "bootstrap_port", "dp_size"}
_KNOWN_ATTRS = {"engine_id", "kv_host", "models", "kv_events", "kv_events_replay"} | _INT_ATTRS
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
# Client headers every stage gets (trace context), whatever --forward-header adds.
ALWAYS_FORWARDED = ("traceparent", "tracestate")


NO_DECODE = ("at least one --decode instance is required (or --dynamic-registration, or a dns+http:// "
             "decode instance)")


class ConfigErrors(ValueError):
    """Every mistake found in a configuration, not only the first: an operator fixes a
    file in one pass. ``errors`` holds one line each; the text joins them."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = list(errors)


def gather(checks: Iterable[Callable[[], object]]) -> None:
    """Run every check, then raise one ``ConfigErrors`` with what they all raised."""
    errors: list[str] = []
    for check in checks:
        try:
            check()
        except ConfigErrors as exc:
            errors.extend(exc.errors)
        except ValueError as exc:
            errors.append(str(exc))
    if errors:
        raise ConfigErrors(errors)


def check_range(errors: list[str], flag: str, value: float, low: float | None = None, high: float | None = None,
                *, above: bool = False) -> None:
    """Append why ``value`` of ``flag`` is out of range: ``low`` (exclusive when ``above``) to
    ``high``, and finite (a NaN passes every comparison, so it is named here)."""
    if isinstance(value, float) and not math.isfinite(value):
        errors.append(f"{flag} must be a finite number, not {value}")
    elif low is not None and high is not None and not low <= value <= high:
        errors.append(f"{flag} must be in {low}..{high}, not {value}")
    elif low is not None and high is None and (value <= low if above else value < low):
        errors.append(f"{flag} must be {'>' if above else '>='} {low:g}, not {value:g}")


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One vLLM instance as configured."""

    url: str
    role: str
    engine_id: str | None = None
    kv_host: str | None = None  # NIXL side-channel host (VLLM_NIXL_SIDE_CHANNEL_HOST)
    kv_port: int | None = None  # NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT)
    tp: int = 1
    pp: int = 1
    bootstrap_port: int | None = None  # Mooncake bootstrap (VLLM_MOONCAKE_BOOTSTRAP_PORT)
    dp_size: int = 1
    # Where an encoder pushes embeddings for this instance, one per DP replica (E+PD
    # with a push EC connector): from its registration, or --ec-consumer-zmq-addrs.
    ec_zmq_addrs: tuple[str, ...] = ()
    # Registered as ``prefill_decode``: one instance doing both (it routes as decode).
    pd: bool = False
    # The models it may serve (``;models=a|b``): routed only those, and of what its
    # /v1/models reports only those (and their adapters); () = whatever it reports.
    models: tuple[str, ...] = ()
    # Where it publishes vLLM's KV cache events (``;kv_events=tcp://host:5557``, its
    # ``--kv-events-config`` endpoint as reached from the proxy) and its replay socket
    # (``;kv_events_replay=tcp://host:5558``; default: the events port + 1; ``none``: no
    # replay). ``kv_events=none``: no events from it even with ``--kv-events-port``.
    kv_events: str | None = None
    kv_events_replay: str | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""


_SCHEME_TYPO = re.compile(r"(?i)(https?)(//|:/(?!/)|:(?![/\d])|;//)(.*)")


def url_mistake(text: str) -> str | None:
    """What is wrong with an instance's address ``text`` (before any ``;key=value``), said so an
    operator can fix it (``http//h:1`` lacks the ``:`` after its scheme: it is not host "http"
    with a path); None when its scheme, host and port are right (a path is ``parse_instance``'s
    to refuse). Pure."""
    typo = _SCHEME_TYPO.fullmatch(text)
    if typo is not None:
        scheme, sep, rest = typo.group(1).lower(), typo.group(2), typo.group(3).lstrip("/").split(";")[0]
        what = {"//": "no ':' after the scheme", ";//": "';' where the scheme's ':' belongs"}.get(
            sep, "the scheme needs '://'")
        return f"{what}: write {scheme}://{rest}"
    if text.startswith("://"):
        return f"no scheme before '://': write http{text}"
    if "://" not in text:
        text = "http://" + text
    u = urlsplit(text)
    if u.scheme not in ("http", "https"):
        where = u.netloc or "host:port"
        return f"the scheme {u.scheme!r} is not http or https: write http://{where}"
    if not u.hostname:
        return f"no host after {u.scheme}://: write {u.scheme}://host:port"
    try:
        u.port  # noqa: B018  (reading it checks the port)
    except ValueError:
        return "invalid port: write host:port, the port a number in 1..65535"
    return None


def parse_instance(text: str, role: str) -> InstanceSpec:
    """Parse ``URL[;key=value...]``; raise ValueError with a message an operator can act on."""
    if re.match(r"(?i)\s*https?;//", text):  # the scheme's ':' typed ';': no attribute follows
        raise ValueError(f"{role} instance {text!r}: {url_mistake(text.strip())}")
    parts = [p.strip() for p in text.split(";") if p.strip()]
    if not parts:
        raise ValueError(f"empty {role} instance")
    url = parts[0]
    mistake = url_mistake(url)
    if mistake is not None:
        raise ValueError(f"{role} instance {text!r}: {mistake}")
    if "://" not in url:
        url = "http://" + url
    u = urlsplit(url)
    if u.path not in ("", "/") or u.query or u.fragment:
        # Requests go to URL + /v1/...: a path would make every one of them vLLM's 404 while the
        # instance's probes still pass.
        raise ValueError(f"{role} instance {text!r}: give the instance's root, {u.scheme}://{u.netloc}, "
                         f"without a path (the proxy adds /v1/...)")
    attrs: dict[str, object] = {}
    for item in parts[1:]:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key == "tp_size":
            key = "tp"
        if key == "pp_size":
            key = "pp"
        if not sep or key not in _KNOWN_ATTRS:
            raise ValueError(f"{role} instance {text!r}: unknown attribute {item!r} "
                             f"(known: {', '.join(sorted(_KNOWN_ATTRS))})")
        value = value.strip()
        if key in _INT_ATTRS:
            try:
                attrs[key] = int(value)
            except ValueError:
                raise ValueError(f"{role} instance {text!r}: {key} must be an integer") from None
            low, high = (1, 65535) if key.endswith("port") else (1, 1 << 16)
            if not low <= attrs[key] <= high:  # type: ignore[operator]
                raise ValueError(f"{role} instance {text!r}: {key} must be in {low}..{high}, not {value}")
        elif key == "models":
            names = tuple(dict.fromkeys(n.strip() for n in re.split(r"[|,]", value) if n.strip()))
            if not names:
                raise ValueError(f"{role} instance {text!r}: models needs at least one name (models=a|b)")
            attrs[key] = names
        elif key in ("kv_events", "kv_events_replay"):
            attrs[key] = check_zmq_endpoint(value, f"{role} instance {text!r}: {key}")
        else:
            attrs[key] = value
    return InstanceSpec(url=url.rstrip("/"), role=role, **attrs)  # type: ignore[arg-type]


def check_zmq_endpoint(value: str, what: str) -> str:
    """A KV events endpoint as an instance attribute gives it: ``tcp://host:port`` (or
    ``ipc://path``), or ``none``; ValueError otherwise."""
    if value == "none":
        return value
    if value.startswith("ipc://") and len(value) > 6:
        return value
    u = urlsplit(value)
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme != "tcp" or not u.hostname or port is None or u.hostname == "*":
        raise ValueError(f"{what} must be tcp://host:port (the address the proxy connects to), "
                         f"ipc://path or none, not {value!r}")
    return value


DNS_PREFIX = "dns+"  # ``dns+http://NAME:PORT``: every address NAME resolves to is an instance


def split_discovered(texts: dict[str, list[str]], errors: list[str] | None = None
                     ) -> tuple[dict[str, list[InstanceSpec]], list[InstanceSpec]]:
    """Per role, the instances given by address, and the ``dns+`` ones (kept as templates
    whose host is re-resolved: discovery.py). An instance ``parse_instance`` refuses is left
    out and its message appended to ``errors``; without that list, ``ConfigErrors`` names
    every one of them."""
    static: dict[str, list[InstanceSpec]] = {}
    discover: list[InstanceSpec] = []
    found: list[str] = []
    for role, items in texts.items():
        static[role] = []
        for text in items:
            try:
                if text.strip().lower().startswith(DNS_PREFIX):
                    spec = parse_instance(text.strip()[len(DNS_PREFIX):], role)
                    if spec.engine_id or spec.kv_host:
                        raise ValueError(f"{role} instance {text!r}: engine_id and kv_host name one instance; "
                                         f"a DNS name stands for several")
                    discover.append(spec)
                else:
                    static[role].append(parse_instance(text, role))
            except ValueError as exc:
                found.append(str(exc))
    if errors is not None:
        errors.extend(found)
    elif found:
        raise ConfigErrors(found)
    return static, discover


def split_instances(values: list[str] | None) -> list[str]:
    """Flags are repeatable and comma-separated; ``none``/``disable`` mean no instances."""
    out: list[str] = []
    for value in values or []:
        for piece in value.split(","):
            piece = piece.strip()
            if out and _MODELS_LAST.search(out[-1]) and piece and not _INSTANCE_START.match(piece):
                out[-1] += "," + piece  # ``;models=a,b``: the comma is the list's, not a new instance
            elif piece and piece.lower() not in ("none", "disable", "disabled"):
                out.append(piece)
    return out


_MODELS_LAST = re.compile(r";\s*models\s*=[^;]*$")
_INSTANCE_START = re.compile(r"^([a-z+]+://|[\w.-]+:\d+($|[/;]))", re.IGNORECASE)


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
class ProxyConfig:
    encode: list[InstanceSpec] = field(default_factory=list)
    prefill: list[InstanceSpec] = field(default_factory=list)
    decode: list[InstanceSpec] = field(default_factory=list)
    kv_connector: str = "nixl"
    decode_retries: int = 1
    # A committed chat or completions stream whose decode breaks off is continued on another
    # decode (request/migration.py), at most this many times per request.
    stream_migration: bool = True
    migration_limit: int = 2
    encoder_max_batch_size: int = 0
    # Media items this process keeps in flight to one encoder; more wait in the proxy, up to
    # the encode timeout (docs/architecture.md, "The encode stage"). 0 = no bound.
    encoder_max_outstanding: int = 64
    # What to do with an item no encoder can take: "none" fails the request, "local" sends
    # the raw media to the consumer, which encodes it itself.
    encoder_fallback: str = "none"
    rewrite: bool = True
    ec_consumer_zmq_addrs: list[str] = field(default_factory=list)
    ec_consumer_dp_size: int = 1
    upstream_api_key: str | None = None
    forward_headers: tuple[str, ...] = ALWAYS_FORWARDED  # and those --forward-header names
    # vLLM closes idle keep-alive connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    # (5 s); the pool retires them well before.
    upstream_keep_alive: float = 5.0
    timeouts: StageTimeouts = field(default_factory=StageTimeouts)
    probe_interval: float = 5.0
    probe_timeout: float = 2.0
    fail_threshold: int = 3
    # Routing (docs/architecture.md, "Routing"): a policy per role; None = ``routing`` if set,
    # else the role's default (ROLE_POLICY_DEFAULTS).
    routing: str | None = None
    prefill_policy: str | None = None
    decode_policy: str | None = None
    encode_policy: str | None = None
    balance_abs: float = 4.0  # cache-aware passes over an instance loaded beyond the least loaded + this ...
    balance_rel: float = 1.5  # ... and beyond the least loaded x this
    scrape_interval: float = 1.0  # the background /metrics scrape of load signals (0 = off)
    # vLLM's KV cache events (docs/architecture.md, "KV events and the block index"): the port
    # every prefill/decode instance without its own ``kv_events`` attribute publishes on (its
    # replay socket on the next port); None = only instances that name theirs. The block
    # index's bound, in (instance, block) pairs.
    kv_events_port: int | None = None
    kv_index_max_blocks: int = 1_000_000
    # LoRA adapters (docs/architecture.md, "LoRA adapters"): an adapter's requests placed with
    # affinity (routing/lora_affinity.py); where an adapter no instance has may be loaded from
    # (name -> path as the instances see it, and a directory of adapters by name, as vLLM's
    # filesystem resolver's VLLM_LORA_RESOLVER_CACHE_DIR); a load's bound, and loads at once.
    lora_affinity: bool = True
    lora_sources: dict[str, str] = field(default_factory=dict)
    lora_dir: str | None = None
    lora_load_timeout: float = 30.0
    max_lora_loads: int = 4
    # Outlier detection (docs/architecture.md, "Health: ejection, panic routing and recovery").
    outlier_failure_percent: float = 85.0  # request failures (HTTP 500) that eject, in % ...
    outlier_min_requests: int = 20  # ... of at least this many requests ...
    outlier_interval: float = 10.0  # ... within this many seconds of the first failure
    ejection_time: float = 10.0  # base ejection time, times the number of ejections in a row
    max_ejection_time: float = 300.0
    max_ejection_percent: int = 50  # of a role, by passive signals (rounded down)
    # DNS discovery (docs/architecture.md, "Discovery and reload"): templates whose host is a DNS name.
    discover: list[InstanceSpec] = field(default_factory=list)
    dns_interval: float = 10.0  # longest wait between re-resolutions (a shorter TTL is honoured)
    dns_server: str | None = None  # HOST:PORT; None = the system's resolver
    # The front door (http/server.py): what one client may send and how slowly, and
    # how much all of them together may hold.
    max_body_size: int = 64 * 1024 * 1024  # one request body (413 beyond)
    max_buffered_bytes: int = 512 * 1024 * 1024  # request bodies held at once (503 beyond)
    max_connections: int = 0  # client connections; 0 = derived from RLIMIT_NOFILE at start-up
    header_timeout: float = 10.0  # a request's first byte to the end of its head (408)
    body_timeout: float = 60.0  # the end of the head to the end of the body (408)
    # Admission control (admission.py): 0 = unlimited; see docs/architecture.md.
    max_inflight: int = 0
    queue_size: int = 0
    queue_timeout: float = 10.0
    max_inflight_per_role: dict[str, int] = field(default_factory=dict)  # encode/prefill -> cap (0 = none)
    # Graceful shutdown (serve.py): /ready is 503 and the listener open for the grace
    # period, then in-flight requests finish until shutdown_timeout (from the signal).
    shutdown_grace: float = 5.0
    shutdown_timeout: float = 25.0
    # The trust boundary (docs/architecture.md): what a client's body may ask for.
    ignore_client_uuids: bool = False  # use content-derived keys even when a client sends a uuid
    # Media parts per request, all modalities together; vLLM's --limit-mm-per-prompt
    # defaults to 999 per modality.
    max_media_items: int = 999
    # Concurrent connections to one instance (in use or idle); more requests wait in line.
    max_upstream_connections: int = 1024
    allowed_media_schemes: tuple[str, ...] = ("http", "https", "data")
    # Hosts or networks media URLs may name even when they are loopback, private, link-local...
    allowed_media_hosts: tuple[str, ...] = ()
    # Membership (docs/architecture.md, "Membership").
    dynamic_registration: bool = False  # may start with no instance; they register at run time
    admin_api_key: str | None = None  # X-API-Key for roster changes, /instances, /status, profiling
    registration_allow: tuple[str, ...] = ()  # CIDRs that may register without a key
    evicted_ttl: float = 900.0  # an instance out of rotation this long is forgotten (0 = never)
    topology: str = "auto"  # or pinned: PD, E+PD, P+D, E+P+D
    log_requests: bool = False
    # Access and TLS (docs/architecture.md, "Access and TLS").
    api_keys: tuple[str, ...] = ()  # client keys ("Authorization: Bearer") on every path but probes (none: open)
    api_key_file: str | None = None  # more keys, one per line, read again on SIGHUP
    # With client keys: vLLM's cache_salt set from each key's scope on chat and completions, so
    # no key's requests share (or can probe) another key's prefix cache (tenants/key_scope.py).
    cache_salt_per_key: bool = False
    protect_metrics: bool = False  # /metrics needs the admin key
    ssl_certfile: str | None = None  # the listener speaks TLS with this certificate (PEM) ...
    ssl_keyfile: str | None = None  # ... and this private key (PEM; default: in the certificate file)
    # Logs (access_log.py): a line per request at INFO, and the format of every line.
    access_log: bool = True
    log_format: str = "text"  # or "json"
    # The access log's client: X-Forwarded-For's when the peer is one of these (CIDRs).
    trusted_proxies: tuple[str, ...] = ()
    metrics_max_models: int = 32  # per-model metric labels (adapters included) per process; later: "other"
    # Tenants (docs/architecture.md, "Tenants"): the cluster file's [tenants] and [model_aliases]
    # tables as read from TOML; checked and read by tenants/ (policy.py, aliases.py). Reloadable.
    tenants: dict | None = None
    model_aliases: dict | None = None
    # Multi-turn KV reuse (docs/architecture.md, "Multi-turn KV reuse"): on when decode answers
    # with kv_transfer_params (vLLM's bidirectional_kv_xfer); --no-kv-reuse turns it off.
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
    # The shared state store (docs/architecture.md, "What is known, and where it lives"):
    # redis://host:port/db or rediss:// (Redis or Valkey); none: this process's memory (with
    # --workers, the parent's). The password from the file or $EPD_PROXY_STATE_STORE_PASSWORD.
    state_store: str = ""
    state_store_password_file: str | None = None
    state_store_prefix: str = "epd-proxy:"  # every key's prefix (several proxies may share one server)
    state_store_timeout: float = 0.05  # seconds a call may take before it counts as failed

    def validate(self) -> None:
        """Raise ``ConfigErrors`` naming every knob of this config that cannot work (the
        checks of what other modules own run beside them: ``api.app.validate_config``)."""
        errors = self.problems()
        if errors:
            raise ConfigErrors(errors)

    def problems(self) -> list[str]:
        """Every mistake in this config's own knobs, one line each, naming the flag."""
        errors: list[str] = []
        add = errors.append
        if not self.decode and not self.dynamic_registration and not any(s.role == "decode"
                                                                         for s in self.discover):
            add(NO_DECODE)
        if self.dynamic_registration and not (self.admin_api_key or self.registration_allow):
            add("--dynamic-registration needs --admin-api-key (or $ADMIN_API_KEY) or "
                "--registration-allow CIDR: otherwise nothing may register")
        if self.kv_events_port is not None and not 1 <= self.kv_events_port <= 65534:
            add(f"--kv-events-port must be in 1..65534 (its replay socket is on the next port), "
                f"not {self.kv_events_port}")
        if self.kv_index_max_blocks < 1:
            add(f"--kv-index-max-blocks must be >= 1, not {self.kv_index_max_blocks}")
        if self.topology not in TOPOLOGIES:
            add(f"--topology must be one of {', '.join(TOPOLOGIES)}, not {self.topology!r}")
        for flag, cidrs in (("--registration-allow", self.registration_allow),
                            ("--trusted-proxies", self.trusted_proxies)):
            for cidr in cidrs:
                try:
                    ipaddress.ip_network(cidr, strict=False)
                except ValueError:
                    add(f"{flag} {cidr!r}: not a network (e.g. 10.0.0.0/8)")
        if self.state_store:
            parts = urlsplit(self.state_store)
            if parts.scheme not in ("redis", "rediss") or not parts.hostname:
                add(f"--state-store must be redis://HOST:PORT/DB or rediss://..., not {self.state_store!r}")
            elif parts.password:
                add("--state-store: no password in the URL; use --state-store-password-file or "
                    "$EPD_PROXY_STATE_STORE_PASSWORD")
        t = self.timeouts
        # (flag, value, lowest, exclusive): every number a flag sets.
        for flag, value, low, above in (
            ("--decode-retries", self.decode_retries, 0, False),
            ("--migration-limit", self.migration_limit, 0, False),
            ("--kv-reuse-ttl", self.kv_reuse_ttl, 0, True),
            ("--kv-reuse-margin", self.kv_reuse_margin, 0, False),
            ("--kv-reuse-max-held-tokens", self.kv_reuse_max_held_tokens, 0, False),
            ("--local-prefill-max-tokens", self.local_prefill_max_tokens, 0, False),
            ("--local-prefill-max-streams", self.local_prefill_max_streams, 0, False),
            ("--state-store-timeout", self.state_store_timeout, 0, True),
            ("--encoder-max-batch-size", self.encoder_max_batch_size, 0, False),
            ("--encoder-max-outstanding", self.encoder_max_outstanding, 0, False),
            ("--ec-consumer-dp-size", self.ec_consumer_dp_size, 1, False),
            ("--max-media-items", self.max_media_items, 0, False),
            ("--max-upstream-connections", self.max_upstream_connections, 1, False),
            ("--upstream-keep-alive", self.upstream_keep_alive, 0, False),
            ("--connect-timeout", t.connect, 0, True),
            ("--encode-timeout", t.encode, 0, True),
            ("--prefill-timeout", t.prefill, 0, True),
            ("--decode-timeout", t.decode_first, 0, True),
            ("--stream-idle-timeout", t.stream_idle, 0, True),
            ("--first-byte-timeout", t.first_byte, 0, False),
            ("--probe-interval", self.probe_interval, 0, False),
            ("--probe-timeout", self.probe_timeout, 0, True),
            ("--fail-threshold", self.fail_threshold, 1, False),
            ("--outlier-min-requests", self.outlier_min_requests, 1, False),
            ("--outlier-interval", self.outlier_interval, 0, True),
            ("--ejection-time", self.ejection_time, 0, True),
            ("--scrape-interval", self.scrape_interval, 0, False),
            ("--dns-interval", self.dns_interval, 0, True),
            ("--evicted-ttl", self.evicted_ttl, 0, False),
            ("--max-body-size", self.max_body_size, 0, False),
            ("--max-buffered-bytes", self.max_buffered_bytes, 0, False),
            ("--max-connections", self.max_connections, 0, False),
            ("--header-timeout", self.header_timeout, 0, False),
            ("--body-timeout", self.body_timeout, 0, False),
            ("--max-inflight", self.max_inflight, 0, False),
            ("--queue-size", self.queue_size, 0, False),
            ("--queue-timeout", self.queue_timeout, 0, False),
            ("--shutdown-grace", self.shutdown_grace, 0, False),
            ("--shutdown-timeout", self.shutdown_timeout, 0, False),
            ("--metrics-max-models", self.metrics_max_models, 1, False),
            ("--lora-load-timeout", self.lora_load_timeout, 0, True),
            ("--max-lora-loads", self.max_lora_loads, 1, False),
        ):
            check_range(errors, flag, value, low, above=above)
        check_range(errors, "--outlier-failure-percent", self.outlier_failure_percent, 0, above=True)
        if self.outlier_failure_percent > 100:
            add(f"--outlier-failure-percent must be in (0, 100], not {self.outlier_failure_percent:g}")
        check_range(errors, "--max-ejection-percent", self.max_ejection_percent, 0, 100)
        check_range(errors, "--max-ejection-time", self.max_ejection_time)
        if self.ejection_time > 0 and self.max_ejection_time < self.ejection_time:
            add(f"--max-ejection-time must be >= --ejection-time ({self.ejection_time:g}), "
                f"not {self.max_ejection_time:g}")
        for name in self.forward_headers:
            try:
                check_forward_headers([name], self.upstream_api_key)
            except ValueError as exc:
                add(str(exc))
        if self.encoder_fallback not in ENCODER_FALLBACKS:
            add(f"--encoder-fallback must be one of {', '.join(ENCODER_FALLBACKS)}, not {self.encoder_fallback!r}")
        if self.log_format not in LOG_FORMATS:
            add(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
        if self.ec_consumer_zmq_addrs:
            if self.prefill:
                add("--ec-consumer-zmq-addrs supports E+PD only (the consumer is decode)")
            want = len(self.decode) * self.ec_consumer_dp_size
            if len(self.ec_consumer_zmq_addrs) != want:
                add(f"--ec-consumer-zmq-addrs needs {want} addresses "
                    f"({len(self.decode)} decode x dp {self.ec_consumer_dp_size}), "
                    f"got {len(self.ec_consumer_zmq_addrs)}")
        for role, n in self.max_inflight_per_role.items():
            if role not in ("encode", "prefill") or n < 0:
                add(f"--max-inflight-per-role {role}={n}: the role must be encode or prefill "
                    f"(decode's cap is --max-inflight) and the cap >= 0")
        for name, path in self.lora_sources.items():
            if not name or "/" in name or name in (".", "..") or not path:
                add(f"--lora-source {name}={path}: expected NAME=PATH with a name without '/'")
        if self.protect_metrics and not self.admin_api_key:
            add("--protect-metrics needs --admin-api-key (or $ADMIN_API_KEY)")
        if self.cache_salt_per_key and not (self.api_keys or self.api_key_file):
            add("--cache-salt-per-key needs client keys (--api-key or --api-key-file): it salts each key's "
                "prefix cache, and without keys there is none")
        if self.ssl_keyfile and not self.ssl_certfile:
            add("--ssl-keyfile needs --ssl-certfile")
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
        own = getattr(self, f"{role}_policy")
        if own:
            return own
        if self.routing:
            return self.routing
        if role == "decode" and not self.prefill and self.topology in ("auto", "PD", "E+PD"):
            return ROLE_POLICY_DEFAULTS["prefill"]
        return ROLE_POLICY_DEFAULTS[role]

    def replace(self, **changes) -> "ProxyConfig":
        return dataclasses.replace(self, **changes)
