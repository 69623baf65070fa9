"""The roster: its pure decisions, and the shell over real (unprobed) pools."""

from __future__ import annotations

import msgspec
import pytest

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.health import EJECTED, HEALTHY
from epd_proxy.instances.instance import LEAVING
from epd_proxy.instances.membership import Membership
from epd_proxy.instances.pool import InstancePool
from epd_proxy.instances.roster import (
    MembershipConflict,
    RegistrationError,
    check_registration,
    infer_topology,
    parse_registration,
    parse_url_param,
    registered_role,
    required_roles,
    roster_diff,
)
from epd_proxy.placement.choose import choose


def body(**fields) -> bytes:
    return msgspec.json.encode(fields)


# -- parse_registration ---------------------------------------------------------------------
def test_registrars_payload():
    """vLLM's ProxyRegistrar sends role, url, ec_zmq_addrs and dp_size, nothing else."""
    spec = parse_registration(body(role="decode", url="http://10.0.0.5:8000/", ec_zmq_addrs=["tcp://10.0.0.5:7000"],
                                   dp_size=1))
    assert spec == InstanceSpec("http://10.0.0.5:8000", "decode", ec_zmq_addrs=("tcp://10.0.0.5:7000",))


def test_reference_payload_with_metadata_and_push_attributes():
    spec = parse_registration(body(role="prefill", url="http://p1:8100", metadata={"x": 1}, engine_id="prefill-0",
                                   kv_host="10.0.0.1", kv_port=5600, tp=2, pp=1, bootstrap_port=8998, extra="ok"))
    assert (spec.role, spec.engine_id, spec.kv_host, spec.kv_port, spec.tp, spec.bootstrap_port) == (
        "prefill", "prefill-0", "10.0.0.1", 5600, 2, 8998)


def test_prefill_decode_routes_as_decode():
    spec = parse_registration(body(role="prefill_decode", url="pd1:8000"))
    assert spec.role == "decode" and spec.pd and spec.url == "http://pd1:8000"
    assert registered_role(spec) == "prefill_decode"


@pytest.mark.parametrize("raw, param", [
    (b"not json", None),
    (b"[1]", None),
    (body(url="http://h:1"), "role"),
    (body(role="router", url="http://h:1"), "role"),
    (body(role="decode"), "url"),
    (body(role="decode", url="ftp://h:1"), "url"),
    (body(role="decode", url="http://h:1;tp=2"), "url"),
    (body(role="decode", url="http://h:1", dp_size=0), "dp_size"),
    (body(role="decode", url="http://h:1", dp_size="2"), "dp_size"),
    (body(role="decode", url="http://h:1", kv_port=70000), "kv_port"),
    (body(role="decode", url="http://h:1", ec_zmq_addrs="tcp://x"), "ec_zmq_addrs"),
    (body(role="decode", url="http://h:1", dp_size=2, ec_zmq_addrs=["tcp://x"]), "ec_zmq_addrs"),
    (body(role="prefill", url="http://h:1", engine_id=""), "engine_id"),
])
def test_unusable_bodies(raw, param):
    with pytest.raises(RegistrationError) as exc:
        parse_registration(raw)
    assert exc.value.param == param


def test_url_query_parameter():
    assert parse_url_param("url=http%3A%2F%2Fh%3A1%2F") == "http://h:1"
    assert parse_url_param("other=1") is None


# -- check_registration ---------------------------------------------------------------------
D = InstanceSpec("http://d:1", "decode")
P = InstanceSpec("http://p:1", "prefill")
PD = InstanceSpec("http://pd:1", "decode", pd=True)
E = InstanceSpec("http://e:1", "encode")


def test_role_change_needs_unregistering_first():
    assert "unregister it" in check_registration(InstanceSpec("http://d:1", "encode"), [D])
    assert check_registration(D, [D]) is None  # the same record again: a refresh
    assert "unregister it" in check_registration(InstanceSpec("http://d:1", "decode", pd=True), [D])


def test_prefill_decode_is_not_mixed_with_split_instances():
    assert "cannot be mixed" in check_registration(PD, [P])
    assert "cannot be mixed" in check_registration(PD, [D])
    assert "cannot be mixed" in check_registration(P, [PD])
    assert "cannot be mixed" in check_registration(D, [PD])
    assert check_registration(E, [PD]) is None
    assert check_registration(InstanceSpec("http://pd2:1", "decode", pd=True), [PD, E]) is None


def test_registrars_e_pd_cluster_registers_decode():
    """The registrar announces a PD instance as decode: E+PD with no prefill is fine."""
    assert check_registration(D, [E]) is None
    assert infer_topology(["encode", "decode"]) == "E+PD"


def test_pinned_topology_takes_only_its_roles():
    assert "pinned to E+PD" in check_registration(P, [], "E+PD")
    assert "pinned to P+D" in check_registration(E, [], "P+D")
    assert "pinned to E+P+D" in check_registration(PD, [], "E+P+D")
    assert check_registration(PD, [], "PD") is None
    assert check_registration(D, [], "E+P+D") is None


# -- topology, diff -------------------------------------------------------------------------
@pytest.mark.parametrize("roles, topology, needed", [
    ([], "none", ("decode",)),
    (["decode"], "PD", ("decode",)),
    (["encode", "decode"], "E+PD", ("encode", "decode")),
    (["prefill", "decode"], "P+D", ("prefill", "decode")),
    (["encode", "prefill", "decode"], "E+P+D", ("encode", "prefill", "decode")),
    (["prefill"], "P+D", ("prefill", "decode")),  # a prefill with no decode yet: not ready
])
def test_topology_follows_what_registered(roles, topology, needed):
    assert infer_topology(roles) == topology
    assert required_roles(topology) == needed


def test_pinned_topology_wins():
    assert infer_topology([], "E+P+D") == "E+P+D"
    assert required_roles("E+P+D") == ("encode", "prefill", "decode")


def test_roster_diff():
    d2 = InstanceSpec("http://d2:1", "decode")
    d2_new = InstanceSpec("http://d2:1", "decode", dp_size=2)
    diff = roster_diff([D, d2], [d2_new, P])
    assert diff.added == [P] and diff.removed == [D] and diff.changed == [(d2, d2_new)]
    assert not roster_diff([D], [D])


# -- the shell --------------------------------------------------------------------------------
def membership(ttl=900.0, topology="auto", static=()):
    pools = {r: InstancePool(r, [s for s in static if s.role == r], policy="round-robin")
             for r in ("encode", "prefill", "decode")}
    return Membership(pools, evicted_ttl=ttl, topology=topology)


async def test_register_is_idempotent_and_refreshes_attributes():
    m = membership()
    events = []
    m.subscribe(lambda c: events.append((c.event, c.spec.url, c.source)))
    assert m.register(D) is True
    inst = m.find("http://d:1/")
    assert m.register(D) is False
    assert m.register(InstanceSpec("http://d:1", "decode", dp_size=2)) is False
    assert m.find("http://d:1") is inst and inst.spec.dp_size == 2
    assert [e[0] for e in events] == ["registered", "refreshed", "updated"]
    with pytest.raises(MembershipConflict):
        m.register(InstanceSpec("http://d:1", "prefill"))
    assert len(m.pools["decode"]) == 1 and not m.pools["prefill"]
    await m.close()


async def test_a_join_keeps_the_rotation_going():
    """Membership changes never reset the cursor: the next pick continues the rotation
    instead of going back to the first instance."""
    m = membership(static=[InstanceSpec(f"http://d{i}:1", "decode") for i in range(3)])
    pool = m.pools["decode"]
    picks = [choose(pool).url for _ in range(2)]
    m.register(InstanceSpec("http://d3:1", "decode"))
    picks += [choose(pool).url for _ in range(4)]
    assert picks[:2] == ["http://d0:1", "http://d1:1"]
    assert picks[2] == "http://d2:1"  # not d0 again
    assert set(picks[2:]) == {"http://d0:1", "http://d1:1", "http://d2:1", "http://d3:1"}
    await m.close()


async def test_unregister_leaves_routing_at_once_and_closes_when_idle():
    m = membership()
    m.register(D)
    m.register(InstanceSpec("http://d2:1", "decode"))
    inst = m.find(D.url)
    inst.inflight = 1  # a request holds it
    assert m.unregister(D.url) is True
    assert m.unregister(D.url) is False
    assert all(choose(m.pools["decode"]) is not inst for _ in range(4))
    assert [i["url"] for i in m.snapshot()["instances"] if i["leaving"]] == [D.url]
    m.sweep(0.0)
    assert m.counts()[("decode", "leaving")] == 1
    inst.inflight = 0
    m.sweep(0.0)
    assert ("decode", "leaving") not in m.counts()
    assert m.removals == {("decode", "unregistered"): 1}
    await m.close()


async def test_unregister_by_source_only_touches_that_sources_instances():
    m = membership(static=[D])
    assert m.unregister(D.url, source="dns") is False
    assert m.find(D.url) is not None
    await m.close()


async def test_drained_instance_gets_nothing_new_and_leaves_when_idle():
    m = membership()
    m.register(D)
    inst = m.find(D.url)
    inst.inflight = 2
    assert m.drain(D.url) is True
    snap = m.snapshot()
    assert snap["decode"] == {"live": [], "evicted": [], "draining": [D.url]}
    # The only decode instance, draining: no panic routing onto it.
    with pytest.raises(Exception) as exc:
        choose(m.pools["decode"])
    assert getattr(exc.value, "status", None) == 503
    m.sweep(0.0)
    assert m.find(D.url) is inst
    inst.inflight = 0
    m.sweep(0.0)
    assert m.find(D.url) is None
    assert m.removals == {("decode", "drained"): 1}
    assert m.drain(D.url) is False
    await m.close()


async def test_evicted_instance_is_forgotten_after_the_ttl_unless_it_comes_back():
    m = membership(ttl=10.0, static=[InstanceSpec("http://static:1", "decode")])
    m.register(D)
    m.register(InstanceSpec("http://d2:1", "decode"))
    for url in (D.url, "http://d2:1", "http://static:1"):
        m.find(url).health.state = "ejected"
    m.sweep(100.0)  # out since 100
    m.find("http://d2:1").health.state = "healthy"  # a probe brought it back
    m.sweep(105.0)
    m.find("http://d2:1").health.state = "ejected"  # out again: its clock restarts
    m.sweep(109.0)
    assert m.find(D.url) is not None
    m.sweep(110.0)
    assert m.find(D.url) is None  # forgotten
    assert m.find("http://d2:1") is not None
    assert m.find("http://static:1") is not None  # flags' instances are never forgotten
    assert m.snapshot()["decode"]["evicted"] == ["http://static:1", "http://d2:1"]
    assert m.removals == {("decode", "forgotten"): 1}
    await m.close()


async def test_reannouncing_restarts_the_ttl_clock():
    m = membership(ttl=10.0)
    m.register(D)
    m.find(D.url).health.state = "ejected"
    m.sweep(100.0)
    m.sweep(105.0)
    m.register(D)  # the registrar still announces it
    m.sweep(112.0)
    assert m.find(D.url) is not None
    await m.close()


async def test_ttl_zero_never_forgets():
    m = membership(ttl=0.0)
    m.register(D)
    m.find(D.url).health.state = "ejected"
    m.sweep(0.0)
    m.sweep(1e9)
    assert m.find(D.url) is not None
    await m.close()


async def test_the_roster_state_is_on_the_instance():
    """Source, out-of-rotation clock and leaving are the instance's own fields."""
    m = membership(ttl=10.0, static=[InstanceSpec("http://static:1", "decode")])
    m.register(D, source="dns:decode:x")
    inst, static = m.find(D.url), m.find("http://static:1")
    assert (inst.source, static.source) == ("dns:decode:x", "static")
    assert (inst.out_since, inst.leaving) == (None, False)
    inst.health.state = EJECTED
    m.sweep(100.0)
    assert inst.out_since == 100.0
    assert static.out_since is None  # never forgotten: no clock
    inst.health.state = HEALTHY
    m.sweep(101.0)
    assert inst.out_since is None
    inst.inflight = 1
    m.unregister(D.url)
    assert inst.leaving is True
    assert m.counts()[("decode", LEAVING)] == 1
    await m.close()


async def test_apply_makes_one_sources_set_exact():
    m = membership(static=[InstanceSpec("http://static:1", "decode")])
    m.register(InstanceSpec("http://api:1", "decode"), source="api")
    d1, d2 = InstanceSpec("http://c1:1", "decode"), InstanceSpec("http://c2:1", "decode")
    diff = m.apply([d1, d2], source="config")
    assert diff.added == [d1, d2] and not diff.removed
    d2b = InstanceSpec("http://c2:1", "decode", dp_size=2)
    e = InstanceSpec("http://c3:1", "encode")
    diff = m.apply([d2b, e, InstanceSpec("http://api:1", "decode")], source="config")
    assert diff.removed == [d1] and diff.changed == [(d2, d2b)]
    assert [s.url for s, _ in diff.rejected] == ["http://api:1"]  # another source's
    assert m.find("http://c1:1").state == "draining"
    assert m.find("http://c2:1").spec.dp_size == 2
    assert m.source_of(m.find("http://api:1")) == "api"
    assert m.find("http://static:1") is not None
    assert m.topology == "E+PD"
    await m.close()


async def test_pinned_topology_rejects_other_roles():
    m = membership(topology="E+PD")
    with pytest.raises(MembershipConflict):
        m.register(P)
    assert m.topology == "E+PD" and m.required_roles() == ("encode", "decode")
    await m.close()


async def test_apply_brings_back_an_instance_it_was_draining():
    m = membership()
    m.apply([D], source="dns")
    old = m.find(D.url)
    old.inflight = 1
    m.apply([], source="dns")
    assert old.state == "draining"
    diff = m.apply([D], source="dns")
    assert diff.added == [D] and not diff.rejected
    new = m.find(D.url)
    assert new is not old and new.state == "healthy"
    assert m.counts() == {("decode", "healthy"): 1, ("decode", "leaving"): 1}
    await m.close()


async def test_roles_from_the_flags_stay_in_the_topology():
    """A P/D proxy whose prefills all left is not ready and answers 503 for prefill; it does
    not quietly become PD. Roles that only registered come and go with their instances."""
    m = membership(static=[P, D])
    m.unregister(P.url)
    assert m.topology == "P+D" and m.required_roles() == ("prefill", "decode")
    m.register(E)
    assert m.topology == "E+P+D"
    m.unregister(E.url)
    assert m.topology == "P+D"
    assert infer_topology(["decode"], configured=["prefill", "decode"]) == "P+D"
    await m.close()


def test_a_reannouncement_keeps_what_it_leaves_out():
    from epd_proxy.instances.roster import merge_announcement
    known = InstanceSpec("http://p:1", "prefill", engine_id="p0", kv_host="10.0.0.1", kv_port=5600, tp=2,
                         dp_size=2, ec_zmq_addrs=("tcp://a", "tcp://b"))
    registrar = parse_registration(body(role="prefill", url="http://p:1", ec_zmq_addrs=[], dp_size=1))
    assert merge_announcement(known, registrar) == known
    moved = parse_registration(body(role="prefill", url="http://p:1", kv_port=5700))
    assert merge_announcement(known, moved) == InstanceSpec(
        "http://p:1", "prefill", engine_id="p0", kv_host="10.0.0.1", kv_port=5700, tp=2, dp_size=2,
        ec_zmq_addrs=("tcp://a", "tcp://b"))


async def test_registrar_refresh_does_not_wipe_a_launchers_attributes():
    m = membership()
    full = InstanceSpec("http://p:1", "prefill", engine_id="p0", kv_host="h", kv_port=5600)
    m.register(full)
    assert m.register(InstanceSpec("http://p:1", "prefill")) is False
    assert m.find("http://p:1").spec == full
    await m.close()


def test_a_pinned_topology_refuses_configured_instances_it_has_no_place_for():
    from epd_proxy.config import ProxyConfig, parse_instance
    from epd_proxy.instances.roster import check_pinned_topology
    cfg = ProxyConfig(prefill=[parse_instance("http://p:1", "prefill")],
                      decode=[parse_instance("http://d:2", "decode")])
    check_pinned_topology(cfg)  # auto: anything goes
    check_pinned_topology(cfg.replace(topology="P+D"))
    with pytest.raises(ValueError, match="http://p:1: the topology is pinned to E\\+PD: it has no prefill instances"):
        check_pinned_topology(cfg.replace(topology="E+PD"))
