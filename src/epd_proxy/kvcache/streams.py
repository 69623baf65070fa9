"""Where an instance publishes its KV cache events, as the proxy reaches it.

vLLM binds its publisher where ``--kv-events-config`` says (``"endpoint": "tcp://*:5557"``,
``"replay_endpoint": "tcp://*:5558"``); the proxy connects to the instance's address on
those ports. An instance names them in its attributes (``;kv_events=tcp://p1:5557``,
``;kv_events_replay=tcp://p1:5558``, also in the cluster file and a registration's fields);
otherwise ``--kv-events-port`` gives the port every instance uses (the natural setup of a
Deployment whose pods share one command line, DNS-discovered pods included), with the
replay socket on the next port, as in vLLM's own examples. Data-parallel ranks publish on
the ports plus the rank (vLLM's ``offset_endpoint_port``): one stream per rank. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from epd_proxy.config import InstanceSpec


@dataclass(frozen=True, slots=True)
class Stream:
    """One event stream: one engine (a data-parallel rank) of one instance."""

    name: str  # the index's source: the instance's URL, ``URL#dpN`` for rank N > 0
    url: str  # the instance
    endpoint: str  # its PUB socket
    replay: str | None  # its replay ROUTER socket (None: gaps cannot be repaired)
    rank: int = 0


def streams_of(spec: InstanceSpec, default_port: int | None) -> list[Stream]:
    """The event streams of an instance (none: it names none and no default applies;
    encoders hold no KV blocks)."""
    if spec.role == "encode" or spec.kv_events == "none":
        return []
    endpoint = spec.kv_events
    replay = spec.kv_events_replay
    if endpoint is None:
        if default_port is None or not spec.host:
            return []
        host = f"[{spec.host}]" if ":" in spec.host else spec.host
        endpoint = f"tcp://{host}:{default_port}"
    if replay is None:
        replay = offset(endpoint, 1) if endpoint.startswith("tcp://") else None
    elif replay == "none":
        replay = None
    out = []
    for rank in range(max(1, spec.dp_size)):
        out.append(Stream(spec.url if rank == 0 else f"{spec.url}#dp{rank}", spec.url, offset(endpoint, rank),
                          None if replay is None else offset(replay, rank), rank))
    return out


def instance_of(source: str) -> str:
    """The instance URL of an index source (a rank's stream belongs to its instance)."""
    cut = source.find("#dp")
    return source if cut < 0 else source[:cut]


def offset(endpoint: str, n: int) -> str:
    """``endpoint`` with its TCP port moved up by ``n`` (other schemes get ``_dpN``)."""
    if not n:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + n}"
    return f"{endpoint}_dp{n}"
