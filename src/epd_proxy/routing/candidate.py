"""The policy protocol: what every routing policy offers the pool, and what it may read
off a candidate.

A policy picks among candidates the pool has already filtered by health. It reads only
the few attributes of :class:`Candidate` (the instance type satisfies it), so routing sits
wholly below the instances that it ranks, as Envoy's load balancers sit below the cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, TypeVar

if TYPE_CHECKING:  # pragma: no cover - typing only
    from epd_proxy.encode.multimodal import MediaItem
    from epd_proxy.routing.view import RequestView


class Signals(Protocol):
    """An instance's scraped load (``instances.load_signals.LoadSignals``)."""

    @property
    def load(self) -> float: ...
    @property
    def others(self) -> float: ...
    @property
    def adapters(self) -> frozenset[str]: ...


class Candidate(Protocol):
    """What a policy reads off an instance: its URL (the rendezvous seed), this proxy's
    requests in flight on it (and the prompt tokens they still compute there, with KV
    events) and served by it, and its scraped load."""

    @property
    def url(self) -> str: ...
    @property
    def inflight(self) -> int: ...
    @property
    def backlog(self) -> int: ...
    @property
    def requests(self) -> int: ...
    @property
    def signals(self) -> Signals: ...


# --------------------------------------------------------------------------------------
C = TypeVar("C", bound=Candidate)


# Load: the requests on an instance are this proxy's (``inflight``) plus others' as last
# scraped (``signals.others``); the policies add them up inline, per candidate.

def score_of(inst: Candidate) -> float:
    """The load-aware score (lower is better): this proxy's in-flight requests, the others'
    (scraped), and a penalty for a nearly full KV cache (``load_signals.kv_penalty``)."""
    return inst.inflight + inst.signals.load


class RoutingPolicy(Protocol):
    """Picks among candidates (never empty) already filtered by health."""

    name: str  # as in POLICIES and the flags
    # Whether the pipeline must compute the request's view / the pool scrape load signals.
    uses_view: bool
    uses_signals: bool

    def choose(self, candidates: list[C], view: RequestView = ...) -> C:
        """The instance for the request (prefill, decode, PD)."""
        ...

    def assign(self, candidates: list[C], items: Sequence[MediaItem]) -> list[C]:
        """An instance per media item (encoders), in the items' order."""
        ...

