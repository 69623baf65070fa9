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
    backlog: int = 0
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


def test_the_wait_in_tokens_within_the_load_bound():
    a, b = _Inst("http://a", inflight=10), _Inst("http://b", inflight=0)
    policy = CacheAware(balance_abs=4, balance_rel=1.5)
    live = ["http://a", "http://b"]
    # a holds the whole prompt: the load bound (4) still excludes a load 10 beyond b's.
    assert policy.choose([a, b], _view({"http://a": 1000}, live)) is b
    a.inflight, a.backlog = 3, 600
    # 600 tokens queued ahead there against the whole prompt's 1000 here.
    assert policy.choose([a, b], _view({"http://a": 1000}, live)) is a
    # Holding a tenth of it: 900 to compute after 600 queued, against 1000 at once.
    assert policy.choose([a, b], _view({"http://a": 100}, live)) is b
    assert policy.spills == 2


def test_a_shared_prefix_spreads_once_its_holder_queues():
    """Opening turns sharing a system prompt (300 of their 350 tokens) stay on its holder while
    its queue is shorter than the prefix; then another computes it once, and both hold it."""
    a, b = _Inst("http://a"), _Inst("http://b")
    live = ["http://a", "http://b"]
    policy = CacheAware(balance_abs=100)
    picks = []
    for _ in range(12):
        held = {"http://a": 300} | ({"http://b": 300} if "http://b" in picks else {})
        inst = policy.choose([a, b], _view(held, live, tokens=350))
        inst.inflight += 1
        inst.backlog += 350 - held.get(inst.url, 0)
        picks.append(inst.url)
    assert picks[:6] == ["http://a"] * 6  # 6 x 50 queued: still less than b's 350
    assert "http://b" in picks[6:8]
    # From then on the shorter queue (in tokens) takes the next one: the queues stay level.
    assert picks.count("http://b") >= 3 and abs(a.backlog - b.backlog) <= 50


def test_others_requests_count_at_the_mean_of_ours():
    a, b = _Inst("http://a", inflight=2, backlog=400), _Inst("http://b")
    live = ["http://a", "http://b"]
    policy = CacheAware(balance_abs=100)
    view = _view({"http://a": 700}, live, tokens=1000)
    assert policy.choose([a, b], view) is a  # 300 + 400 against 1000
    a.signals.others = 2  # two more, of about 200 each: 300 + 800
    assert policy.choose([a, b], _view({"http://a": 700}, live, tokens=1000)) is b


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
