"""Many models behind one proxy, over real sockets: each request on instances serving its model
(both legs), unknown models refused before any upstream call, models coming and going with
their instances, the /v1/models union."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import socket

import msgspec
from dnsmasq import dnsmasq  # noqa: F401  (fixture)
from helpers import Client, chat_body, wait_for

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.config import InstanceSpec
from epd_proxy.observe.access_log import AccessLog
from epd_proxy.observe.server_timing import model_timing as _model_timing
from epd_proxy.observe.server_timing import server_timing as _server_timing
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
        encode=pinned([s for c in configs for s in c.encode]),
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
        assert await model_ids(client) == ["a", "b"]
        assert (await client.post("/tokenize", {"model": "b", "prompt": "x"})).status == 200
        assert len(routed(b, "/tokenize")) == 1 and not routed(a, "/tokenize")
        assert (await client.request("GET", "/status", headers=KEY)).json()["models"]["b"]["ready"]
        r = await client.request("DELETE", f"/instances?url={url}", headers=KEY)
        assert r.status == 200
        await wait_for(lambda: "b" not in proxy.app.pipeline.models.current.parents)
        assert (await client.chat(chat_body(model="b"))).status == 404
        assert (await client.post("/tokenize", {"model": "b", "prompt": "x"})).status == 404
        assert (await client.request("GET", "/v1/models/b")).status == 404
        assert await model_ids(client) == ["a"]
        assert set((await client.request("GET", "/status", headers=KEY)).json()["models"]) == {"a"}
        assert (await client.chat(chat_body(model="a"))).status == 200


async def model_ids(client) -> list[str]:
    return [m["id"] for m in (await client.request("GET", "/v1/models")).json()["data"]]


async def test_an_ejected_model_stays_listed_routes_only_to_its_own_and_comes_back():
    """Its only instance crashes: ejected, it still counts (it may come back; panic routing needs
    it), so /v1/models keeps the model, /status says why it is not ready, and its requests fail
    on its own instance, never reaching the other model's; once it answers again, all is back."""
    a, b = await two_clusters(0, 0, 1)
    async with a, b, proxy_over(a, b) as (proxy, client):
        await wait_for(lambda: known(proxy))
        inst = b.instances("pd")[0]
        await inst.crash()
        pool = proxy.app.pools["decode"]
        await wait_for(lambda: not pool.find(inst.url).healthy)
        assert await model_ids(client) == ["a", "b"]
        status = (await client.request("GET", "/status")).json()["models"]
        assert not status["b"]["ready"] and status["b"]["why"] == "no decode instance serving it is in rotation (1 out)"
        assert status["a"]["ready"]
        before = count(a)
        r = await client.chat(chat_body(model="b"))
        assert r.status in (502, 503) and b"127.0.0.1" not in r.body
        assert (await client.post("/v1/embeddings", {"model": "b", "input": "x"})).status in (502, 503)
        assert count(a) == before and not routed(a, "/v1/embeddings")
        await inst.restart()
        await wait_for(lambda: pool.find(inst.url).healthy, timeout=10)
        assert (await client.chat(chat_body(model="b"))).status == 200
        assert (await client.request("GET", "/status")).json()["models"]["b"]["ready"]


async def test_a_model_follows_dns_discovery(dnsmasq):  # noqa: F811
    """One DNS name, two addresses on one port serving different models: the model arrives with
    its address and leaves with it, in /v1/models, routing and /status."""
    config_a, config_b = sim("a"), sim("b")
    async with SimCluster(pd=1, config=config_a, host="127.0.0.2") as first:
        port = int(first.urls("pd")[0].rsplit(":", 1)[1])
        async with SimCluster(pd=1, config=config_b, host="127.0.0.3", base_port=port) as second:
            dnsmasq.set("pd.svc.test", ["127.0.0.2"])
            template = InstanceSpec(f"http://pd.svc.test:{port}", "decode")
            config = ProxyConfig(probe_interval=0.1, discover=[template], dns_interval=0.05,
                                 dns_server=dnsmasq.server, scrape_interval=0)
            async with await start_proxy(config) as proxy:
                client = Client(proxy.url)
                try:
                    catalog = proxy.app.pipeline.models
                    await wait_for(lambda: list(catalog.current.parents) == ["a"])
                    assert (await client.chat(chat_body(model="b"))).status == 404
                    dnsmasq.set("pd.svc.test", ["127.0.0.2", "127.0.0.3"])
                    await wait_for(lambda: "b" in catalog.current.parents)
                    assert await model_ids(client) == ["a", "b"]
                    assert (await client.chat(chat_body(model="b"))).status == 200
                    assert (await client.post("/tokenize", {"model": "b", "prompt": "x"})).status == 200
                    assert count(second) == 1 and len(routed(second, "/tokenize")) == 1 and count(first) == 0
                    assert (await client.request("GET", "/status")).json()["models"]["b"]["ready"]
                    dnsmasq.set("pd.svc.test", ["127.0.0.2"])
                    await wait_for(lambda: "b" not in catalog.current.parents)
                    assert await model_ids(client) == ["a"]
                    assert (await client.chat(chat_body(model="b"))).status == 404
                    assert set((await client.request("GET", "/status")).json()["models"]) == {"a"}
                finally:
                    await client.close()


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
                        pool.served.learned(inst, body)
        assert proxy.app.pipeline.models.current.parents == {"a": None, "sql": "a", "b": None}
        for _ in range(8):
            before = count(a), count(b)
            assert (await client.chat(chat_body(model="sql"))).status == 200
            grew = (count(a) - before[0], count(b) - before[1])
            assert grew in ((2, 0), (0, 2)), grew  # both legs in one cluster, never one leg each


# -- the routed endpoints (request/forward.py) go where their model is --------------------------

def routed(cluster: SimCluster, path: str) -> list:
    return [r for r in cluster.records() if r.path == path]


async def test_routed_endpoints_go_to_an_instance_serving_their_model():
    a, b = await two_clusters(1, 1, 0)
    async with a, b, proxy_over(a, b, admin_api_key="K") as (proxy, client):
        await wait_for(lambda: known(proxy))
        for _ in range(4):
            r = await client.post("/tokenize", {"model": "b", "prompt": "three words here"})
            assert r.status == 200 and r.json()["count"] == 3
            r = await client.post("/v1/embeddings", {"model": "a", "input": "x"})
            assert r.status == 200 and r.json()["model"] == "a"
        # Tokenizer work on either of b's pools (least loaded, ties rotating), none on a's.
        assert len(routed(b, "/tokenize")) == 4 and not routed(a, "/tokenize")
        assert {r.instance for r in routed(b, "/tokenize")} == {"prefill-0", "decode-0"}
        # Model work on the decode pool of a.
        assert {r.instance for r in routed(a, "/v1/embeddings")} == {"decode-0"} and not routed(b, "/v1/embeddings")
        before = len(a.records()) + len(b.records())
        r = await client.post("/detokenize", {"model": "zz", "tokens": [1]})
        assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await client.post("/v1/embeddings", {"input": "x"})  # no model, two to choose from
        assert r.status == 400 and "a, b" in r.json()["error"]["message"]
        assert len(a.records()) + len(b.records()) == before  # the proxy answered both itself
        # No decode serves b any more: its model work falls back to b's prefill, never to a's decode.
        assert (await client.post("/instances/drain", {"url": b.urls("decode")[0]}, KEY)).status == 200
        r = await client.post("/v1/embeddings", {"model": "b", "input": "x"})
        assert r.status == 200 and routed(b, "/v1/embeddings")[-1].instance == "prefill-0"
        assert (await client.request("GET", "/version")).status == 200  # no model: any instance


async def test_a_model_no_pool_of_the_endpoint_serves_is_503_with_retry_after():
    """Vision model ``v`` is served by an encoder only: no decode or prefill can tokenize for it."""
    a = SimCluster(prefill=1, decode=1, config=sim("a"))
    v = SimCluster(encode=1, config=sim("v"))
    async with a, v, proxy_over(a, v) as (proxy, client):
        await wait_for(lambda: known(proxy))
        r = await client.post("/tokenize", {"model": "v", "prompt": "x"})
        assert r.status == 503 and r.headers[b"retry-after"] == b"5"
        assert "model `v`" in r.json()["error"]["message"] and b"127.0.0.1" not in r.body
        assert not routed(a, "/tokenize") and not routed(v, "/tokenize")
        assert (await client.post("/tokenize", {"model": "a", "prompt": "x"})).status == 200


async def test_routed_requests_spread_over_the_instances_of_their_model():
    a = SimCluster(pd=3, config=sim("a"))
    b = SimCluster(pd=1, config=sim("b"))
    async with a, b, proxy_over(a, b) as (proxy, client):
        await wait_for(lambda: known(proxy))
        for _ in range(6):
            assert (await client.post("/v1/embeddings", {"model": "a", "input": "x"})).status == 200
        per = [len(routed(a, "/v1/embeddings")) for _ in (0,)]
        assert per == [6] and not routed(b, "/v1/embeddings")
        assert sorted(sum(1 for r in routed(a, "/v1/embeddings") if r.instance == i.name)
                      for i in a.instances("pd")) == [2, 2, 2]


async def test_an_audio_forms_model_field_routes_it():
    boundary = b"----form"
    audio = bytes(range(256)) * 2000  # 512 KB: found in place, relayed from the same buffer
    body = (b"--" + boundary + b'\r\ncontent-disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"content-type: audio/wav\r\n\r\n" + audio + b"\r\n--" + boundary +
            b'\r\ncontent-disposition: form-data; name="model"\r\n\r\nb\r\n--' + boundary + b"--\r\n")
    headers = [(b"content-type", b"multipart/form-data; boundary=" + boundary)]
    a, b = await two_clusters(0, 0, 1)
    async with a, b, proxy_over(a, b) as (proxy, client):
        await wait_for(lambda: known(proxy))
        for _ in range(3):
            r = await client.request("POST", "/v1/audio/transcriptions", body, headers)
            assert r.status == 404 and r.body == b'{"detail":"Not Found"}'  # the simulator has no audio model
        got = routed(b, "/v1/audio/transcriptions")
        assert len(got) == 3 and got[-1].body == body and not routed(a, "/v1/audio/transcriptions")
        other = body.replace(b"\r\n\r\nb\r\n", b"\r\n\r\nzz\r\n")
        r = await client.request("POST", "/v1/audio/transcriptions", other, headers)
        assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"


# -- the operator's view: /status per model, metrics per model, Server-Timing, the access log ----

async def test_status_says_per_model_which_roles_can_serve_it_and_why_not():
    a, b = await two_clusters(1, 1, 0)
    async with a, b, proxy_over(a, b, admin_api_key="K") as (proxy, client):
        await wait_for(lambda: known(proxy))
        models = (await client.request("GET", "/status", headers=KEY)).json()["models"]
        assert set(models) == {"a", "b"}
        assert models["a"] == {"parent": None, "ready": True, "media": None, "why": None,
                               "roles": {"prefill": {"in_rotation": 1, "out": 0},
                                         "decode": {"in_rotation": 1, "out": 0}}}
        await client.post("/instances/drain", {"url": b.urls("prefill")[0]}, KEY)
        await b.instances("decode")[0].crash()
        await wait_for(lambda: not proxy.app.pools["decode"].find(b.urls("decode")[0]).healthy)
        models = (await client.request("GET", "/status", headers=KEY)).json()["models"]
        assert models["a"]["ready"] and not models["b"]["ready"]
        assert models["b"]["roles"] == {"decode": {"in_rotation": 0, "out": 1}}
        assert models["b"]["why"] == ("no prefill instance serves it; "
                                      "no decode instance serving it is in rotation (1 out)")


async def test_metrics_server_timing_and_access_log_name_the_model():
    out = io.StringIO()
    a, b = await two_clusters(1, 1, 0)
    async with a, b, proxy_over(a, b, metrics_max_models=1) as (proxy, client):
        await wait_for(lambda: known(proxy))
        proxy.app.pipeline.access_log = AccessLog("json", stream=out)
        r = await client.chat(chat_body(model="a", stream=True))
        assert r.status == 200
        assert r.headers[b"server-timing"].endswith(b', model;desc="a"')
        r = await client.chat(chat_body(model="b"))
        assert r.status == 200 and b'model;desc="b"' in r.headers[b"server-timing"]
        assert (await client.chat(chat_body(model="zz"))).status == 404
        assert (await client.post("/tokenize", {"model": "a", "prompt": "x"})).status == 200
        text = (await client.request("GET", "/metrics")).body.decode()
    lines = [msgspec.json.decode(line) for line in out.getvalue().splitlines()]
    assert [(x["path"], x["model"]) for x in lines if x["path"] != "/metrics"] == [
        ("/v1/chat/completions", "a"), ("/v1/chat/completions", "b"), ("/v1/chat/completions", "zz"),
        ("/tokenize", "a")]
    chat = "/v1/chat/completions"
    assert 'epd_proxy_model_requests_total{model="a",status="200"} 2.0' in text  # the stream and /tokenize
    assert 'epd_proxy_model_requests_total{model="other",status="200"} 1.0' in text  # past the one label
    assert 'epd_proxy_model_requests_total{model="-",status="404"} 1.0' in text  # refused: no label
    assert 'epd_proxy_model_time_to_first_token_seconds_count{model="a"} 1.0' in text
    assert 'epd_proxy_model_inter_token_seconds_count{model="a"} 1.0' in text
    assert 'epd_proxy_model_request_duration_seconds_count{model="other",stream="false"} 1.0' in text
    assert f'epd_proxy_requests_total{{endpoint="{chat}",status="200"}} 2.0' in text
    assert 'model="zz"' not in text
    for cluster, model in ((a, "a"), (b, "b")):
        url = cluster.urls("decode")[0]
        assert f'epd_proxy_instance_model_info{{model="{model}",role="decode",url="{url}"}} 1.0' in text
        assert f'epd_proxy_instance_adapters{{role="decode",url="{url}"}} 0.0' in text


# -- the encoder pool serving several vision models ---------------------------------------------

async def test_encoder_sub_requests_go_to_encoders_serving_the_requests_model():
    """Two vision models, each with two encoders and a PD instance, in two simulated clusters that
    share no encoder cache: an item encoded by the other model's encoder would never reach the
    consumer (its answer would fail), and the other model's encoders get nothing."""
    v1 = SimCluster(encode=2, pd=1, config=sim("v1"))
    v2 = SimCluster(encode=2, pd=1, config=sim("v2"))
    async with v1, v2, proxy_over(v1, v2) as (proxy, client):
        await wait_for(lambda: known(proxy))
        for i in range(8):
            model = ("v1", "v2")[i % 2]
            images = [f"https://example.com/{model}-{i}-{k}.png" for k in range(3)]
            r = await client.chat(chat_body(model=model, images=images, stream=bool(i % 3)))
            assert r.status == 200, r.body
        for cluster, model in ((v1, "v1"), (v2, "v2")):
            encoded = [r for r in cluster.records("encode") if r.path == "/v1/chat/completions"]
            assert encoded and {r.json["model"] for r in encoded} == {model}
            assert {r.instance for r in encoded} == {"encode-0", "encode-1"}  # spread over both of them
            assert sum(len(r.json["messages"][0]["content"]) for r in encoded) == 4 * 3
        models = (await client.request("GET", "/status")).json()["models"]
        assert models["v1"]["media"] is True and models["v1"]["roles"]["encode"] == {"in_rotation": 2, "out": 0}


def test_the_model_in_server_timing_is_one_safe_line():
    assert _server_timing({"prefill": 0.012}, _model_timing("org/m-1.5")) == [
        (b"server-timing", b'prefill;dur=12.0, model;desc="org/m-1.5"')]
    assert _server_timing({}, _model_timing("m")) == [(b"server-timing", b'model;desc="m"')]
    assert _server_timing({}, None) == []
    for odd in ('a"b', "a\\b", "a b\r\nx: y", "modèle"):
        value = _server_timing({}, _model_timing(odd))[0][1]
        assert value.isascii() and b"\r" not in value and b"\n" not in value and value.count(b'"') == 2, value


def refusing_url() -> str:
    """An address where nothing listens: an instance that never answers, /v1/models included."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def panics(proxy) -> int:
    return sum(pool.panics for pool in proxy.app.pools.values())


async def test_a_mistyped_model_is_404_at_once_while_a_decode_has_never_answered():
    """One prefill and two decodes serving `tiny`, a third decode that never answers (its models
    unknown, ejected by its probes): a model nobody listed is the client's mistake, 404 at once
    naming what the cluster serves; no instance is tried and no panic routing is counted."""
    async with SimCluster(prefill=1, decode=2, config=sim("tiny")) as cluster:
        dead = InstanceSpec(refusing_url(), "decode")
        base = ProxyConfig(probe_interval=0.1, scrape_interval=0)
        config = config_for_cluster(cluster, base)
        config = config.replace(decode=[*config.decode, dead])
        async with await start_proxy(config) as proxy:
            client = Client(proxy.url)
            try:
                pool = proxy.app.pools["decode"]
                await wait_for(lambda: not pool.find(dead.url).healthy
                               and all(i.served is not None for i in proxy.app.pools["prefill"].instances)
                               and sum(i.served is not None for i in pool.instances) == 2, timeout=10)
                before = count(cluster)
                r = await client.chat(chat_body(model="gpt-4o"))
                assert r.status == 404, r.body
                error = r.json()["error"]
                assert error["code"] == "model_not_found" and error["param"] == "model"
                assert error["message"] == ("The model `gpt-4o` does not exist. This cluster serves: tiny "
                                            "(GET /v1/models lists them).")
                assert b"retry-after" not in r.headers
                assert (await client.post("/tokenize", {"model": "gpt-4o", "prompt": "x"})).status == 404
                assert count(cluster) == before and panics(proxy) == 0
                assert (await client.chat(chat_body(model="tiny"))).status == 200
                assert panics(proxy) == 0
                metrics = (await client.request("GET", "/metrics")).body.decode()
                assert 'epd_proxy_panic_routing_total{role="decode"} 0' in metrics
            finally:
                await client.close()


async def test_a_model_whose_only_instance_is_down_is_503_not_404():
    """Its only instance is out (ejected by its probes): the model was listed and may come back,
    so its requests are 503 with Retry-After (panic routing over its own instance, which is true),
    never the 404 of a model that does not exist."""
    a, b = await two_clusters(0, 0, 1)
    async with a, b, proxy_over(a, b) as (proxy, client):
        await wait_for(lambda: known(proxy))
        inst = b.instances("pd")[0]
        await inst.stop()
        pool = proxy.app.pools["decode"]
        await wait_for(lambda: not pool.find(inst.url).healthy, timeout=10)
        r = await client.chat(chat_body(model="b"))
        assert r.status == 503 and r.headers[b"retry-after"] == b"5", r.body
        assert "decode" in r.json()["error"]["message"]
        assert pool.panics >= 1  # b's only decode is out: panic routing over b's instances, each attempt
        assert (await client.chat(chat_body(model="a"))).status == 200


async def test_a_model_nobody_lists_while_no_decode_has_answered_is_503_not_ready():
    """The cold start: the prefill has said what it serves, no decode has yet (the only one never
    answers): a model the prefill does not list may still be the decodes', so not 404 but 503
    with Retry-After, naming the role that has not answered; nothing is routed."""
    async with SimCluster(prefill=1, decode=0, config=sim("tiny")) as cluster:
        dead = InstanceSpec(refusing_url(), "decode")
        config = config_for_cluster(cluster, ProxyConfig(probe_interval=0.1, scrape_interval=0)).replace(
            decode=[dead])
        async with await start_proxy(config) as proxy:
            client = Client(proxy.url)
            try:
                await wait_for(lambda: proxy.app.pipeline.models.current.waiting == ("decode",)
                               and "tiny" in proxy.app.pipeline.models.current.parents, timeout=10)
                r = await client.chat(chat_body(model="gpt-4o"))
                assert r.status == 503 and r.headers[b"retry-after"] == b"5", r.body
                assert "no decode instance has said which models it serves yet" in r.json()["error"]["message"]
                assert panics(proxy) == 0 and count(cluster) == 0
            finally:
                await client.close()
