"""The one seam between the endpoint picker's protocol and the proxy's placement.

``pick(view, known)`` answers, for one request the gateway asks about, the ordered endpoints
of the pod that serves it (the first, then the ones the gateway's retries walk), the prefill
its decode-side sidecar runs first when the request is disaggregated (llm-d's
``x-prefiller-host-port``), and a short reason for each. Everything the proxy knows reaches it
through ``known``: the decode (or PD) and prefill pools with their health, outliers, load
signals, models and adapters, and the rule for a decode computing alone; what the request brings
reaches it through ``view``: its routing keys (with KV events, the prefix each instance holds),
the model the serving instance must serve, and the gateway's subset hint. The picker around it
(``picker.py``) does the rest (tenants, aliases, the block index lookup) and the protocol
adapter (``ext_proc.py``) only translates. The proxy's own request path makes its first choice
through the same pool, so the endpoint picker and the proxy place a request alike.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence
from urllib.parse import urlsplit

from epd_proxy.encode.multimodal import MediaItem
from epd_proxy.instances.health import HEALTHY
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import ModelKey, paired_key
from epd_proxy.instances.pool import InstancePool
from epd_proxy.routing.disaggregation import decode_alone
from epd_proxy.routing.view import EMPTY_VIEW, RequestView

# Endpoints named per answer: the first and the fallbacks the gateway's retries walk.
DEFAULT_FALLBACKS = 3


@dataclasses.dataclass(frozen=True)
class PickView:
    """What one request brings to the decision."""

    routing: RequestView = EMPTY_VIEW  # its routing keys (``held``: the block index's answer)
    model: ModelKey | None = None  # what the serving instance must serve (None: any)
    subset: frozenset[str] | None = None  # the gateway's subset hint: only these ``ip:port``s
    split: bool = True  # whether it may be disaggregated (False: an API served whole)
    items: Sequence[MediaItem] = ()  # its media items, in order (a chat's)


@dataclasses.dataclass(frozen=True)
class Known:
    """What the proxy knows that the decision reads."""

    serving: InstancePool  # the pool whose instances serve a request (decode or PD)
    endpoints: int = DEFAULT_FALLBACKS  # how many endpoints an answer names at most
    prefill: InstancePool | None = None  # with instances: P/D, the serving pod's sidecar prefills there
    encode: InstancePool | None = None  # with instances: E/P/D, the sidecar has the media encoded there
    # The rule that sends a P/D request some decode nearly holds to that decode alone
    # (routing/disaggregation.py): --local-prefill-max-tokens (0: off), its streams and load bounds.
    alone_max_tokens: int = 0
    alone_max_streams: float = 0.0
    balance_abs: float = 0.0
    balance_rel: float = 1.0


@dataclasses.dataclass(frozen=True)
class Pick:
    """Ordered instances (empty: none eligible) and why each."""

    instances: tuple[Instance, ...]
    reasons: tuple[str, ...]
    prefill: Instance | None = None  # the prefill the first endpoint's sidecar runs first (None: it computes)
    encoders: tuple[Instance, ...] = ()  # the encoders of its media items, each once, in the items' order

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
    reason = pool.policy.name
    prefill, prefills = None, known.prefill
    if view.split and prefills:
        alone = _alone(view, known, first, excluded)
        if alone is not None:  # it holds nearly all of the prompt: it computes the rest, no prefill hop
            first, reason = alone, "computes alone"
        else:
            model = None if view.model is None else paired_key(view.model, first.served)
            prefill = prefills.choose((), view.routing, model)
    chosen = [first]
    reasons = [_reason(first, view.routing, reason)]
    if prefill is not None and prefills is not None:
        reasons[0] += f"; prefill {endpoint(prefill)} ({_reason(prefill, view.routing, prefills.policy.name)})"
    excluded.add(first)
    held = view.routing.held or {}
    rest = [i for i in pool.candidates(excluded, view.model) if i not in excluded]
    rest.sort(key=lambda i: (-held.get(i.url, 0), i.inflight + i.signals.others))
    for inst in rest[:known.endpoints - 1]:
        chosen.append(inst)
        reasons.append(_reason(inst, view.routing, "fallback"))
    encoders: tuple[Instance, ...] = ()
    if view.split and view.items and known.encode:
        encoders = tuple(dict.fromkeys(known.encode.assign(view.items)))  # per item; each encoder once
        reasons[0] += f"; encoders {','.join(endpoint(e) for e in encoders)} ({known.encode.policy.name})"
    return Pick(tuple(chosen), tuple(reasons), prefill, encoders)


def _alone(view: PickView, known: Known, first: Instance, excluded: set[Instance]) -> Instance | None:
    routing = view.routing
    if routing.held is None or not routing.tokens:
        return None
    candidates = [i for i in known.serving.candidates(excluded, view.model) if i not in excluded]
    return decode_alone(candidates, routing.held, routing.live, routing.tokens, first, routing.anchor,
                        max_tokens=known.alone_max_tokens, max_streams=known.alone_max_streams,
                        balance_abs=known.balance_abs, balance_rel=known.balance_rel)


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
