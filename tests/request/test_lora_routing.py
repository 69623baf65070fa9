"""LoRA adapters behind the proxy, over real sockets: affinity placement (P/D with the adapter
on both legs, PD instances), fewer slot swaps than round-robin, load/unload through the proxy
(admin only), and loading on demand from a configured source (single-flight, errors)."""

from __future__ import annotations

import asyncio
import contextlib
import json

from helpers import Client, chat_body, wait_for

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig, expected_text

ADMIN = [(b"x-api-key", b"adm")]


def sim(**kw) -> SimConfig:
    return SimConfig(itl_ms=0, ttft_ms=0.5, ttft_per_token_ms=0, **kw)


@contextlib.asynccontextmanager
async def proxy_for(cluster: SimCluster, **kwargs):
    """A proxy over ``cluster`` that probes it (so it learns every instance's models)."""
    kwargs.setdefault("probe_interval", 0.1)
    kwargs.setdefault("scrape_interval", 0)
    async with await start_proxy(config_for_cluster(cluster, ProxyConfig(**kwargs))) as proxy:
        client = Client(proxy.url)
        try:
            await wait_for(lambda: all(i.served is not None for p in proxy.app.pools.values() for i in p.instances))
            yield proxy, client
        finally:
            await client.close()


def generations(cluster: SimCluster, role: str | None = None) -> list:
    return [r for r in cluster.records(role) if r.path == "/v1/chat/completions"]


def path_calls(cluster: SimCluster, path: str) -> list:
    return [r for r in cluster.records() if r.path == path]


async def ask(client: Client, model: str, text: str = "route me by adapter", stream: bool = False):
    body = chat_body(text, model=model, stream=stream, max_tokens=5)
    r = await client.chat(body)
    return body, r


async def test_p_d_adapter_requests_concentrate_and_both_legs_have_it():
    adapters = ("a1=/ad/a1", "a2=/ad/a2", "a3=/ad/a3", "a4=/ad/a4")
    # Only prefill-1, decode-0 and decode-2 have the adapters: the others never see them.
    cfg = sim(roles={"prefill-1": {"lora_modules": adapters}, "decode-0": {"lora_modules": adapters},
                     "decode-2": {"lora_modules": adapters}})
    async with SimCluster(prefill=2, decode=3, config=cfg) as c, proxy_for(c) as (proxy, client):
        for i in range(16):
            model = f"a{i % 4 + 1}"
            body, r = await ask(client, model, f"question {i}", stream=bool(i % 2))
            assert r.status == 200, r.body
            assert r.text() == expected_text(body, lora_path=f"/ad/{model}")
        recs = generations(c)
        used = {r.instance for r in recs}  # the adapters' homes: one decode, or both
        assert "prefill-1" in used and used <= {"prefill-1", "decode-0", "decode-2"}
        for model in ("a1", "a2", "a3", "a4"):
            decodes = {r.instance for r in generations(c, "decode") if r.json["model"] == model}
            assert len(decodes) == 1  # an idle cluster: each adapter on its one home
        # The base model still goes anywhere.
        body, r = await ask(client, "sim-model")
        assert r.status == 200 and r.text() == expected_text(body)


async def _swaps(affinity: bool) -> tuple[int, list[set[str]]]:
    cfg = sim(max_loras=3, lora_swap_ms=1.0, lora_modules=tuple(f"b{i}=/ad/b{i}" for i in range(3)))
    async with SimCluster(pd=2, config=cfg) as c, proxy_for(c, routing="round-robin",
                                                            lora_affinity=affinity) as (proxy, client):
        for i in range(18):
            body, r = await ask(client, f"b{i % 3}", f"q{i}")
            assert r.status == 200 and r.text() == expected_text(body, lora_path=f"/ad/b{i % 3}")
        homes = [{r.instance for r in generations(c) if r.json["model"] == f"b{k}"} for k in range(3)]
        return sum(i.lora.swaps for i in c.instances("pd")), homes  # type: ignore[return-value]


async def test_affinity_avoids_the_swaps_round_robin_makes():
    swaps, homes = await _swaps(True)
    rr_swaps, rr_homes = await _swaps(False)
    assert all(len(h) == 1 for h in homes)
    assert all(len(h) == 2 for h in rr_homes)  # round-robin: every adapter everywhere
    assert swaps == 3 < rr_swaps == 6  # each adapter swapped in once, against once per instance


async def test_load_and_unload_through_the_proxy_reach_the_base_models_instances():
    cfg = sim(allow_runtime_lora=True)
    async with SimCluster(prefill=1, decode=2, config=cfg) as c, proxy_for(c, admin_api_key="adm") as (proxy, client):
        load = {"lora_name": "fin", "lora_path": "/ad/fin"}
        r = await client.post("/v1/load_lora_adapter", load)
        assert r.status == 401  # no admin key
        r = await client.post("/v1/load_lora_adapter", load, [(b"x-api-key", b"wrong")])
        assert r.status == 403
        assert not path_calls(c, "/v1/load_lora_adapter")
        r = await client.post("/v1/load_lora_adapter", load, ADMIN)
        assert r.status == 200 and r.body == b"Success: LoRA adapter 'fin' added successfully."
        assert len(path_calls(c, "/v1/load_lora_adapter")) == 3  # every instance of the base, both roles
        # Learned at once, not at the next probe.
        models = (await client.request("GET", "/v1/models")).json()["data"]
        assert {m["id"]: m["parent"] for m in models} == {"sim-model": None, "fin": "sim-model"}
        body, r = await ask(client, "fin")
        assert r.status == 200 and r.text() == expected_text(body, lora_path="/ad/fin")
        again = await client.post("/v1/load_lora_adapter", load, ADMIN)
        assert again.status == 400
        err = again.json()
        assert "already been loaded" in err["error"]["message"] and len(err["instances"]) == 3
        r = await client.post("/v1/unload_lora_adapter", {"lora_name": "fin"}, ADMIN)
        assert r.status == 200 and r.body == b"Success: LoRA adapter 'fin' removed successfully."
        r = await client.post("/v1/unload_lora_adapter", {"lora_name": "fin"}, ADMIN)
        assert r.status == 404 and r.json()["error"]["type"] == "NotFoundError"
        body, r = await ask(client, "fin")
        assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
        # A chosen subset: one decode only.
        d0 = c.urls("decode")[0]
        r = await client.post("/v1/load_lora_adapter", dict(load, instances=[d0]), ADMIN)
        assert r.status == 200
        assert [i.lora.adapters for i in c.instances("decode")] == [{"fin": "/ad/fin"}, {}]
        r = await client.post("/v1/load_lora_adapter", dict(load, lora_name="x", instances=["http://10.9.9.9:1"]),
                              ADMIN)
        assert r.status == 400 and r.json()["error"]["param"] == "instances"
        metrics = (await client.request("GET", "/metrics", headers=ADMIN)).body.decode()
        for labels, n in (('outcome="ok",trigger="admin",verb="load"', 7),  # 3, 3 already there, 1
                          ('outcome="ok",trigger="admin",verb="unload"', 3)):
            assert f"epd_proxy_lora_calls_total{{{labels}}} {n}.0" in metrics
        # The unload of an adapter nobody has called no instance: nothing failed.
        assert 'epd_proxy_lora_calls_total{outcome="failed"' not in metrics


async def test_load_failure_is_aggregated_in_vllms_envelope():
    cfg = sim(allow_runtime_lora=True, roles={"decode-1": {"allow_runtime_lora": False}})
    async with SimCluster(decode=2, config=cfg) as c, proxy_for(c, admin_api_key="adm") as (proxy, client):
        r = await client.post("/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "/ad/z"}, ADMIN)
        assert r.status == 404  # the instance without runtime updating: FastAPI's 404
        err = r.json()
        assert "succeeded on 1 of 2" in err["error"]["message"]
        assert sorted(i["status"] for i in err["instances"]) == [200, 404]
        # FastAPI's bare 404 says only that the route is missing: the answer says why it is.
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in err["error"]["message"]
        assert [i["message"] for i in err["instances"] if i["status"] == 404] == [
            "HTTP 404: Not Found (the instance has no runtime LoRA routes: start vLLM with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment (and --enable-lora))"]


async def test_a_load_on_demand_where_runtime_updating_is_off_says_so(tmp_path):
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    async with SimCluster(decode=1, config=sim()) as c, proxy_for(c, lora_dir=str(tmp_path)) as (proxy, client):
        body, r = await ask(client, "z")
        assert r.status == 502, r.body
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in r.json()["error"]["message"]


async def test_adapter_loaded_on_demand_once_on_both_legs(tmp_path):
    cfg = sim(allow_runtime_lora=True, lora_swap_ms=20.0)
    async with SimCluster(prefill=2, decode=2, config=cfg) as c, proxy_for(
            c, lora_sources={"ondemand": "/ad/ondemand"}) as (proxy, client):
        bodies = [chat_body(f"burst {i}", model="ondemand", max_tokens=4) for i in range(6)]
        replies = await asyncio.gather(*(client.chat(b) for b in bodies))
        for body, r in zip(bodies, replies):
            assert r.status == 200, r.body
            assert r.text() == expected_text(body, lora_path="/ad/ondemand")
        loads = path_calls(c, "/v1/load_lora_adapter")
        assert len(loads) == 2 and {r.instance.split("-")[0] for r in loads} == {"prefill", "decode"}
        assert {r.instance for r in generations(c)} == {r.instance for r in loads}
        assert proxy.app.admin.adapters.loads_on_demand == 1
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert 'epd_proxy_lora_calls_total{outcome="ok",trigger="on_demand",verb="load"} 2.0' in metrics
        assert "epd_proxy_lora_loads_pending 0.0" in metrics
        # Not a source's adapter: the proxy's 404, nothing loaded.
        body, r = await ask(client, "unknown-adapter")
        assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
        assert len(path_calls(c, "/v1/load_lora_adapter")) == 2


async def test_on_demand_from_a_directory_and_a_failed_load(tmp_path):
    good = tmp_path / "legal"
    good.mkdir()
    (good / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA",
                                                          "base_model_name_or_path": "sim-model"}))
    (tmp_path / "notlora").mkdir()
    (tmp_path / "notlora" / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    cfg = sim(allow_runtime_lora=True, lora_check_paths=True)
    async with SimCluster(pd=2, config=cfg) as c, proxy_for(
            c, lora_dir=str(tmp_path), lora_sources={"gone": str(tmp_path / "gone")}) as (proxy, client):
        body, r = await ask(client, "legal")
        assert r.status == 200 and r.text() == expected_text(body, lora_path=str(good))
        body, r = await ask(client, "notlora")
        assert r.status == 404
        body, r = await ask(client, "../legal")
        assert r.status == 404
        body, r = await ask(client, "gone")  # the instance cannot find it: the proxy says so
        assert r.status == 502 and "could not be loaded" in r.json()["error"]["message"]
        calls = len(path_calls(c, "/v1/load_lora_adapter"))
        body, r = await ask(client, "gone")  # remembered for a while: no second load
        assert r.status == 502 and len(path_calls(c, "/v1/load_lora_adapter")) == calls
