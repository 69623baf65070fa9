"""cache-aware on the block index: the longest prefix held wins within the load bound."""

from __future__ import annotations

from dataclasses import dataclass, field

from epd_proxy.routing.cache_aware import CacheAware
from epd_proxy.routing.view import RequestView


@dataclass
class _Signals:
    load: float = 0.0
    others: float = 0.0
    adapters: frozenset = frozenset()


@dataclass
class _Inst:
    url: str
    inflight: int = 0
    requests: int = 0
    signals: _Signals = field(default_factory=_Signals)


def _view(held: dict[str, int], live, tokens: int = 1000) -> RequestView:
    view = RequestView({"prompt": "some prompt"}, chat=False)
    view.held, view.live, view.tokens = held, frozenset(live), tokens
    return view


def test_longest_prefix_wins():
    a, b, c = _Inst("http://a"), _Inst("http://b"), _Inst("http://c")
    policy = CacheAware()
    for holder in (a, b, c):
        view = _view({holder.url: 640, "http://other": 900}, ["http://a", "http://b", "http://c"])
        assert policy.choose([a, b, c], view) is holder
    assert policy.exact == 3


def test_load_bound_scaled_by_the_share_held():
    a, b = _Inst("http://a", inflight=10), _Inst("http://b", inflight=0)
    policy = CacheAware(balance_abs=4, balance_rel=1.5)
    live = ["http://a", "http://b"]
    # a holds the whole prompt: the full slack (4) still excludes a load 10 beyond b's.
    assert policy.choose([a, b], _view({"http://a": 1000}, live)) is b
    a.inflight = 3
    assert policy.choose([a, b], _view({"http://a": 1000}, live)) is a
    # Holding a tenth of it earns a tenth of the slack: not worth 3 requests of queue.
    assert policy.choose([a, b], _view({"http://a": 100}, live)) is b
    assert policy.spills == 2


def test_not_every_candidate_live_routes_as_before():
    a, b = _Inst("http://a"), _Inst("http://b")
    policy = CacheAware()
    view = _view({"http://b": 1000}, ["http://b"])
    policy.choose([a, b], view)
    assert policy.exact == 0


def test_nothing_held_is_an_opening():
    a, b = _Inst("http://a", inflight=2), _Inst("http://b")
    policy = CacheAware()
    assert policy.choose([a, b], _view({}, ["http://a", "http://b"])) is b
