"""The instances of each role as an operator gives them.

An instance is a URL with optional ``;key=value`` attributes, e.g.::

    http://p1:8100;engine_id=prefill-0;kv_host=10.0.0.1;kv_port=5600;tp=1;pp=1;models=a|b

The attributes carry what a KV connector must know about an instance before
it answers (push mode dispatches decode before prefill has said anything), and
which models it may be sent (``models``; otherwise what its /v1/models says).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from epd_proxy.config.checks import ConfigErrors

ROLES = ("encode", "prefill", "decode")

_INT_ATTRS = {"kv_port", "tp", "pp", "bootstrap_port", "dp_size"}
_KNOWN_ATTRS = {"engine_id", "kv_host", "models", "kv_events", "kv_events_replay"} | _INT_ATTRS


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
