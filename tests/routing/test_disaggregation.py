"""Whether a P/D request goes to one decode alone: the decode holding the longest prefix
that would compute at most a few tokens, is quiet enough and within the load bound."""

from __future__ import annotations

from dataclasses import dataclass, field

from epd_proxy.routing.disaggregation import decode_alone
from epd_proxy.routing.view import instance_seed, mix64


@dataclass
class _Signals:
    load: float = 0.0
    others: float = 0.0
    adapters: frozenset = frozenset()


@dataclass(eq=False)
class _Inst:
    url: str
    inflight: int = 0
    requests: int = 0
    signals: _Signals = field(default_factory=_Signals)


A, B, C = "http://a", "http://b", "http://c"
ALL = frozenset((A, B, C))


def _alone(cands, held, chosen, *, live=ALL, tokens=1000, max_tokens=64, max_streams=0, anchor=7,
           balance_abs=4.0, balance_rel=1.5):
    return decode_alone(cands, held, live, tokens, chosen, anchor, max_tokens=max_tokens,
                        max_streams=max_streams, balance_abs=balance_abs, balance_rel=balance_rel)


def test_a_decode_the_policy_did_not_pick_that_holds_the_prompt_takes_it_alone():
    a, b, c = _Inst(A), _Inst(B), _Inst(C)
    assert _alone([a, b, c], {B: 960}, chosen=a) is b
    assert _alone([a, b, c], {B: 960, C: 992}, chosen=a) is c  # the longest prefix


def test_nothing_held_closely_enough_disaggregates():
    a, b = _Inst(A), _Inst(B)
    assert _alone([a, b], {B: 935}, chosen=a) is None  # 65 tokens left to compute
    assert _alone([a, b], {B: 936}, chosen=a) is b  # 64
    assert _alone([a, b], {}, chosen=a) is None
    assert _alone([a, b], {B: 1000}, chosen=a, max_tokens=0) is None  # --local-prefill-max-tokens 0: never


def test_a_short_prompt_is_computed_alone_by_the_policys_pick_when_none_holds_more():
    a, b = _Inst(A), _Inst(B)
    assert _alone([a, b], {}, chosen=b, tokens=40) is b
    assert _alone([a, b], {A: 32}, chosen=b, tokens=40) is a  # a holds more of it


def test_a_busy_holder_is_passed_over_for_an_idle_one_that_holds_enough():
    a, b, c = _Inst(A), _Inst(B, inflight=1), _Inst(C)
    assert _alone([a, b, c], {B: 992, C: 960}, chosen=a) is c  # --local-prefill-max-streams 0
    c.signals.others = 1  # requests of others the metrics show count too
    assert _alone([a, b, c], {B: 992, C: 960}, chosen=a) is None
    assert _alone([a, b, c], {B: 992, C: 960}, chosen=a, max_streams=1) is b


def test_the_load_bound_applies_beyond_the_streams_rule():
    a, b = _Inst(A, inflight=10), _Inst(B, inflight=1)
    # With streams allowed, a holder loaded past the bound (1 + 4) is not sent more.
    assert _alone([a, b], {A: 1000}, chosen=b, max_streams=100) is None
    a.inflight = 5
    assert _alone([a, b], {A: 1000}, chosen=b, max_streams=100) is a


def test_only_decodes_whose_events_are_live_are_judged():
    a, b = _Inst(A), _Inst(B)
    assert _alone([a, b], {B: 1000}, chosen=a, live=frozenset({A})) is None
    assert _alone([a, b], {B: 1000}, chosen=a, live=frozenset({B})) is b


def test_ties_go_to_the_policys_pick_then_the_less_loaded_then_rendezvous():
    a, b, c = _Inst(A), _Inst(B), _Inst(C)
    held = {A: 992, B: 992, C: 992}
    for chosen in (a, b, c):
        assert _alone([a, b, c], held, chosen=chosen) is chosen
    other = _Inst("http://d")
    assert _alone([a, b, c, other], held, chosen=other) is max(
        (a, b, c), key=lambda i: mix64(7 ^ instance_seed(i.url)))
    b.inflight = 1
    assert _alone([a, b], {A: 992, B: 992}, chosen=other, max_streams=2) is a  # the less loaded
