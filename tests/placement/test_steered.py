"""``epd-proxy sidecar`` (placement/steered.py): the prefill and encoders named by the gateway's
headers, carried out by the proxy's pipeline over real sockets against the simulator, and the
allow-list."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from helpers import Client, chat_body, stack, wait_for

from epd_proxy.config import InstanceSpec, ProxyConfig
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.steered import DEFAULT_ALLOWED, LearntInstances, addresses, parse_networks
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.runtime.sidecar import start_sidecar
from epd_proxy.sim import SimCluster, SimConfig, expected_text
from epd_proxy.wire.errors import ProxyError

ALLOWED = parse_networks(DEFAULT_ALLOWED)
SIM = SimConfig(itl_ms=0, ttft_ms=0.5)


def test_addresses_are_ip_literals_within_the_allow_list_in_order():
    assert addresses(b"10.1.2.3:8000, 127.0.0.1:9,10.1.2.3:8000", ALLOWED) == [
        "http://10.1.2.3:8000", "http://127.0.0.1:9"]
    assert addresses(b"[fd00::1]:8000", ALLOWED) == ["http://[fd00::1]:8000"]
    for bad in (b"8.8.8.8:80", b"evil.example:80", b"10.0.0.1", b"10.0.0.1:0", b"10.0.0.1:x",
                b"127.0.0.1:8000,1.1.1.1:80", b"[::ffff:8.8.8.8]:80"):
        with pytest.raises(ProxyError) as caught:
            addresses(bad, ALLOWED)
        assert caught.value.status == 403
    with pytest.raises(ProxyError, match="encoder address named is not allowed"):
        addresses(b"8.8.8.8:80", ALLOWED, "encoder")
    assert addresses(b"8.8.8.8:80", parse_networks(["8.8.8.0/24"])) == ["http://8.8.8.8:80"]


async def test_learnt_instances_join_their_pool_bounded_the_least_recently_named_leaving():
    pool = InstancePool("prefill", ())
    learnt = LearntInstances(pool, size=2)
    a = learnt.get("http://10.0.0.1:1")
    assert learnt.get("http://10.0.0.1:1") is a and pool.instances == [a] and a.source == "gateway"
    b = learnt.get("http://10.0.0.2:1")
    learnt.get("http://10.0.0.1:1")  # a named again: b is the least recently named
    c = learnt.get("http://10.0.0.3:1")
    assert len(learnt) == 2 and pool.instances == [a, c] and b not in pool.instances
    a.inflight = 1  # in flight: it stays even when least recently named
    learnt.get("http://10.0.0.4:1")
    assert a in pool.instances and c not in pool.instances
    await learnt.close()


async def test_apply_takes_the_first_named_in_rotation_not_failed_and_keeps_a_decode_holding_the_turn():
    from epd_proxy.instances.health import EJECTED
    from epd_proxy.placement.decision import HOLDS_TURN, Placement
    from epd_proxy.placement.steered import WHY, Steered, Steering

    prefill, encode, decode = InstancePool("prefill", ()), InstancePool("encode", ()), InstancePool("decode", ())
    steering = Steering(prefill, encode)
    d = decode.add(InstanceSpec("http://10.0.0.9:1", "decode"))
    steered = steering.read({b"x-prefiller-host-port": b"10.0.0.1:1,10.0.0.2:1,10.0.0.3:1",
                             b"x-encoder-hosts-ports": b"10.0.1.1:1"}, set())
    a, b, c = steered.prefills
    a.health.state = EJECTED  # out of rotation here: the next one named
    placed = steering.apply(steered, Placement(d, "least-loaded"), {b})  # b failed this request
    assert (placed.prefill, placed.prefill_why, placed.connector, list(placed.prefill_among)) == (c, WHY, "nixl",
                                                                                                   [a, c])
    placed = steering.apply(steered, Placement(d, "least-loaded"), {b, c})  # only an ejected one left: it
    assert placed.prefill is a
    placed = steering.apply(steered, Placement(d, "least-loaded"), {a, b, c})  # none left: the decode computes
    assert placed.prefill is None and placed.connector == "none"
    placed = steering.apply(steered, Placement(d, HOLDS_TURN), set())  # it holds the conversation
    assert placed.prefill is None
    assert steering.apply(Steered(), Placement(d, "least-loaded"), set()).prefill is None  # no header
    excluded: set = set()
    steering.read({b"x-encoder-hosts-ports": b"10.0.1.2:1"}, excluded)
    assert [i.url for i in excluded] == ["http://10.0.1.1:1"]  # the encoders not named are out of the request
    await steering.close()


def _sidecar_config(cluster: SimCluster, **kw) -> ProxyConfig:
    kw.setdefault("kv_connector", "nixl")
    return ProxyConfig(probe_interval=0, scrape_interval=0, decode=[InstanceSpec(cluster.urls("decode")[0], "decode")],
                       **kw)


def _served(cluster: SimCluster, role: str) -> list[str]:
    """The instances of ``role`` that received a request, in the order they received them."""
    got = [(rec.t_received, inst.url) for inst in cluster.instances(role) for rec in inst.records]
    return [url for _, url in sorted(got)]


def _hostport(url: str) -> bytes:
    return url.split("://", 1)[1].encode()


def _named(cluster: SimCluster, role: str = "prefill", i: int = 0) -> list[tuple[bytes, bytes]]:
    name = b"x-prefiller-host-port" if role == "prefill" else b"x-encoder-hosts-ports"
    return [(name, _hostport(cluster.urls(role)[i]))]


@pytest.mark.parametrize("stream", [False, True])
async def test_the_sidecar_runs_the_named_prefill_and_answers_as_the_proxy_does(stream):
    async with stack(prefill=2, decode=1, sim=SIM) as (cluster, proxy, client):
        body = chat_body("What is disaggregated serving?", stream=stream, max_tokens=12, seed=3)
        by_proxy = await client.chat(body)
        async with await start_sidecar(_sidecar_config(cluster)) as sidecar:
            side = Client(sidecar.url)
            try:
                cluster.clear_records()
                reply = await side.chat(body, _named(cluster, "prefill", 1))
                assert reply.status == 200, reply.body
                assert reply.text() == by_proxy.text() == expected_text(body)
                p, d = cluster.records("prefill"), cluster.records("decode")
                assert len(p) == 1 and len(d) == 1 and _served(cluster, "prefill") == [cluster.urls("prefill")[1]]
                # The NIXL pull hand-off: decode reads the prefill's KV, as the proxy asks it.
                params = d[0].json["kv_transfer_params"]
                assert params["do_remote_prefill"] is True and params["remote_engine_id"]
                assert "x-prefiller-host-port" not in d[0].headers  # the header is the sidecar's only
                cluster.clear_records()
                whole = await side.chat(body)  # no header: the local decode serves it whole
                assert whole.status == 200 and whole.text() == expected_text(body)
                assert cluster.records("prefill") == [] and len(cluster.records("decode")) == 1
                assert "kv_transfer_params" not in cluster.records("decode")[0].json
                await wait_for(lambda: cluster.held_kv_blocks == 0, timeout=5)
            finally:
                await side.close()


async def test_a_prefill_that_fails_is_retried_on_the_next_one_named_then_computed_by_the_decode():
    async with SimCluster(prefill=2, decode=1, config=SIM) as cluster:
        async with await start_sidecar(_sidecar_config(cluster, decode_retries=2)) as sidecar:
            side = Client(sidecar.url)
            try:
                for inst in cluster.instances("prefill"):
                    inst.inject("status=503", times=10)
                both = b",".join(_hostport(u) for u in cluster.urls("prefill"))
                body = chat_body("fall back", max_tokens=5)
                reply = await side.chat(body, [(b"x-prefiller-host-port", both)])
                assert reply.status == 200 and reply.text() == expected_text(body), reply.body
                assert _served(cluster, "prefill") == cluster.urls("prefill")  # in the order named
                [d] = cluster.records("decode")
                assert "kv_transfer_params" not in d.json  # none left: the decode computed the prompt
            finally:
                await side.close()


async def test_e_p_d_the_named_encoders_encode_and_no_header_leaves_the_media_to_the_engines():
    async with SimCluster(encode=2, prefill=1, decode=1, config=SIM) as cluster:
        async with await start_sidecar(_sidecar_config(cluster)) as sidecar:
            side = Client(sidecar.url)
            try:
                body = chat_body("describe", images=["https://x/a.png", "https://x/b.png"], max_tokens=4)
                headers = _named(cluster, "prefill") + _named(cluster, "encode", 1)
                reply = await side.chat(body, headers)
                assert reply.status == 200, reply.body
                assert _served(cluster, "encode") == [cluster.urls("encode")[1]]  # only the one named
                p = cluster.records("prefill")[-1]
                assert [c["type"] for c in p.json["messages"][0]["content"][1:]] == ["image_embeds"] * 2
                cluster.clear_records()
                reply = await side.chat(body, _named(cluster, "prefill"))  # no encoder named: none runs
                assert reply.status == 200, reply.body
                assert cluster.records("encode") == []
                p = cluster.records("prefill")[-1]
                assert [c["type"] for c in p.json["messages"][0]["content"][1:]] == ["image_url"] * 2
            finally:
                await side.close()


async def test_an_address_outside_the_allow_list_is_refused_in_the_apis_envelope_and_never_reached():
    async with SimCluster(encode=1, prefill=1, decode=1, config=SIM) as cluster:
        async with await start_sidecar(_sidecar_config(cluster), allowed=["10.0.0.0/8"]) as sidecar:
            side = Client(sidecar.url)
            try:
                reply = await side.chat(chat_body("hi"), _named(cluster, "prefill"))
                assert reply.status == 403
                assert reply.json()["error"]["message"] == "the prefill address named is not allowed here"
                reply = await side.chat(chat_body("hi", images=["https://x/a.png"]), _named(cluster, "encode"))
                assert reply.status == 403 and "encoder" in reply.json()["error"]["message"]
                reply = await side.post("/v1/messages", {"model": "sim-model", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "hi"}]},
                                        [(b"x-prefiller-host-port", b"evil.example:80")])
                assert reply.status == 403 and reply.json()["type"] == "error"  # Anthropic's envelope
                assert cluster.records() == []
            finally:
                await side.close()


async def test_a_prefill_a_push_connector_cannot_identify_is_refused():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, kv_connector="nixl-push")
    async with SimCluster(prefill=1, decode=1, config=sim) as cluster:
        async with await start_sidecar(_sidecar_config(cluster, kv_connector="nixl-push")) as sidecar:
            side = Client(sidecar.url)
            try:
                reply = await side.chat(chat_body("hi"), _named(cluster, "prefill"))
                assert reply.status == 403 and "identity" in reply.json()["error"]["message"]
                assert cluster.records() == []
            finally:
                await side.close()


async def test_a_client_gone_mid_stream_ends_both_legs_and_leaves_no_kv_held():
    """NIXL push, the prefill configured for its identity (and used only when named)."""
    sim = SimConfig(itl_ms=20, ttft_ms=0.5, kv_connector="nixl-push", push_registration_timeout=2.0,
                    kv_abort_timeout=2.0, roles={"prefill": {"ttft_ms": 300.0}})
    async with SimCluster(prefill=1, decode=1, config=sim) as cluster:
        config = config_for_cluster(cluster, ProxyConfig(probe_interval=0, scrape_interval=0))
        async with await start_sidecar(config) as sidecar:
            side = Client(sidecar.url)
            try:
                assert (await side.chat(chat_body("whole"))).status == 200
            finally:
                await side.close()
            assert cluster.records("prefill") == []  # configured, but not named: not used
            reader, writer = await asyncio.open_connection(*sidecar.url.removeprefix("http://").split(":"))
            raw = msgspec.json.encode(chat_body(stream=True, max_tokens=100))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"x-prefiller-host-port: %b\r\ncontent-length: %d\r\n\r\n%b"
                         % (_hostport(cluster.urls("prefill")[0]), len(raw), raw))
            await wait_for(lambda: cluster.records("prefill") and cluster.records("decode"))
            writer.transport.abort()
            await wait_for(lambda: cluster.records("prefill")[-1].done and cluster.records("decode")[-1].done)
            assert cluster.records("prefill")[-1].aborted and cluster.records("decode")[-1].aborted
            await wait_for(lambda: cluster.held_kv_blocks == 0, timeout=5)
