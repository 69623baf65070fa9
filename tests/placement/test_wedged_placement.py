"""Decodes whose queue stands still (``wedged``: requests waiting, none running, their KV full
of blocks vLLM pins for a later turn), as the placement sees them: out of routing whatever the
passive cap, never a panic pick; with every decode of the model standing still a prefill
answers alone, else a 503 ``overloaded`` at once. Pure logic over host sets (no sockets)."""

import asyncio

import pytest

from epd_proxy.config import InstanceSpec
from epd_proxy.encode.multimodal import MediaItem
from epd_proxy.instances.health import BY_WEDGED, EJECTED, HALF_OPEN, HEALTHY, OutlierSettings
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import PANIC
from epd_proxy.placement.decision import (
    DECODE_ONLY,
    HOLDS_PROMPT,
    HOLDS_TURN,
    NO_PREFILL,
    OWNER,
    PREFILL_ALONE,
    Known,
    PreviousTurn,
    again,
    another_decode,
    can_answer,
    moved_off_wedged,
    place,
    worth_retrying,
)
from epd_proxy.request.context import RequestContext
from epd_proxy.routing.view import RequestView
from epd_proxy.wire.errors import ProxyError

WHY = "13 requests waiting, none running for 2.0 s (KV cache 100.0% full)"


def pool(role, n, port=9000, **spec):
    # vLLM's defaults for the passive cap (50 %): with two decodes only one may be out by it.
    return InstancePool(role, [InstanceSpec(f"http://127.0.0.1:{port + i}", role, **spec) for i in range(n)],
                        outlier=OutlierSettings(max_ejection_percent=50, ejection_time=30.0))


def known(decodes=2, prefills=1, **kw):
    d = kw.pop("decode", None)
    p = kw.pop("prefill", None)
    d = pool("decode", decodes) if d is None else d
    p = pool("prefill", prefills, port=9100) if p is None else p
    return Known(d, p, **kw)


def ctx():
    return RequestContext("r", "/v1/chat/completions", [])


def wedge(k: Known, *insts) -> None:
    for inst in insts:
        k.decode.outliers.standing(inst, WHY)
        assert inst.health.state is EJECTED and inst.health.cause is BY_WEDGED


async def test_one_wedged_decode_of_two_is_out_at_once_and_never_picked():
    k = known()
    a, b = k.decode.instances
    wedge(k, a)
    assert k.decode.wedged == [a] and a.health.last_error == WHY
    assert {place(ctx(), k).decode for _ in range(6)} == {b}
    # b failed this request, a stands still: the retry goes to the prefill alone, never to a
    c = ctx()
    c.failed(b)
    placed = place(c, k)
    assert placed.decode is k.prefill.instances[0] and placed.decode_why == PREFILL_ALONE
    # with nothing wedged, a retry goes back to the decode that failed it, as before
    k.decode.outliers.standing(a, None)
    c.failed(a)
    assert place(c, k).decode in (a, b)


async def test_both_wedged_are_out_whatever_the_cap_and_a_prefill_answers_alone():
    k = known()
    a, b = k.decode.instances
    wedge(k, a, b)  # the cap (50 % of two: one) kept the second in rotation before
    assert k.decode.in_rotation == [] and k.decode.every == [] and k.decode.standing()
    placed = place(ctx(), k)
    prefill = k.prefill.instances[0]
    assert placed.decode is prefill and placed.decode_why == PREFILL_ALONE
    assert placed.prefill is None and placed.prefill_why == NO_PREFILL and placed.connector == DECODE_ONLY
    assert placed.kv_from is None and placed.decode_among == [prefill]
    assert placed.reasons()["decode"] == f"{prefill.url}: {PREFILL_ALONE}"
    assert placed.summary()["decode"] == {"instance": prefill.url, "why": PREFILL_ALONE}
    assert k.decode.wedged_routing == {"prefill_alone": 1, "refused": 0} and k.decode.panics == 0


async def test_every_decode_wedged_and_no_prefill_is_a_503_overloaded_at_once():
    for k in (known(prefill=InstancePool("prefill", ())),  # P+D without prefills, or decode-alone (PD)
              known(decodes=1, prefill=InstancePool("prefill", ()), prefill_needed=True)):
        wedge(k, *k.decode.instances)
        with pytest.raises(ProxyError) as err:
            place(ctx(), k)
        e = err.value
        assert e.status == 503 and e.code == "overloaded" and not e.retryable
        assert e.message == "the decode instances are at capacity; retry later"
        assert k.decode.wedged_routing == {"prefill_alone": 0, "refused": 1}


async def test_every_decode_wedged_and_every_prefill_out_or_failed_is_a_503():
    k = known(prefills=2)
    wedge(k, *k.decode.instances)
    p1, p2 = k.prefill.instances
    c = ctx()
    c.failed(p1)  # it failed this request: the other prefill answers
    assert place(c, k).decode is p2
    k.prefill.outliers.probe_failed(p2, "connection", "probe")
    k.prefill.outliers.probe_failed(p2, "connection", "probe")
    k.prefill.outliers.probe_failed(p2, "connection", "probe")
    assert p2.health.state is EJECTED
    with pytest.raises(ProxyError) as err:
        place(c, k)  # no panic routing over prefills that are out either
    assert err.value.status == 503 and err.value.code == "overloaded"
    c.timed_out_on(p1)
    with pytest.raises(ProxyError):
        place(c, k)


async def test_a_decode_out_for_another_cause_is_still_the_panic_pick():
    k = known()
    a, b = k.decode.instances
    wedge(k, a)
    for _ in range(3):
        k.decode.outliers.probe_failed(b, "connection", "probe")
    assert b.health.state is EJECTED and not k.decode.standing()
    placed = place(ctx(), k)  # it may answer; a wedged one cannot
    assert placed.decode is b and placed.decode_why == PANIC
    assert placed.prefill is k.prefill.instances[0]


async def test_running_again_brings_it_back_and_placement_is_as_before():
    k = known()
    a, b = k.decode.instances
    wedge(k, a, b)
    k.decode.outliers.standing(a, None)
    assert a.health.state is HEALTHY and not k.decode.standing()
    placed = place(ctx(), k)
    assert placed.decode is a and placed.prefill is k.prefill.instances[0] and placed.decode_why == "least-loaded"


async def test_a_wedged_decode_stays_out_past_its_ejection_while_its_scrape_says_so():
    k = known()
    a, b = k.decode.instances
    d = k.decode
    d.outliers.rules = type(d.outliers.rules)(OutlierSettings(ejection_time=0.05))
    a.signals.update(0, 3, 1.0, 0, 1.0)  # the last scrape: 3 waiting, none running, its KV full
    wedge(k, a)
    await asyncio.sleep(0.15)
    assert a.health.state is EJECTED and a in d.wedged  # a trial there would wait in its queue
    a.signals.update(0, 0, 0.99, 0, 2.0)  # its waiting requests failed over; its pins hold on
    await asyncio.sleep(0.15)
    assert a.health.state is EJECTED and a in d.wedged  # still no trial
    a.signals.forget()  # scrapes lost: a trial may decide
    await asyncio.sleep(0.3)
    assert a.health.state is HALF_OPEN and a not in d.wedged and a in d.half_open
    a.signals.update(0, 3, 1.0, 0, 5.0)
    d.outliers.standing(a, WHY)  # half-open, still standing: out again
    assert a.health.state is EJECTED and a in d.wedged
    assert a.signals.wedged_kv == 1.0  # its KV usage then
    # its waiting requests failed over: nothing waits, but its pins hold on
    a.signals.update(0, 0, 0.97, 0, 6.0)
    d.outliers.standing(a, None)
    assert a.health.state is EJECTED and a in d.wedged
    # a queue standing again, within the hold: no sign it admits anything
    a.signals.update(0, 2, 0.5, 0, 7.0)
    d.outliers.standing(a, None)
    assert a.health.state is EJECTED
    a.signals.update(0, 0, 0.95, 0, 8.0)  # pins expiring: 5 % of its cache freed, nothing waiting
    d.outliers.standing(a, None)
    assert a.health.state is HEALTHY and not d.wedged
    wedge(k, a)
    a.signals.update(2, 1, 0.99, 0, 9.0)  # running again, however full
    d.outliers.standing(a, None)
    assert a.health.state is HEALTHY
    d.outliers.forget(a)


async def test_e_p_d_with_media_the_prefill_answers_alone_and_the_encoders_are_placed():
    encoders = pool("encode", 2, port=9200)
    prefill = pool("prefill", 1, port=9100, ec_zmq_addrs=("tcp://p:1",))
    k = known(encode=encoders, prefill=prefill)
    wedge(k, *k.decode.instances)
    items = [MediaItem(i, 0, i, "image_url", {"type": "image_url", "image_url": {"url": f"http://x/{i}"}}, f"u{i}")
             for i in range(2)]
    placed = place(ctx(), k, True, None, False, None, items)
    assert placed.decode is prefill.instances[0] and placed.decode_why == PREFILL_ALONE and placed.prefill is None
    assert placed.encoders is not None and len(placed.encoders[1]) == 2
    assert placed.consumer_zmq == "tcp://p:1"  # the prefill receives the embeddings, as in its own leg


async def test_decode_alone_never_on_a_wedged_decode():
    k = known(local_prefill_max_tokens=512, local_prefill_max_streams=8)
    a, b = k.decode.instances
    wedge(k, a)
    # the previous turn's decode stands still: the prefill reads it there (pull), the other decodes
    placed = place(ctx(), k, turn=PreviousTurn(a, 40))
    assert placed.decode is b and placed.decode_why != HOLDS_TURN and placed.kv_from is a
    # the other holds it: computes the new part alone, as before
    assert place(ctx(), k, turn=PreviousTurn(b, 40)).decode_why == HOLDS_TURN
    wedge(k, b)
    placed = place(ctx(), k, turn=PreviousTurn(b, 40))
    assert placed.decode is k.prefill.instances[0] and placed.decode_why == PREFILL_ALONE and placed.kv_from is None
    # the block index says a wedged decode holds the prompt: not there either
    c = ctx()
    c.view = RequestView({"messages": []})
    c.view.held, c.view.live, c.view.tokens = {a.url: 990, b.url: 990}, frozenset({a.url, b.url}), 1000
    assert place(c, k).decode_why not in (HOLDS_PROMPT, HOLDS_TURN)


async def test_served_whole_the_owner_wedged_is_refused_and_otherwise_the_prefill_answers():
    k = known()
    a, b = k.decode.instances
    wedge(k, a)
    with pytest.raises(ProxyError) as err:
        place(ctx(), k, whole=True, owner=a)  # no other instance holds the previous response
    assert err.value.status == 503 and err.value.code == "overloaded"
    assert place(ctx(), k, whole=True, owner=b).decode_why == OWNER
    assert place(ctx(), k, whole=True).decode is b
    wedge(k, b)
    placed = place(ctx(), k, whole=True)
    assert placed.decode is k.prefill.instances[0] and placed.decode_why == PREFILL_ALONE


async def test_a_broken_stream_or_a_retry_goes_on_while_a_prefill_can_answer_alone():
    k = known()
    a, b = k.decode.instances
    c = ctx()
    c.failed(a)  # its stream broke there
    wedge(k, b)
    assert another_decode(c, k) and can_answer(c, k)  # every decode stands still or failed it: the prefill
    assert worth_retrying(c, k, unsent=True)
    wedge(k, a)
    assert another_decode(c, k)
    placed = place(c, k)
    assert placed.decode is k.prefill.instances[0] and placed.decode_why == PREFILL_ALONE
    c.failed(k.prefill.instances[0])
    assert not another_decode(c, k) and not can_answer(c, k)
    assert not worth_retrying(c, k, unsent=True)


async def test_the_kv_hand_over_never_goes_to_a_wedged_decode():
    k = known(decodes=3)
    x, y, z = k.decode.instances
    c = ctx()
    placed = place(c, k)
    first = placed.decode
    others = [i for i in (x, y, z) if i is not first]
    wedge(k, others[0])
    c.failed(first)
    assert again(placed, c, k) is others[1]
    wedge(k, others[1])
    c.failed(others[1])
    # none left that admits anything: the attempt fails and is placed anew (the prefill alone)
    assert again(placed, c, k) is None


async def test_a_model_whose_decodes_all_stand_still_goes_to_its_prefill_while_others_route_as_usual():
    d = InstancePool("decode", [InstanceSpec("http://127.0.0.1:9000", "decode", models=("a",)),
                                InstanceSpec("http://127.0.0.1:9001", "decode", models=("b",))],
                     outlier=OutlierSettings(ejection_time=30.0))
    p = InstancePool("prefill", [InstanceSpec("http://127.0.0.1:9100", "prefill", models=("a", "b"))])
    k = Known(d, p)
    da, db = d.instances
    wedge(k, da)
    c = ctx()
    c.models = {"decode": "a", "prefill": "a"}
    assert place(c, k).decode is p.instances[0]
    c = ctx()
    c.models = {"decode": "b", "prefill": "b"}
    placed = place(c, k)
    assert placed.decode is db and placed.prefill is p.instances[0]


async def test_an_attempt_failed_over_from_a_wedged_decode_is_moved_not_retried():
    k = known()
    a, b = k.decode.instances
    prefill = k.prefill.instances[0]
    c = ctx()
    assert not moved_off_wedged(c, k, [prefill, a])  # nothing wedged
    c.failed(a)  # a failed it (say, a reset): a retry like any
    wedge(k, b)
    assert not moved_off_wedged(c, k, [prefill, a])
    wedge(k, a)  # then its queue stood still: its waiting request was failed over from it
    assert moved_off_wedged(c, k, [prefill, a])
    assert not moved_off_wedged(c, k, [prefill])  # not this attempt's decode
    assert not moved_off_wedged(ctx(), k, [prefill, a])  # not one that failed this request
