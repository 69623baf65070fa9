"""The one seam between the endpoint picker's protocol and the proxy's placement.

``pick(view, known)`` answers, for one request the gateway asks about, the ordered endpoints
of the pod that serves it (the first, then the ones the gateway's retries walk), the prefill
its decode-side sidecar runs first when the request is disaggregated (llm-d's
``x-prefiller-host-port``), the encoders of its media items (``x-encoder-hosts-ports``), and
a short reason for each. Inside it is the proxy's own decision, ``placement.place``, over the
very ``Known`` the composition root built for the proxy's request path: the roles' host sets
with their health, outliers, load signals, models, adapters and policies, the block index's
answer in the request's view, the rule for a decode computing alone. The seam only adds what a
gateway needs besides it: the gateway's subset hint, and the fallbacks. The picker around it
(``picker.py``) does the rest (tenants, aliases, the block index lookup) and the protocol
adapter (``ext_proc.py``) only translates.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence
from urllib.parse import urlsplit

from epd_proxy.encode.multimodal import MediaItem
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import ModelKey
from epd_proxy.placement.decision import PREFILL_ALONE, place
from epd_proxy.placement.decision import Known as PlacementKnown
from epd_proxy.routing.view import EMPTY_VIEW, RequestView

# Endpoints named per answer: the first and the fallbacks the gateway's retries walk.
DEFAULT_FALLBACKS = 3


@dataclasses.dataclass(frozen=True)
class PickView:
    """What one request brings to the decision."""

    routing: RequestView = EMPTY_VIEW  # its routing keys (``held``: the block index's answer)
    models: dict[str, ModelKey] | None = None  # per role, what its instance must serve (None: any)
    subset: frozenset[str] | None = None  # the gateway's subset hint: only these ``ip:port``s
    split: bool = True  # whether it may be disaggregated (False: an API served whole)
    items: Sequence[MediaItem] = ()  # its media items, in order (a chat's)


@dataclasses.dataclass(frozen=True)
class Known:
    """What the proxy knows that the decision reads: the placement's own, and the list's length."""

    placement: PlacementKnown
    endpoints: int = DEFAULT_FALLBACKS  # how many endpoints an answer names at most


@dataclasses.dataclass(frozen=True)
class Pick:
    """Ordered instances (empty: none eligible) and why each; the prefill and the encoders the
    first one's sidecar is told of."""

    instances: tuple[Instance, ...]
    reasons: tuple[str, ...]
    prefill: Instance | None = None  # the prefill the first endpoint's sidecar runs first (None: it computes)
    encoders: tuple[Instance, ...] = ()  # the encoders of its media items, each once, in the items' order

    @property
    def endpoints(self) -> list[str]:
        return [endpoint(i) for i in self.instances]


@dataclasses.dataclass(slots=True)
class _Asking:
    """What ``placement.place`` reads of a request (the proxy's RequestContext has the same)."""

    excluded: set[Instance]
    timed_out: frozenset[Instance]
    view: RequestView
    models: dict[str, ModelKey] | None


def pick(view: PickView, known: Known) -> Pick:
    """The placement of one request for a gateway; none when the subset hint leaves none the
    decode role would be placed on. The first endpoint is the placement's decode (with its
    prefill and encoders); the fallbacks are the decode role's other candidates, those holding
    more of the prompt first, then the least loaded."""
    placing = known.placement
    pool = placing.decode
    subset = view.subset
    excluded: set[Instance] = set()
    if subset is not None:
        excluded = {i for i in pool.instances if endpoint(i) not in subset}
    ask = _Asking(set(excluded), frozenset(), view.routing, None if view.models is None else dict(view.models))
    placed = place(ask, placing, bool(view.items), None, not view.split, None, view.items if view.split else ())
    first = placed.decode
    if first in excluded:  # the subset leaves none in rotation
        return Pick((), ())
    reason = placed.decode_why
    if placed.prefill is not None:
        reason += f"; prefill {endpoint(placed.prefill)} ({placed.prefill_why})"
    encoders: tuple[Instance, ...] = ()
    if placed.encoders is not None:
        encoders = tuple(dict.fromkeys(placed.encoders[1]))  # per item; each encoder once
        reason += f"; encoders {','.join(endpoint(e) for e in encoders)}"
    chosen, reasons = [first], [_reason(first, view.routing, reason)]
    excluded.add(first)
    held = view.routing.held or {}
    model = None if view.models is None else view.models.get("decode")
    # Every decode standing still: the prefill answering alone is the only endpoint (no decode
    # to fall back on, not even by panic: placement/decision.py, step 0).
    rest = [] if placed.decode_why is PREFILL_ALONE else [i for i in pool.candidates(excluded, model)
                                                          if i not in excluded]
    rest.sort(key=lambda i: (-held.get(i.url, 0), i.inflight + i.signals.others))
    for inst in rest[:known.endpoints - 1]:
        chosen.append(inst)
        reasons.append(_reason(inst, view.routing, "fallback"))
    return Pick(tuple(chosen), tuple(reasons), placed.prefill, encoders)


def _reason(inst: Instance, routing: RequestView, why: str) -> str:
    held = routing.held
    if held is not None and routing.tokens:
        return f"{why}, holds {held.get(inst.url, 0)} of {routing.tokens} prompt tokens"
    return why


def endpoint(inst: Instance) -> str:
    """An instance's ``ip:port`` as the gateway names endpoints (IPv6 in brackets)."""
    parts = urlsplit(inst.url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
