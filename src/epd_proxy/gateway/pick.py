"""The one seam between the endpoint picker's protocol and the proxy's placement.

``pick(view, known)`` answers, for one request the gateway asks about, the ordered endpoints
that may serve it whole (the first, then the ones the gateway's retries walk) and a short
reason for each. Everything the proxy knows reaches it through ``known``: the decode (or PD)
pool with its health, outliers, load signals, models and adapters; what the request brings
reaches it through ``view``: its routing keys (with KV events, the prefix each instance holds),
the model the serving instance must serve, and the gateway's subset hint. The picker around it
(``picker.py``) does the rest (tenants, aliases, the block index lookup) and the protocol
adapter (``ext_proc.py``) only translates. The proxy's own request path makes its first choice
through the same pool, so the endpoint picker and the proxy place a request alike.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit

from epd_proxy.instances.health import HEALTHY
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import ModelKey
from epd_proxy.instances.pool import InstancePool
from epd_proxy.routing.view import EMPTY_VIEW, RequestView

# Endpoints named per answer: the first and the fallbacks the gateway's retries walk.
DEFAULT_FALLBACKS = 3


@dataclasses.dataclass(frozen=True)
class PickView:
    """What one request brings to the decision."""

    routing: RequestView = EMPTY_VIEW  # its routing keys (``held``: the block index's answer)
    model: ModelKey | None = None  # what the serving instance must serve (None: any)
    subset: frozenset[str] | None = None  # the gateway's subset hint: only these ``ip:port``s


@dataclasses.dataclass(frozen=True)
class Known:
    """What the proxy knows that the decision reads."""

    serving: InstancePool  # the pool whose instances serve a request whole (decode or PD)
    endpoints: int = DEFAULT_FALLBACKS  # how many endpoints an answer names at most


@dataclasses.dataclass(frozen=True)
class Pick:
    """Ordered instances (empty: none eligible) and why each."""

    instances: tuple[Instance, ...]
    reasons: tuple[str, ...]

    @property
    def endpoints(self) -> list[str]:
        return [endpoint(i) for i in self.instances]


def pick(view: PickView, known: Known) -> Pick:
    """The instances for one request, best first; none when the subset hint leaves none the
    pool would route to. The first is the pool's own choice (health, half-open trials, panic
    routing, LoRA affinity, the policy over load and the block index), asked once as for the
    proxy's own requests (a policy's cursor moves once per request); the fallbacks are the
    other candidates, those holding more of the prompt first, then the least loaded."""
    pool = known.serving
    subset = view.subset
    excluded: set[Instance] = set()
    if subset is not None:
        excluded = {i for i in pool.instances if endpoint(i) not in subset}
    first = pool.choose(excluded, view.routing, view.model)
    if first in excluded:
        return Pick((), ())
    chosen = [first]
    reasons = [_reason(first, view.routing, pool.policy.name)]
    excluded.add(first)
    held = view.routing.held or {}
    rest = [i for i in pool.candidates(excluded, view.model) if i not in excluded]
    rest.sort(key=lambda i: (-held.get(i.url, 0), i.inflight + i.signals.others))
    for inst in rest[:known.endpoints - 1]:
        chosen.append(inst)
        reasons.append(_reason(inst, view.routing, "fallback"))
    return Pick(tuple(chosen), tuple(reasons))


def _reason(inst: Instance, routing: RequestView, why: str) -> str:
    held = routing.held
    parts = [why]
    if held is not None and routing.tokens:
        parts.append(f"holds {held.get(inst.url, 0)} of {routing.tokens} prompt tokens")
    if inst.health.state is not HEALTHY:
        parts.append(inst.health.state)
    return ", ".join(parts)


def endpoint(inst: Instance) -> str:
    """An instance's ``ip:port`` as the gateway names endpoints (IPv6 in brackets)."""
    parts = urlsplit(inst.url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
