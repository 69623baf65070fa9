"""The placement of one attempt, as pure logic: every rule the decision holds (the leg pick's
trial share, panic, affinity and timed-out rules; the prefill's base for an adapter; the
previous response's owner; the previous turn computed on its decode or read from it; the decode
holding the prompt; the data-parallel rank; the KV hand-over made again), each with its reason."""

import msgspec
import pytest
from helpers import wait_for

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.health import OutlierSettings
from epd_proxy.instances.model_directory import ModelDirectory
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import AFFINITY, HALF_OPEN_SHARE, PANIC, TRIAL, UNKNOWN_MODELS, pick
from epd_proxy.placement.decision import (
    DECODE_ONLY,
    HAND_OVER,
    HOLDS_PROMPT,
    HOLDS_TURN,
    NO_PREFILL,
    OWNER,
    READS_TURN,
    Known,
    PreviousTurn,
    again,
    place,
)
from epd_proxy.request.context import RequestContext
from epd_proxy.routing.lora_affinity import AdapterAffinity
from epd_proxy.routing.view import RequestView
from epd_proxy.wire.errors import ProxyError


def pool(role, n, port=9000, policy="least-loaded", models=None, **spec):
    return InstancePool(role, [InstanceSpec(f"http://127.0.0.1:{port + i}", role, **spec) for i in range(n)],
                        policy=policy, outlier=OutlierSettings(fail_threshold=1, ejection_time=0.01),
                        models=models)


def known(decodes=2, prefills=1, **kw):
    d = kw.pop("decode", None)
    p = kw.pop("prefill", None)
    d = pool("decode", decodes) if d is None else d
    p = pool("prefill", prefills, port=9100) if p is None else p
    return Known(d, p, **kw)


def ctx():
    return RequestContext("r", "/v1/chat/completions", [])


async def test_pd_the_policy_picks_both_legs_and_says_so():
    k = known()
    placed = place(ctx(), k)
    assert placed.decode in k.decode.instances and placed.prefill is k.prefill.instances[0]
    assert placed.decode_why == placed.prefill_why == "least-loaded"
    assert placed.connector == "nixl" and placed.kv_from is None and placed.rank is None
    assert placed.reasons() == {"decode": f"{placed.decode.url}: least-loaded",
                                "prefill": f"{placed.prefill.url}: least-loaded"}


async def test_without_prefill_instances_the_decode_computes_the_prompt():
    k = known(prefill=InstancePool("prefill", ()))
    placed = place(ctx(), k)
    assert placed.prefill is None and placed.prefill_why == NO_PREFILL and placed.connector == DECODE_ONLY


async def test_a_topology_pinned_to_prefill_without_instances_is_a_503():
    k = known(prefill=InstancePool("prefill", ()), prefill_needed=True)
    with pytest.raises(ProxyError) as err:
        place(ctx(), k)
    assert err.value.status == 503


async def test_never_a_decode_that_timed_out_and_504_when_every_one_did():
    k = known()
    a, b = k.decode.instances
    c = ctx()
    c.timed_out_on(a)
    c.failed(a)
    assert {place(c, k).decode for _ in range(4)} == {b}
    c.failed(b)  # failed too, but not by timing out: still better than one that timed out
    placed = place(c, k)
    assert placed.decode is b
    c.timed_out_on(b)
    with pytest.raises(ProxyError) as err:
        place(c, k)
    assert err.value.status == 504 and "decode" in err.value.message


async def test_excluded_first_then_a_timed_out_pick_is_replaced_with_its_reason():
    d = pool("decode", 2, policy="round-robin")
    k = known(decode=d)
    a, b = d.instances
    c = ctx()
    c.timed_out_on(a)  # timed out, not excluded: the policy may pick it first
    whys = {place(c, k).decode_why for _ in range(4)}
    assert {p.decode for p in (place(c, k) for _ in range(4))} == {b}
    assert "not the one that timed out" in whys


async def test_a_half_open_decode_gets_its_trial_share_with_the_reason():
    k = known()
    a, b = k.decode.instances
    k.decode.outliers.record_failure(a, "reset")
    await wait_for(lambda: a.state == "half-open")
    placed = [place(ctx(), k) for _ in range(2 * HALF_OPEN_SHARE)]
    trials = [p for p in placed if p.decode is a]
    assert len(trials) == 2 and all(p.decode_why == TRIAL for p in trials)
    assert all(p.decode is b and p.decode_why == "least-loaded" for p in placed if p.decode is not a)
    await k.decode.close()


async def test_panic_routing_is_the_reason_when_no_decode_is_in_rotation():
    k = known()
    for inst in k.decode.instances:
        k.decode.outliers.probe_failed(inst, "connection", "probe")
    placed = place(ctx(), k)
    assert placed.decode_why == PANIC and k.decode.panics == 1


async def test_an_instance_whose_models_are_unknown_is_no_panic():
    models = ModelDirectory()
    d = pool("decode", 2, models=models)
    known_one, unknown = d.instances
    d.served.learned(known_one, _listing(_card("a")))
    d.outliers.record_failure(unknown, "down")
    choice = pick(d, model="b")
    assert choice[:2] == (unknown, UNKNOWN_MODELS) and d.panics == 0


async def test_an_adapter_goes_by_affinity_and_its_prefill_on_the_decodes_base():
    models = ModelDirectory()
    d = pool("decode", 2, models=models)
    d.served.affinity = AdapterAffinity(4, 1.5)
    p = pool("prefill", 2, port=9100, models=models)
    for inst in d.instances + p.instances:
        inst.served = None
        (d if inst in d.instances else p).served.learned(inst, _listing(_card("base"), _card("fin", "base")))
    c = ctx()
    c.models = models.current.route("fin")
    placed = place(c, Known(d, p))
    assert placed.decode_why == AFFINITY
    assert c.models["prefill"] == ("fin", "base")  # the adapter's KV on its base


async def test_a_responses_follow_up_goes_to_the_owner_of_its_previous_response():
    k = known()
    a, b = k.decode.instances
    placed = place(ctx(), k, whole=True, owner=b)
    assert placed.decode is b and placed.decode_why == OWNER and placed.prefill is None
    c = ctx()
    c.timed_out_on(b)
    placed = place(c, k, whole=True, owner=b)  # the owner timed out on it: the pool's pick
    assert placed.decode is a and placed.decode_why != OWNER
    assert place(ctx(), k, whole=True).prefill is None  # served whole: never a prefill


async def test_a_small_new_turn_is_computed_on_the_idle_decode_holding_the_previous_one():
    k = known(local_prefill_max_tokens=64, local_prefill_max_streams=0)
    holder = k.decode.instances[1]
    placed = place(ctx(), k, turn=PreviousTurn(holder, 40))
    assert placed.decode is holder and placed.decode_why == HOLDS_TURN
    assert placed.prefill is None and placed.connector == DECODE_ONLY and placed.kv_from is None


async def test_a_busy_holder_is_declined_and_the_prefill_reads_the_turn_there():
    k = known(local_prefill_max_tokens=64, local_prefill_max_streams=0)
    holder = k.decode.instances[1]
    holder.inflight = 1  # another stream would wait for the prefill computed on it
    placed = place(ctx(), k, turn=PreviousTurn(holder, 40))
    assert placed.declined and placed.kv_from is holder and placed.prefill_why == READS_TURN
    assert placed.prefill is k.prefill.instances[0] and placed.connector == "nixl"


async def test_a_long_new_turn_is_read_by_the_prefill_without_declining():
    k = known(local_prefill_max_tokens=64)
    holder = k.decode.instances[0]
    placed = place(ctx(), k, turn=PreviousTurn(holder, 500))
    assert not placed.declined and placed.kv_from is holder and placed.prefill is not None


async def test_a_holder_past_the_load_bound_or_excluded_does_not_take_the_turn_alone():
    k = known(local_prefill_max_tokens=64, local_prefill_max_streams=10, balance_abs=4)
    a, b = k.decode.instances
    b.inflight = 5  # 5 > 0 + 4: past the bound
    assert place(ctx(), k, turn=PreviousTurn(b, 10)).kv_from is b
    b.inflight = 0
    c = ctx()
    c.failed(b)  # not a candidate any more
    assert place(c, k, turn=PreviousTurn(b, 10)).decode_why != HOLDS_TURN


async def test_a_previous_turn_is_read_only_through_the_pull_connector():
    k = known(connector="nixl-push", local_prefill_max_tokens=64)
    holder = k.decode.instances[0]
    holder.inflight = 3
    placed = place(ctx(), k, turn=PreviousTurn(holder, 500))
    assert placed.kv_from is None and placed.prefill is not None and placed.connector == "nixl-push"
    assert place(ctx(), known(prefill=InstancePool("prefill", ())), turn=PreviousTurn(holder, 500)).kv_from is None


def _held(view, held, tokens=1000, live=None):
    view.held, view.tokens, view.live = held, tokens, live if live is not None else frozenset(held)


async def test_the_decode_holding_the_prompt_computes_it_alone():
    k = known(local_prefill_max_tokens=64)
    a, b = k.decode.instances
    c = ctx()
    c.view = RequestView({"messages": [{"role": "user", "content": "x"}]})
    _held(c.view, {b.url: 960}, live=frozenset({a.url, b.url}))
    placed = place(c, k)
    assert placed.decode is b and placed.decode_why == HOLDS_PROMPT and placed.prefill is None
    assert place(c, k, media=True).prefill is not None  # media: never by the index
    assert place(c, known(local_prefill_max_tokens=0, decode=k.decode)).prefill is not None  # the rule off
    _held(c.view, {b.url: 900}, live=frozenset({a.url, b.url}))  # 100 left: more than 64
    assert place(c, k).prefill is not None


async def test_a_turn_read_from_its_decode_is_not_overridden_by_the_index():
    k = known(local_prefill_max_tokens=64)
    a, b = k.decode.instances
    a.inflight = 3
    c = ctx()
    c.view = RequestView({"messages": []})
    _held(c.view, {b.url: 990})
    placed = place(c, k, turn=PreviousTurn(a, 500))
    assert placed.kv_from is a and placed.prefill is not None


async def test_an_ec_consumer_gets_its_ranks_in_rotation_and_their_addresses():
    d = pool("decode", 1, dp_size=2, ec_zmq_addrs=("tcp://a:1", "tcp://a:2"))
    k = known(decode=d)
    placed = [place(ctx(), k) for _ in range(3)]
    assert [p.rank for p in placed] == [0, 1, 0]
    assert [p.consumer_zmq for p in placed] == ["tcp://a:1", "tcp://a:2", "tcp://a:1"]
    assert place(ctx(), known(ec_consumer_dp_size=1)).rank is None


async def test_the_kv_hand_over_is_the_decode_placed_again_without_the_one_that_refused():
    k = known(decodes=3)
    c = ctx()
    placed = place(c, k)
    first = placed.decode
    c.failed(first)
    other = again(placed, c, k)
    assert other is not None and other is not first and placed.decode is other and placed.decode_why == HAND_OVER
    c.failed(other)
    c.failed(again(placed, c, k))
    assert again(placed, c, k) is None  # none spare: the failure is the answer


async def test_no_hand_over_when_the_decode_must_be_the_one():
    d = pool("decode", 2, dp_size=2)
    k = known(decode=d)
    c = ctx()
    placed = place(c, k)
    c.failed(placed.decode)
    assert placed.rank is not None and again(placed, c, k) is None
    d = pool("decode", 2, ec_zmq_addrs=("tcp://a:1",))
    k = known(decode=d)
    placed = place(c := ctx(), k)
    c.failed(placed.decode)
    assert again(placed, c, k) is None  # the EC consumer of the request's embeddings


async def test_alternatives_are_the_other_candidates_least_loaded_first():
    k = known(decodes=3)
    a, b, c = k.decode.instances
    a.inflight, b.inflight, c.inflight = 0, 5, 2
    placed = place(ctx(), k)
    assert placed.decode is a and placed.alternatives("decode") == [c, b]
    assert placed.alternatives("prefill") == []


def _card(name, parent=None):
    return {"id": name, "object": "model", "created": 1, "owned_by": "vllm", "root": f"/m/{name}",
            "parent": parent, "max_model_len": 512, "permission": []}


def _listing(*cards):
    return msgspec.json.encode({"object": "list", "data": list(cards)})


async def test_each_media_item_gets_its_encoder_in_the_placement():
    from epd_proxy.encode.multimodal import MediaItem
    encoders = pool("encode", 2, port=9200, policy="round-robin")
    k = known(encode=encoders)
    items = [MediaItem(i, 0, i, "image_url", {"type": "image_url", "image_url": {"url": f"http://x/{i}"}}, f"u{i}")
             for i in range(3)]
    placed = place(ctx(), k, True, None, False, None, items)
    assert placed.encoders == (items, [encoders.instances[0], encoders.instances[1], encoders.instances[0]])
    assert place(ctx(), k, True).encoders is None  # no items given: no encode leg
    none = known(encode=InstancePool("encode", ()))
    assert place(ctx(), none, True, None, False, None, items).encoders is None  # the encode stage says why


async def test_a_failed_attempt_is_placed_again_only_where_a_decode_can_take_it():
    from epd_proxy.placement.decision import worth_retrying
    k = known()
    a, b = k.decode.instances
    c = ctx()
    c.failed(a)
    assert worth_retrying(c, k, unsent=True)  # b has not failed it
    c.failed(b)
    assert not worth_retrying(c, k, unsent=True)  # both refused it: the failure is the answer
    assert worth_retrying(c, k, unsent=False)  # failed for the request's sake, still in rotation
    c.timed_out_on(a)
    c.timed_out_on(b)
    assert not worth_retrying(c, k, unsent=False)  # none that did not time out on it
    assert worth_retrying(c, known(prefill=InstancePool("prefill", ()), decode=k.decode), unsent=True)  # no prefill
