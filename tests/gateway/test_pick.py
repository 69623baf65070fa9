"""The endpoint picker's seam, ``pick``: pure over a pool built in memory (no socket is opened)."""

from __future__ import annotations

import pytest

from epd_proxy.config import parse_instance
from epd_proxy.gateway.pick import Known, PickView, endpoint, pick
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.decision import Known as PlacementKnown
from epd_proxy.routing.view import RequestView

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://10.0.0.4:8000"]


def _pool(policy: str = "least-loaded", urls=URLS, role: str = "decode") -> InstancePool:
    return InstancePool(role, [parse_instance(u, role) for u in urls], policy=policy)


def _known(decode: InstancePool, endpoints: int = 3, **kw) -> Known:
    """The placement's Known (no prefill pool unless given), as the composition root builds it."""
    prefill = kw.pop("prefill", None) or _pool(urls=[], role="prefill")
    return Known(PlacementKnown(decode, prefill, **kw), endpoints)


async def test_the_first_is_the_pools_choice_and_the_fallbacks_the_least_loaded_others():
    pool = _pool()
    a, b, c, d = pool.instances
    a.inflight, b.inflight, c.inflight, d.inflight = 3, 0, 2, 1
    chosen = pick(PickView(), _known(pool, 3))
    assert chosen.endpoints == ["10.0.0.2:8000", "10.0.0.4:8000", "10.0.0.3:8000"]
    assert chosen.reasons == ("least-loaded", "fallback", "fallback")


async def test_fallbacks_holding_more_of_the_prompt_come_first():
    pool = _pool()
    a, b, c, d = pool.instances
    a.inflight, b.inflight, c.inflight, d.inflight = 2, 0, 1, 1
    view = RequestView({"prompt": [1, 2, 3]}, (), False)
    view.held, view.tokens = {URLS[0]: 64, URLS[3]: 32}, 96
    chosen = pick(PickView(view), _known(pool, 4))
    assert chosen.endpoints == ["10.0.0.2:8000", "10.0.0.1:8000", "10.0.0.4:8000", "10.0.0.3:8000"]
    assert chosen.reasons[1] == "fallback, holds 64 of 96 prompt tokens"


async def test_a_policys_cursor_moves_once_per_request():
    """Asking the pool once per place in the list would move round robin's cursor by the list's
    length: with as many instances as places, every request would start at the same one."""
    pool = _pool("round-robin", URLS[:3])
    firsts = [pick(PickView(), _known(pool, 3)).endpoints[0] for _ in range(3)]
    assert len(set(firsts)) == 3


async def test_the_subset_hint_restricts_the_pick_and_an_empty_one_leaves_none():
    pool = _pool()
    subset = frozenset({"10.0.0.3:8000", "10.0.0.4:8000", "10.9.9.9:1"})
    for _ in range(4):
        assert set(pick(PickView(subset=subset), _known(pool)).endpoints) == {"10.0.0.3:8000", "10.0.0.4:8000"}
    assert pick(PickView(subset=frozenset({"10.9.9.9:1"})), _known(pool)).instances == ()
    assert pick(PickView(subset=frozenset()), _known(pool)).instances == ()


async def test_the_list_is_bounded_and_names_each_instance_once():
    pool = _pool()
    assert len(pick(PickView(), _known(pool, 1)).instances) == 1
    many = pick(PickView(), _known(pool, 10)).endpoints
    assert sorted(many) == sorted(endpoint(i) for i in pool.instances)


@pytest.mark.parametrize("url, want", [("http://10.1.2.3:8000", "10.1.2.3:8000"), ("http://[fd00::1]:8000",
                                                                                     "[fd00::1]:8000"),
                                       ("http://10.1.2.3", "10.1.2.3:80"), ("https://10.1.2.3", "10.1.2.3:443")])
async def test_an_endpoint_is_ip_and_port(url, want):
    assert endpoint(_pool(urls=[url]).instances[0]) == want


def _pd(alone_max_tokens: int = 64):
    decode = _pool(urls=URLS[:2])
    prefill = _pool(urls=["http://10.0.1.1:8000", "http://10.0.1.2:8000"], role="prefill")
    return decode, prefill, _known(decode, 2, prefill=prefill, local_prefill_max_tokens=alone_max_tokens,
                                   local_prefill_max_streams=0, balance_abs=4.0, balance_rel=1.5)


async def test_with_a_prefill_pool_the_decodes_sidecar_is_told_the_least_loaded_prefill():
    decode, prefill, known = _pd()
    prefill.instances[0].inflight = 2
    chosen = pick(PickView(), known)
    assert endpoint(chosen.prefill) == "10.0.1.2:8000" and len(chosen.instances) == 2
    assert "prefill 10.0.1.2:8000" in chosen.reasons[0]
    assert pick(PickView(split=False), known).prefill is None  # served whole (e.g. a Responses follow-up)


async def test_a_decode_holding_nearly_all_of_the_prompt_computes_it_alone():
    decode, prefill, known = _pd()
    view = RequestView({"prompt": [1]}, (), False)
    view.held, view.live, view.tokens = {URLS[1]: 90}, frozenset(URLS[:2]), 100
    chosen = pick(PickView(view), known)
    assert (endpoint(chosen.instances[0]), chosen.prefill) == ("10.0.0.2:8000", None)
    assert "computes the rest alone" in chosen.reasons[0]  # the placement's own reason
    view.held = {URLS[1]: 20}  # 80 tokens left to compute: past --local-prefill-max-tokens (64)
    assert pick(PickView(view), known).prefill is not None
    view.held = {URLS[1]: 90}
    assert pick(PickView(view), _pd(alone_max_tokens=0)[2]).prefill is not None  # the rule off


async def test_with_encoders_each_media_item_has_one_and_each_encoder_is_named_once():
    from epd_proxy.encode.multimodal import collect_media

    decode, prefill, known = _pd()
    encoders = _pool("round-robin", ["http://10.0.2.1:8000", "http://10.0.2.2:8000"], role="encode")
    known = _known(decode, 2, prefill=prefill, encode=encoders)
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"https://example.com/{n}.png"}} for n in range(3)]}]}
    items = collect_media(body)
    chosen = pick(PickView(items=items), known)
    assert [endpoint(e) for e in chosen.encoders] == ["10.0.2.1:8000", "10.0.2.2:8000"]
    assert "encoders 10.0.2.1:8000,10.0.2.2:8000" in chosen.reasons[0]
    assert pick(PickView(), known).encoders == ()  # no media, no encoders


async def test_every_decode_wedged_the_prefill_is_the_one_endpoint_and_none_left_is_a_503():
    from epd_proxy.placement.decision import PREFILL_ALONE
    from epd_proxy.wire.errors import ProxyError

    decode, prefill, known = _pd()
    for inst in decode.instances:  # both queues stand still (the load scrape's verdict)
        decode.outliers.standing(inst, "3 requests waiting, none running for 2.0 s (KV cache 100.0% full)")
    chosen = pick(PickView(), known)
    assert [endpoint(i) for i in chosen.instances] == ["10.0.1.1:8000"] and chosen.prefill is None
    assert chosen.reasons == (PREFILL_ALONE,)
    for inst in prefill.instances:
        prefill.outliers.drain(inst)
    with pytest.raises(ProxyError) as err:
        pick(PickView(), known)
    assert err.value.status == 503 and err.value.code == "overloaded"
