"""What an operator configures: the instances of each role and the proxy's knobs.

An instance is a URL with optional ``;key=value`` attributes, e.g.::

    http://p1:8100;engine_id=prefill-0;kv_host=10.0.0.1;kv_port=5600;tp=1;pp=1

The attributes carry what a KV connector must know about an instance before
it answers (push mode dispatches decode before prefill has said anything).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ROLES = ("encode", "prefill", "decode")

_INT_ATTRS = {"kv_port", "tp", "pp", "bootstrap_port", "dp_size"}
_KNOWN_ATTRS = {"engine_id", "kv_host"} | _INT_ATTRS


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

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""


def parse_instance(text: str, role: str) -> InstanceSpec:
    """Parse ``URL[;key=value...]``; raise ValueError with a message an operator can act on."""
    parts = [p.strip() for p in text.split(";") if p.strip()]
    if not parts:
        raise ValueError(f"empty {role} instance")
    url = parts[0]
    if "://" not in url:
        url = "http://" + url
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"{role} instance {text!r}: expected http://host:port")
    try:
        u.port
    except ValueError:
        raise ValueError(f"{role} instance {text!r}: invalid port") from None
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
        else:
            attrs[key] = value
    return InstanceSpec(url=url.rstrip("/"), role=role, **attrs)  # type: ignore[arg-type]


def split_instances(values: list[str] | None) -> list[str]:
    """Flags are repeatable and comma-separated; ``none``/``disable`` mean no instances."""
    out: list[str] = []
    for value in values or []:
        for piece in value.split(","):
            piece = piece.strip()
            if piece and piece.lower() not in ("none", "disable", "disabled"):
                out.append(piece)
    return out


@dataclass(slots=True)
class Timeouts:
    """Bounds on every wait, in seconds (stage waits end in a 504)."""

    connect: float = 5.0
    encode: float = 300.0
    prefill: float = 600.0  # until prefill's whole answer
    decode_first: float = 600.0  # until decode's headers and first event
    stream_idle: float = 600.0  # longest silence inside decode's stream
    push_drain: float = 60.0  # push mode: prefill still running after decode ended


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
    encoder_max_batch_size: int = 0
    rewrite: bool = True
    ec_consumer_zmq_addrs: list[str] = field(default_factory=list)
    ec_consumer_dp_size: int = 1
    upstream_api_key: str | None = None
    forward_headers: tuple[str, ...] = ("traceparent", "tracestate")
    # vLLM closes idle keep-alive connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    # (5 s); the pool retires them well before.
    upstream_keep_alive: float = 5.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    probe_interval: float = 5.0
    probe_timeout: float = 2.0
    fail_threshold: int = 3
    routing: str = "least-loaded"
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

    def validate(self) -> None:
        if not self.decode:
            raise ValueError("at least one --decode instance is required")
        if self.decode_retries < 0:
            raise ValueError("--decode-retries must be >= 0")
        if self.encoder_max_batch_size < 0:
            raise ValueError("--encoder-max-batch-size must be >= 0")
        if self.max_media_items < 0:
            raise ValueError("--max-media-items must be >= 0")
        if self.max_upstream_connections < 1:
            raise ValueError("--max-upstream-connections must be >= 1")
        check_forward_headers(self.forward_headers, self.upstream_api_key)
        from .media_policy import MediaPolicy  # the policy parses the host list

        MediaPolicy(max_items=self.max_media_items, schemes=self.allowed_media_schemes,
                    allowed_hosts=self.allowed_media_hosts)
        if self.ec_consumer_dp_size < 1:
            raise ValueError("--ec-consumer-dp-size must be >= 1")
        if self.ec_consumer_zmq_addrs:
            if self.prefill:
                raise ValueError("--ec-consumer-zmq-addrs supports E+PD only (the consumer is decode)")
            want = len(self.decode) * self.ec_consumer_dp_size
            if len(self.ec_consumer_zmq_addrs) != want:
                raise ValueError(f"--ec-consumer-zmq-addrs needs {want} addresses "
                                 f"({len(self.decode)} decode x dp {self.ec_consumer_dp_size}), "
                                 f"got {len(self.ec_consumer_zmq_addrs)}")
        for role in ROLES:
            urls = [s.url for s in getattr(self, role)]
            dup = {u for u in urls if urls.count(u) > 1}
            if dup:
                raise ValueError(f"{role} instance listed twice: {', '.join(sorted(dup))}")

    def replace(self, **changes) -> "ProxyConfig":
        return dataclasses.replace(self, **changes)
