"""The roster's HTTP surface over real sockets: a proxy in front of simulated vLLM
instances that join and leave through ``/instances``, the way vLLM's registrar
and the reference proxy's launchers do it."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import msgspec
import pytest
from helpers import JSON, Client, chat_body, wait_for

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig

KEY = [(b"x-api-key", b"K")]
IMAGE = "https://example.com/cat.png"


@contextlib.asynccontextmanager
async def empty_proxy(sim: SimConfig | None = None, static: bool = False, **proxy_kwargs):
    """A simulated cluster and a proxy that starts knowing none of it (unless ``static``)."""
    sim = sim or SimConfig(itl_ms=0, ttft_ms=0.5)
    counts = {r: proxy_kwargs.pop(r, 0) for r in ("encode", "prefill", "decode", "pd")}
    proxy_kwargs.setdefault("scrape_interval", 0)  # no GET /metrics among the records (as helpers.stack)
    async with SimCluster(**counts, config=sim) as cluster:
        base = ProxyConfig(probe_interval=proxy_kwargs.pop("probe_interval", 0), **proxy_kwargs)
        config = config_for_cluster(cluster, base) if static else base.replace(dynamic_registration=True)
        async with await start_proxy(config) as proxy:
            client = Client(proxy.url)
            try:
                yield cluster, proxy, client
            finally:
                await client.close()


def announcement(role: str, url: str, **extra) -> dict:
    """What vLLM's ProxyRegistrar POSTs (and DELETEs on shutdown)."""
    return {"role": role, "url": url, "ec_zmq_addrs": [], "dp_size": 1, **extra}


async def announce(client: Client, role: str, url: str, headers=None, **extra):
    return await client.post("/instances", announcement(role, url, **extra), headers)


async def delete(client: Client, payload: dict | None = None, query: str = "", headers=None):
    raw = msgspec.json.encode(payload) if payload is not None else b""
    return await client.request("DELETE", "/instances" + query, raw, JSON + list(headers or []))


def served(inst) -> int:
    return len(inst.generation_records())


# -- empty roster, registrar shapes, topology -------------------------------------------------
@pytest.mark.parametrize("per_role", [1, 2])
async def test_empty_roster_filled_by_registrars(per_role):
    """Started with nothing: not ready and 503 (with Retry-After) until every role the
    inferred topology needs has registered; then it serves, and the instances that
    registered are the ones used."""
    # least-loaded: the same prompt each time, and every registered instance must be used
    async with empty_proxy(prefill=per_role, decode=per_role, admin_api_key="K", routing="least-loaded",
                           registration_allow=("127.0.0.0/8",)) as (cluster, proxy, client):
        r = await client.request("GET", "/ready")
        assert r.status == 503
        r = await client.chat(chat_body())
        assert r.status == 503 and r.headers[b"retry-after"]
        assert r.json()["error"]["message"] == "no decode instance available"

        for url in cluster.urls("prefill"):  # the registrar sends no key: allowed by network
            r = await announce(client, "prefill", url)
            assert (r.status, r.json()) == (200, {"registered": True})
        r = await client.request("GET", "/ready")
        assert r.status == 503 and r.json()["no_instances"] == ["decode"]
        for url in cluster.urls("decode"):
            assert (await announce(client, "decode", url)).json() == {"registered": True}
            assert (await announce(client, "decode", url + "/")).json() == {"registered": False}  # re-announce

        assert (await client.request("GET", "/ready")).status == 200
        status = (await client.request("GET", "/status", headers=KEY)).json()
        assert status["topology"] == "P+D"
        for _ in range(4):
            r = await client.chat(chat_body(stream=True))
            assert r.status == 200 and r.events[-1] == b"data: [DONE]"
        assert all(served(i) >= 1 for i in cluster.instances("decode") + cluster.instances("prefill"))

        roster = (await client.request("GET", "/instances", headers=KEY)).json()
        assert roster["prefill"]["live"] == cluster.urls("prefill")
        assert roster["decode"]["live"] == cluster.urls("decode")
        assert roster["encode"] == {"live": [], "evicted": [], "draining": []}
        assert {i["source"] for i in roster["instances"]} == {"api"}

        # The registrar's shutdown: DELETE with the same JSON body.
        gone = cluster.urls("decode")[0]
        r = await delete(client, announcement("decode", gone))
        assert (r.status, r.json()) == (200, {"removed": True})
        assert (await delete(client, announcement("decode", gone))).json() == {"removed": False}
        roster = (await client.request("GET", "/instances", headers=KEY)).json()
        assert gone not in roster["decode"]["live"]


async def test_e_pd_cluster_registered_the_registrars_way():
    """The registrar announces a PD instance as decode: with encoders, that is E+PD,
    and images go through the encoders."""
    async with empty_proxy(encode=1, pd=1, admin_api_key="K") as (cluster, proxy, client):
        assert (await announce(client, "encode", cluster.urls("encode")[0], KEY)).status == 200
        assert (await announce(client, "decode", cluster.urls("pd")[0], KEY)).status == 200
        assert proxy.app.topology == "E+PD"
        r = await client.chat(chat_body(images=[IMAGE]))
        assert r.status == 200
        assert served(cluster.instances("encode")[0]) == 1


async def test_reference_launcher_shapes():
    """The reference proxy's launchers: prefill_decode roles, DELETE ?url=."""
    async with empty_proxy(pd=1, admin_api_key="K") as (cluster, proxy, client):
        url = cluster.urls("pd")[0]
        r = await client.post("/instances", {"role": "prefill_decode", "url": url}, KEY)
        assert r.json() == {"registered": True}
        roster = (await client.request("GET", "/instances", headers=KEY)).json()
        assert roster["prefill_decode"]["live"] == [url] and roster["decode"]["live"] == []
        assert (await client.chat(chat_body())).status == 200
        r = await delete(client, query=f"?url={url}", headers=KEY)
        assert r.json() == {"removed": True}
        assert (await client.chat(chat_body())).status == 503


# -- joining and leaving mid-traffic ------------------------------------------------------------
async def test_instance_joining_mid_traffic_gets_traffic_at_once():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"decode": {"itl_ms": 5}})
    async with empty_proxy(sim=sim, static=True, prefill=1, decode=1, admin_api_key="K",
                           probe_interval=0.2) as (cluster, proxy, client):
        async with SimCluster(decode=1, config=sim) as more:
            streaming = asyncio.create_task(client.chat(chat_body(stream=True, max_tokens=20)))
            await wait_for(lambda: proxy.app.pools["decode"].instances[0].inflight > 0)
            assert (await announce(client, "decode", more.urls("decode")[0], KEY)).status == 200
            # In rotation from the moment it registered: no probe needed first.
            for _ in range(3):
                assert (await client.chat(chat_body())).status == 200
            assert served(more.instances("decode")[0]) >= 1
            assert (await streaming).status == 200


async def _streaming_on(proxy, client, max_tokens=30):
    """A streaming request in flight, and the decode instance it holds."""
    task = asyncio.create_task(client.chat(chat_body(stream=True, max_tokens=max_tokens)))
    pool = proxy.app.pools["decode"]
    await wait_for(lambda: any(i.inflight for i in pool.instances))
    return task, next(i for i in pool.instances if i.inflight)


def _whole_stream(reply, max_tokens=30) -> None:
    assert reply.status == 200
    assert reply.events[-1] == b"data: [DONE]"
    assert not any(b'"error"' in e for e in reply.events)


@pytest.mark.parametrize("per_role", [1, 2])
async def test_unregister_finishes_streams_in_flight_then_sends_nothing(per_role):
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"decode": {"itl_ms": 10}})
    async with empty_proxy(sim=sim, static=True, prefill=1, decode=per_role,
                           admin_api_key="K") as (cluster, proxy, client):
        task, inst = await _streaming_on(proxy, client)
        sim_inst = next(i for i in cluster.instances("decode") if i.url == inst.url)
        r = await delete(client, query=f"?url={inst.url}", headers=KEY)
        assert r.json() == {"removed": True}
        roster = (await client.request("GET", "/instances", headers=KEY)).json()
        assert [i["url"] for i in roster["instances"] if i["leaving"]] == [inst.url]
        before = served(sim_inst)
        for _ in range(3):
            r = await client.chat(chat_body())
            assert r.status == (200 if per_role == 2 else 503)
        _whole_stream(await task)
        assert served(sim_inst) == before  # nothing new after it left
        await wait_for(lambda: ("decode", "leaving") not in proxy.app.membership.counts())
        metrics = (await client.request("GET", "/metrics", headers=KEY)).body.decode()
        assert 'epd_proxy_removals_total{reason="unregistered",role="decode"} 1.0' in metrics


@pytest.mark.parametrize("per_role", [1, 2])
async def test_drain_finishes_streams_then_leaves(per_role):
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, roles={"decode": {"itl_ms": 10}})
    async with empty_proxy(sim=sim, static=True, prefill=1, decode=per_role,
                           admin_api_key="K") as (cluster, proxy, client):
        task, inst = await _streaming_on(proxy, client)
        sim_inst = next(i for i in cluster.instances("decode") if i.url == inst.url)
        r = await client.post("/instances/drain", {"url": inst.url}, KEY)
        assert r.status == 200 and r.json()["draining"] is True
        roster = (await client.request("GET", "/instances", headers=KEY)).json()
        assert roster["decode"]["draining"] == [inst.url]
        status = (await client.request("GET", "/status", headers=KEY)).json()
        assert [p["state"] for p in status["pools"]["decode"] if p["url"] == inst.url] == ["draining"]
        metrics = (await client.request("GET", "/metrics", headers=KEY)).body.decode()
        assert 'epd_proxy_roster_instances{role="decode",state="draining"} 1.0' in metrics
        before = served(sim_inst)
        r = await client.chat(chat_body())
        assert r.status == (200 if per_role == 2 else 503)
        _whole_stream(await task)
        assert served(sim_inst) == before
        await wait_for(lambda: proxy.app.membership.find(inst.url) is None)
        metrics = (await client.request("GET", "/metrics", headers=KEY)).body.decode()
        assert 'epd_proxy_removals_total{reason="drained",role="decode"} 1.0' in metrics
        assert (await client.post("/instances/drain", {"url": inst.url}, KEY)).status == 404


# -- who may change the roster ------------------------------------------------------------------
async def test_key_rules_and_nothing_changes_on_refusal():
    async with empty_proxy(decode=1, admin_api_key="K") as (cluster, proxy, client):
        url = cluster.urls("decode")[0]
        r = await announce(client, "decode", url)
        assert r.status == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = await announce(client, "decode", url, [(b"x-api-key", b"nope")])
        assert r.status == 403 and r.json()["error"]["code"] == 403
        assert (await client.request("GET", "/instances")).status == 401
        assert (await client.request("GET", "/status")).status == 401
        assert (await client.request("GET", "/status", headers=[(b"x-api-key", b"nope")])).status == 403
        roster = (await client.request("GET", "/instances", headers=KEY)).json()
        assert roster["decode"]["live"] == []
        assert (await announce(client, "decode", url, KEY)).status == 200
        assert (await delete(client, announcement("decode", url))).status == 401
        assert (await client.post("/instances/drain", {"url": url})).status == 401
        assert (await client.post("/start_profile", {})).status == 401
        assert proxy.app.membership.find(url).state == "healthy"


async def test_no_key_means_no_changes_but_open_views():
    async with empty_proxy(static=True, decode=1) as (cluster, proxy, client):
        r = await announce(client, "decode", "http://127.0.0.1:9")
        assert r.status == 403 and "no admin API key" in r.json()["error"]["message"]
        assert (await delete(client, query=f"?url={cluster.urls('decode')[0]}")).status == 403
        assert len(proxy.app.pools["decode"]) == 1
        assert (await client.request("GET", "/instances")).status == 200
        assert (await client.request("GET", "/status")).status == 200


async def test_keyless_registration_only_from_allowed_networks():
    async with empty_proxy(decode=1, registration_allow=("10.0.0.0/8",)) as (cluster, proxy, client):
        r = await announce(client, "decode", cluster.urls("decode")[0])
        assert r.status == 403 and "not allowed from this address" in r.json()["error"]["message"]
        assert not proxy.app.pools["decode"]


# -- what the roster refuses ------------------------------------------------------------------------
async def test_conflicts_and_bad_bodies():
    async with empty_proxy(prefill=1, decode=1, pd=1, admin_api_key="K") as (cluster, proxy, client):
        d, p, pd = cluster.urls("decode")[0], cluster.urls("prefill")[0], cluster.urls("pd")[0]
        assert (await announce(client, "decode", d, KEY)).status == 200
        r = await announce(client, "prefill", d, KEY)
        assert r.status == 409 and "unregister it" in r.json()["error"]["message"]
        r = await announce(client, "prefill_decode", pd, KEY)
        assert r.status == 409 and "cannot be mixed" in r.json()["error"]["message"]
        r = await client.post("/instances", b"{not json", KEY)
        assert r.status == 422 and r.json()["error"]["type"] == "UnprocessableEntityError"
        r = await client.post("/instances", {"role": "decode", "url": p, "dp_size": 0}, KEY)
        assert r.status == 422 and r.json()["error"]["param"] == "dp_size"
        assert (await delete(client, headers=KEY)).status == 422
        roster = (await client.request("GET", "/instances", headers=KEY)).json()
        assert roster["decode"]["live"] == [d] and roster["prefill"]["live"] == []
        assert roster["prefill_decode"]["live"] == []


async def test_push_connector_needs_the_prefills_identity():
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, kv_connector="nixl-push")
    async with empty_proxy(sim=sim, prefill=1, decode=1, admin_api_key="K",
                           kv_connector="nixl-push") as (cluster, proxy, client):
        ident = cluster.prefill_identity()
        r = await announce(client, "prefill", ident["url"], KEY)
        assert r.status == 422 and "engine_id" in r.json()["error"]["message"]
        r = await announce(client, "prefill", ident["url"], KEY, engine_id=ident["engine_id"],
                           kv_host=ident["kv_host"], kv_port=ident["kv_port"])
        assert r.status == 200
        assert (await announce(client, "decode", cluster.urls("decode")[0], KEY)).status == 200
        r = await client.chat(chat_body(stream=True))
        assert r.status == 200 and r.events[-1] == b"data: [DONE]"


async def test_pinned_topology_needs_every_role():
    async with empty_proxy(encode=1, prefill=1, decode=1, admin_api_key="K",
                           topology="E+P+D") as (cluster, proxy, client):
        for role in ("prefill", "decode"):
            assert (await announce(client, role, cluster.urls(role)[0], KEY)).status == 200
        r = await client.request("GET", "/ready")
        assert r.status == 503 and r.json()["no_instances"] == ["encode"]
        r = await client.chat(chat_body(images=[IMAGE]))
        assert r.status == 503 and r.json()["error"]["message"] == "no encode instance available"
        assert r.headers[b"retry-after"]
        assert (await client.chat(chat_body())).status == 200  # text needs no encoder
        assert (await announce(client, "encode", cluster.urls("encode")[0], KEY)).status == 200
        assert (await client.chat(chat_body(images=[IMAGE]))).status == 200
        assert (await client.request("GET", "/ready")).status == 200


# -- health and the TTL -------------------------------------------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_dead_instance_is_forgotten_after_the_ttl():
    async with empty_proxy(decode=1, admin_api_key="K", probe_interval=0.05, probe_timeout=0.5,
                           fail_threshold=1, evicted_ttl=0.2) as (cluster, proxy, client):
        dead = f"http://127.0.0.1:{_closed_port()}"
        assert (await announce(client, "decode", dead, KEY)).status == 200
        assert (await announce(client, "decode", cluster.urls("decode")[0], KEY)).status == 200
        m = proxy.app.membership
        await wait_for(lambda: m.find(dead) is not None and m.find(dead).health.out)
        roster = (await client.request("GET", "/instances", headers=KEY)).json()
        assert dead in roster["decode"]["evicted"] or m.find(dead) is None
        await wait_for(lambda: m.find(dead) is None)
        assert m.removals == {("decode", "forgotten"): 1}
        assert m.find(cluster.urls("decode")[0]).healthy


async def test_probe_brings_an_evicted_instance_back_before_the_ttl():
    async with empty_proxy(decode=2, admin_api_key="K", probe_interval=0.05, probe_timeout=0.5,
                           fail_threshold=1, evicted_ttl=60) as (cluster, proxy, client):
        for url in cluster.urls("decode"):
            await announce(client, "decode", url, KEY)
        sick = cluster.instances("decode")[0]
        inst = proxy.app.membership.find(sick.url)
        sick.set_health(False)
        await wait_for(lambda: inst.health.out)
        roster = (await client.request("GET", "/instances", headers=KEY)).json()
        assert roster["decode"]["evicted"] == [sick.url]
        sick.set_health(True)
        await wait_for(lambda: inst.healthy)
        roster = (await client.request("GET", "/instances", headers=KEY)).json()
        assert sorted(roster["decode"]["live"]) == sorted(cluster.urls("decode"))


# -- profiling ---------------------------------------------------------------------------------------
async def test_profiling_is_forwarded_to_every_instance():
    async with empty_proxy(static=True, encode=1, prefill=1, decode=2, admin_api_key="K") as (cluster, proxy,
                                                                                               client):
        r = await client.post("/start_profile", {}, KEY)
        # The simulator has no profiler (404 everywhere): the reference's 503.
        assert r.status == 503 and "profiling" in r.json()["error"]["message"]
        for inst in cluster.all_instances():
            assert [rec.path for rec in inst.records] == ["/start_profile"]


async def test_registered_ec_consumer_addresses_follow_the_replica():
    """A decode instance's registered ec_zmq_addrs (one per DP replica) are where the encoder
    pushes, for the replica the request is pinned to; no flag needed."""
    zmq = ["tcp://10.0.0.5:19019", "tcp://10.0.0.5:19020"]
    async with empty_proxy(encode=1, pd=1, admin_api_key="K") as (cluster, proxy, client):
        await announce(client, "encode", cluster.urls("encode")[0], KEY)
        r = await client.post("/instances", {"role": "decode", "url": cluster.urls("pd")[0], "ec_zmq_addrs": zmq,
                                             "dp_size": 2}, KEY)
        assert r.status == 200
        for i in range(4):
            assert (await client.chat(chat_body(images=[f"https://x/z{i}.png"]))).status == 200
        ranks = [int(r.headers["x-data-parallel-rank"]) for r in cluster.records("pd")]
        assert ranks == [0, 1, 0, 1]
        sent = [r.json["ec_transfer_params"]["consumer_zmq"] for r in cluster.records("encode")]
        assert sent == [zmq[rank] for rank in ranks]


async def test_mooncake_engine_ids_are_asked_again_after_a_prefill_rejoins():
    """A prefill that leaves and registers again may be a restarted engine: its Mooncake
    engine ids are asked anew, not taken from before."""
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, kv_connector="mooncake")
    async with empty_proxy(sim=sim, prefill=1, decode=1, admin_api_key="K",
                           kv_connector="mooncake") as (cluster, proxy, client):
        ident = cluster.prefill_identity()
        r = await announce(client, "prefill", ident["url"], KEY)
        assert r.status == 422 and "bootstrap" in r.json()["error"]["message"]
        attrs = {"kv_host": ident["kv_host"], "bootstrap_port": ident["bootstrap_port"]}
        assert (await announce(client, "prefill", ident["url"], KEY, **attrs)).status == 200
        assert (await announce(client, "decode", cluster.urls("decode")[0], KEY)).status == 200

        def queries() -> int:
            return sum(1 for r in cluster.records("prefill") if r.path == "/query")

        for _ in range(2):
            assert (await client.chat(chat_body())).status == 200
        assert queries() == 1
        assert (await delete(client, query=f"?url={ident['url']}", headers=KEY)).json() == {"removed": True}
        assert (await announce(client, "prefill", ident["url"], KEY, **attrs)).status == 200
        assert (await client.chat(chat_body())).status == 200
        assert queries() == 2
