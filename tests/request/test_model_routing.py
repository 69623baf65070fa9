"""Many models behind one proxy, over real sockets: each request on instances serving its model
(both legs), unknown models refused before any upstream call, models coming and going with
their instances, the /v1/models union."""

from __future__ import annotations

import contextlib
import dataclasses

import msgspec
from helpers import Client, chat_body, wait_for

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig

KEY = [(b"authorization", b"Bearer K")]


def sim(model: str | None = None, models: tuple[str, ...] = ()) -> SimConfig:
    return SimConfig(itl_ms=0, ttft_ms=0.5, model=model or "sim-model", models=models)


@contextlib.asynccontextmanager
async def proxy_over(*clusters: SimCluster, pins: dict[str, tuple[str, ...]] | None = None, **kwargs):
    """A proxy over every instance of ``clusters`` (probing, so it learns their models);
    ``pins``: an instance URL's ``models`` attribute."""
    configs = [config_for_cluster(c) for c in clusters]
    pins = pins or {}

    def pinned(specs):
        return [dataclasses.replace(s, models=pins.get(s.url, ())) for s in specs]

    kwargs.setdefault("probe_interval", 0.1)
    config = ProxyConfig(scrape_interval=0, **kwargs).replace(
        prefill=pinned([s for c in configs for s in c.prefill]), decode=pinned([s for c in configs for s in c.decode]),
        kv_connector=clusters[0].config.kv_connector if clusters else "nixl")
    async with await start_proxy(config) as proxy:
        client = Client(proxy.url)
        try:
            yield proxy, client
        finally:
            await client.close()


def known(proxy) -> bool:
    """Every instance of the proxy has said what it serves."""
    return all(i.served is not None for p in proxy.app.pools.values() for i in p.instances)


def generations(cluster: SimCluster) -> list:
    """The generation requests it got (not the proxy's probes and model reads)."""
    return [r for r in cluster.records() if r.path == "/v1/chat/completions"]


def count(cluster: SimCluster) -> int:
    return len(generations(cluster))


async def two_clusters(prefill: int, decode: int, pd: int):
    return (SimCluster(prefill=prefill, decode=decode, pd=pd, config=sim("a")),
            SimCluster(prefill=prefill, decode=decode, pd=pd, config=sim("b")))


async def _routes_each_model_to_its_instances(prefill: int, decode: int, pd: int) -> None:
    a, b = await two_clusters(prefill, decode, pd)
    async with a, b, proxy_over(a, b) as (proxy, client):
        await wait_for(lambda: known(proxy))
        for i in range(6):
            model = "ab"[i % 2]
            r = await client.chat(chat_body(model=model, stream=bool(i % 3)))
            assert r.status == 200, r.body
        for cluster, model in ((a, "a"), (b, "b")):
            records = generations(cluster)
            assert len(records) == 3 * (2 if prefill else 1)  # every leg of its 3 requests, none of the others'
            names = {i.name for role in ("prefill", "decode", "pd") for i in cluster.instances(role)}
            assert {r.instance for r in records} == names  # both legs (P/D) on this model's instances
            assert {r.json["model"] for r in records} == {model}


async def test_p_d_each_model_on_its_own_instances_on_both_legs():
    await _routes_each_model_to_its_instances(1, 1, 0)


async def test_pd_each_model_on_its_own_instances():
    await _routes_each_model_to_its_instances(0, 0, 1)


async def test_unknown_model_is_404_with_no_upstream_call():
    a, b = await two_clusters(1, 1, 0)
    async with a, b, proxy_over(a, b) as (proxy, client):
        await wait_for(lambda: known(proxy))
        before = count(a) + count(b)
        r = await client.chat(chat_body(model="nope"))
        assert r.status == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and "nope" in err["message"]
        assert count(a) + count(b) == before


async def test_models_union_and_one_model():
    a, b = await two_clusters(0, 0, 1)
    async with a, b, proxy_over(a, b) as (proxy, client):
        await wait_for(lambda: known(proxy))
        body = (await client.request("GET", "/v1/models")).json()
        assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["a", "b"]
        assert all(m["object"] == "model" and "created" in m and m["owned_by"] == "vllm" and "root" in m
                   and m["max_model_len"] for m in body["data"])
        r = await client.request("GET", "/v1/models/b")
        assert r.status == 200 and r.json()["id"] == "b"
        r = await client.request("GET", "/v1/models/zz")
        assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
        status = (await client.request("GET", "/status")).json()
        assert sorted(i["models"][0] for i in status["pools"]["decode"]) == ["a", "b"]


async def test_request_without_model_one_or_several():
    a, b = await two_clusters(0, 0, 1)
    async with a, b, proxy_over(a, b) as (proxy, client):
        await wait_for(lambda: known(proxy))
        body = chat_body()
        del body["model"]
        r = await client.chat(body)
        assert r.status == 400 and "a, b" in r.json()["error"]["message"]
    async with SimCluster(pd=2, config=sim("a")) as c, proxy_over(c) as (proxy, client):
        await wait_for(lambda: known(proxy))
        r = await client.chat(body)
        assert r.status == 200 and r.json()["model"] == "a"


async def test_model_appears_and_disappears_with_its_instances():
    a, b = await two_clusters(0, 0, 1)
    async with a, b, proxy_over(a, admin_api_key="K") as (proxy, client):
        await wait_for(lambda: known(proxy))
        assert (await client.chat(chat_body(model="b"))).status == 404
        url = b.urls("pd")[0]
        r = await client.post("/instances", {"role": "decode", "url": url}, KEY)
        assert r.status == 200
        await wait_for(lambda: "b" in proxy.app.pipeline.models.current.parents)
        assert (await client.chat(chat_body(model="b"))).status == 200
        assert count(b) == 1 and count(a) == 0
        r = await client.request("DELETE", f"/instances?url={url}", headers=KEY)
        assert r.status == 200
        await wait_for(lambda: "b" not in proxy.app.pipeline.models.current.parents)
        assert (await client.chat(chat_body(model="b"))).status == 404
        assert (await client.chat(chat_body(model="a"))).status == 200


async def test_a_model_whose_prefills_are_all_gone_is_503_with_retry_after():
    a, b = await two_clusters(1, 1, 0)
    async with a, b, proxy_over(a, b, admin_api_key="K") as (proxy, client):
        await wait_for(lambda: known(proxy))
        r = await client.post("/instances/drain", {"url": b.urls("prefill")[0]}, KEY)
        assert r.status == 200, r.body
        r = await client.chat(chat_body(model="b"))
        assert r.status == 503 and r.headers[b"retry-after"] == b"5"
        assert "model `b`" in r.json()["error"]["message"]
        assert (await client.chat(chat_body(model="a"))).status == 200


async def test_models_attribute_restricts_what_an_instance_is_sent():
    both = SimCluster(pd=1, config=sim(models=("a", "b")))
    only_b = SimCluster(pd=1, config=sim("b"))
    async with both, only_b, proxy_over(both, only_b, pins={both.urls("pd")[0]: ("a",)}) as (proxy, client):
        await wait_for(lambda: known(proxy))
        for _ in range(4):
            assert (await client.chat(chat_body(model="b"))).status == 200
        assert count(both) == 0 and count(only_b) == 4
        assert (await client.chat(chat_body(model="a"))).status == 200 and count(both) == 1


async def test_an_adapters_prefill_and_decode_sit_on_the_same_base():
    """Adapter ``sql`` exists on base a (cluster A) and on base b (cluster B): KV computed with
    one is worthless to the other, so each request's two legs are on one base."""
    a = SimCluster(prefill=1, decode=1, config=dataclasses.replace(sim("a"), check_model=False))
    b = SimCluster(prefill=1, decode=1, config=dataclasses.replace(sim("b"), check_model=False))
    async with a, b, proxy_over(a, b, probe_interval=0) as (proxy, client):
        for cluster, base in ((a, "a"), (b, "b")):
            urls = cluster.urls("prefill") + cluster.urls("decode")
            body = msgspec.json.encode({"object": "list", "data": [
                {"id": base, "object": "model", "parent": None}, {"id": "sql", "object": "model", "parent": base}]})
            for pool in proxy.app.pools.values():
                for inst in pool.instances:
                    if inst.url in urls:
                        pool.learned(inst, body)
        assert proxy.app.pipeline.models.current.parents == {"a": None, "sql": "a", "b": None}
        for _ in range(8):
            before = count(a), count(b)
            assert (await client.chat(chat_body(model="sql"))).status == 200
            grew = (count(a) - before[0], count(b) - before[1])
            assert grew in ((2, 0), (0, 2)), grew  # both legs in one cluster, never one leg each
