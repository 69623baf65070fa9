"""A key spends and sees only what is its own, over real sockets: a model it may not use is
403 before any limit is counted, its model list is checked on the model that runs (an alias's
default, an adapter not loaded yet), /v1/models and the unknown-model 404 show only its models,
its class sets the engine priority, a form naming its model twice is refused, and the counters
are its own (under the deployment's prefix; no key shares the anonymous requests')."""

from __future__ import annotations

import msgspec
import pytest
from helpers import Client, chat_body, stack, wait_for

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.api.client_auth import read_key_file
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig
from epd_proxy.tenants.limits import key_digest

SIM = SimConfig(itl_ms=0, ttft_ms=0.5)


def bearer(secret: str) -> list:
    return [(b"authorization", f"Bearer {secret}".encode())]


def key_file(tmp_path) -> str:
    path = tmp_path / "keys"
    path.write_text("team-a:secret-a\nteam-b:secret-b\nbatch:secret-c\n")
    return str(path)


async def _served_known(proxy) -> None:
    await wait_for(lambda: not proxy.app.pipeline.models.current.open)


async def test_a_forbidden_model_is_403_before_any_limit_and_spends_nothing(tmp_path):
    tenants = {"keys": [{"name": "team-a", "requests_per_minute": 1, "input_tokens_per_minute": 100000,
                         "models": ["sim-model"]}]}
    async with stack(sim=SIM, api_key_file=key_file(tmp_path), tenants=tenants) as (cluster, proxy, client):
        for _ in range(3):  # as often as it likes: never a 429, never counted
            refused = await client.chat(chat_body(model="other-model"), bearer("secret-a"))
            assert refused.status == 403 and refused.json()["error"]["code"] == "model_not_allowed"
            assert b"x-ratelimit-remaining-requests" not in refused.headers
        routed = await client.post("/v1/embeddings", {"model": "other-model", "input": "x"}, bearer("secret-a"))
        assert routed.status == 403
        ok = await client.chat(chat_body(), bearer("secret-a"))  # the minute's one request is still there
        assert ok.status == 200, ok.body
        limits = (await proxy.app.pipeline.tenants.status())["keys"]["team-a"]["limits"]
        assert limits["requests_per_minute"]["used"] == 1
        assert limits["input_tokens_per_minute"]["used"] == ok.json()["usage"]["prompt_tokens"]
        # Over its limit now: a forbidden model is still a 403, not hidden behind the 429.
        assert (await client.chat(chat_body(model="other-model"), bearer("secret-a"))).status == 403
        assert (await client.chat(chat_body(), bearer("secret-a"))).status == 429
        counts = proxy.app.pipeline.tenants.counts["team-a"]
        assert counts.forbidden == 5 and counts.admitted == 1


async def test_the_default_alias_does_not_get_around_a_keys_list(tmp_path):
    tenants = {"keys": [{"name": "team-a", "models": ["retired-model"]},
                        {"name": "team-b", "models": ["sim-model"]}]}
    aliases = {"default": "sim-model"}
    config = ProxyConfig(probe_interval=0.05, scrape_interval=0, api_key_file=key_file(tmp_path), tenants=tenants,
                         model_aliases=aliases)
    async with SimCluster(pd=1, config=SIM) as cluster, await start_proxy(config_for_cluster(cluster, config)) as proxy:
        client = Client(proxy.url)
        try:
            await _served_known(proxy)
            # Its list names a model nobody serves: the default would run sim-model, not on its list.
            for send in (client.chat(chat_body(model="retired-model"), bearer("secret-a")),
                         client.post("/v1/embeddings", {"model": "retired-model", "input": "x"}, bearer("secret-a"))):
                refused = await send
                assert refused.status == 403, refused.body
            assert [r for r in cluster.records() if r.method == "POST"] == []
            # A key whose list names the model that runs may reach it through the default.
            reply = await client.chat(chat_body(model="gpt-4o"), bearer("secret-b"))
            assert reply.status == 200 and reply.json()["model"] == "sim-model"
        finally:
            await client.close()


async def test_a_key_sees_only_its_models(tmp_path):
    tenants = {"keys": [{"name": "team-a", "models": ["claude-sonnet-4", "retired-model"]},
                        {"name": "batch", "models": ["sim-model"]}]}
    aliases = {"names": {"claude-sonnet-4": "sim-model", "gpt-4o": "sim-model"}, "listed": "both"}
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, models=("sim-model", "sim-large"))
    config = ProxyConfig(probe_interval=0.05, scrape_interval=0, api_key_file=key_file(tmp_path), tenants=tenants,
                         model_aliases=aliases)
    async with SimCluster(pd=1, config=sim) as cluster, await start_proxy(config_for_cluster(cluster, config)) as proxy:
        client = Client(proxy.url)
        try:
            await _served_known(proxy)

            async def ids(secret: str) -> list[str]:
                reply = await client.request("GET", "/v1/models", headers=bearer(secret))
                assert reply.status == 200
                return [c["id"] for c in reply.json()["data"]]

            assert await ids("secret-b") == ["sim-model", "sim-large", "claude-sonnet-4", "gpt-4o"]
            assert await ids("secret-a") == ["claude-sonnet-4"]
            assert await ids("secret-c") == ["sim-model", "claude-sonnet-4", "gpt-4o"]  # its model's aliases too
            card = await client.request("GET", "/v1/models/sim-large", headers=bearer("secret-a"))
            assert card.status == 404 and "sim-large" not in card.json()["error"]["message"].split("serves:")[-1]
            assert (await client.request("GET", "/v1/models/claude-sonnet-4", headers=bearer("secret-a"))).status == 200
            assert (await client.request("GET", "/v1/models/sim-large", headers=bearer("secret-b"))).status == 200
            # A name on its list nobody serves: the 404 names what this key may use, nothing else.
            missing = await client.chat(chat_body(model="retired-model"), bearer("secret-a"))
            message = missing.json()["error"]["message"]
            assert missing.status == 404 and message.endswith("This cluster serves: claude-sonnet-4 "
                                                              "(GET /v1/models lists them).")
            routed = await client.post("/v1/embeddings", {"model": "retired-model", "input": "x"}, bearer("secret-a"))
            assert routed.status == 404 and "sim-large" not in routed.json()["error"]["message"]
            # A key without a list is told every model served.
            unknown = await client.chat(chat_body(model="nope"), bearer("secret-b"))
            assert unknown.status == 404 and "sim-large" in unknown.json()["error"]["message"]
        finally:
            await client.close()


async def test_an_adapter_is_not_loaded_for_a_key_that_may_not_use_it(tmp_path):
    tenants = {"keys": [{"name": "team-a", "models": ["sim-model"]}]}
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, allow_runtime_lora=True)
    config = ProxyConfig(probe_interval=0.05, scrape_interval=0, api_key_file=key_file(tmp_path), tenants=tenants,
                         lora_sources={"lora-z": "/ad/lora-z"})
    async with SimCluster(prefill=1, decode=1, config=sim) as cluster, \
            await start_proxy(config_for_cluster(cluster, config)) as proxy:
        client = Client(proxy.url)
        try:
            await _served_known(proxy)
            refused = await client.chat(chat_body(model="lora-z"), bearer("secret-a"))
            assert refused.status == 403, refused.body
            assert [r for r in cluster.records() if r.path == "/v1/load_lora_adapter"] == []
            assert proxy.app.admin.adapters.loads_on_demand == 0
            # Another key may: loaded on demand, as before.
            ok = await client.chat(chat_body(model="lora-z"), bearer("secret-b"))
            assert ok.status == 200, ok.body
            assert len([r for r in cluster.records() if r.path == "/v1/load_lora_adapter"]) == 2
        finally:
            await client.close()


def _form(*fields: tuple[str, bytes]) -> tuple[bytes, bytes]:
    boundary = b"----b"
    body = b""
    for name, value in fields:
        head = f'\r\ncontent-disposition: form-data; name="{name}"\r\n\r\n'.encode()
        body += b"--" + boundary + head + value + b"\r\n"
    return body + b"--" + boundary + b"--\r\n", b"multipart/form-data; boundary=" + boundary


@pytest.mark.parametrize("tenants", [None, {"keys": [{"name": "team-a", "models": ["sim-model"]}]}])
async def test_a_form_naming_its_model_twice_is_refused(tmp_path, tenants):
    body, ctype = _form(("model", b"sim-model"), ("file", b"RIFF...."), ("model", b"other-model"))
    async with stack(prefill=0, decode=1, sim=SIM, api_key_file=key_file(tmp_path), tenants=tenants) as (
            cluster, proxy, client):
        reply = await client.request("POST", "/v1/audio/transcriptions", body,
                                     [(b"content-type", ctype)] + bearer("secret-a"))
        assert reply.status == 400, reply.body
        err = reply.json()["error"]
        assert err["param"] == "model" and "more than one 'model'" in err["message"]
        assert cluster.records() == []
        once, ctype = _form(("model", b"sim-model"), ("file", b"RIFF...."))
        reply = await client.request("POST", "/v1/audio/transcriptions", once,
                                     [(b"content-type", ctype)] + bearer("secret-a"))
        assert reply.status == 404 and len(cluster.records()) == 1  # passed (the sim has no audio model)


def _priorities(cluster, role: str) -> list:
    return [msgspec.json.decode(r.body).get("priority", "absent") for r in cluster.records(role)
            if r.body.startswith(b"{")]


async def test_the_engine_priority_follows_the_keys_class(tmp_path):
    tenants = {"engine_priority": True, "keys": [{"name": "team-a", "class": "critical"},
                                                 {"name": "batch", "class": "sheddable"}]}
    async with stack(encode=1, prefill=1, decode=1, sim=SIM, api_key_file=key_file(tmp_path), tenants=tenants) as (
            cluster, proxy, client):
        image = ["https://x/a.png"]
        cases = [("secret-c", {"priority": -10}, 2),  # sheddable asking to jump the queue: its class's
                 ("secret-c", {"priority": 7}, 7),  # lowering itself further: as sent
                 ("secret-c", {}, 2),
                 ("secret-b", {}, 1),  # standard, the default class
                 ("secret-a", {"priority": -3}, "absent"),  # critical: 0, vLLM's default, sent as nothing
                 ("secret-a", {"priority": 4}, 4)]
        for secret, extra, expected in cases:
            cluster.clear_records()
            reply = await client.chat(chat_body(images=image, **extra), bearer(secret))
            assert reply.status == 200, reply.body
            want = 0 if expected == "absent" and "priority" in extra else expected
            for role in ("encode", "prefill", "decode"):
                assert _priorities(cluster, role) == [want] * len(_priorities(cluster, role)), (secret, extra, role)
                assert _priorities(cluster, role), role
        # The routed endpoints: the same rule.
        cluster.clear_records()
        await client.post("/v1/embeddings", {"model": "sim-model", "input": "x", "priority": -1}, bearer("secret-c"))
        assert _priorities(cluster, "decode") == [2]
        cluster.clear_records()  # the tokenizer's work is not scheduled: its body passes as sent
        await client.post("/tokenize", {"model": "sim-model", "prompt": "x"}, bearer("secret-c"))
        assert [_priorities(cluster, role) for role in ("prefill", "decode")] in (
            [["absent"], []], [[], ["absent"]])


async def test_the_client_priority_never_goes_below_zero_without_engine_priority(tmp_path):
    tenants = {"keys": [{"name": "batch", "class": "sheddable"}]}
    async with stack(sim=SIM, api_key_file=key_file(tmp_path), tenants=tenants) as (cluster, proxy, client):
        assert (await client.chat(chat_body(priority=-10), bearer("secret-c"))).status == 200
        assert (await client.chat(chat_body(priority=3), bearer("secret-c"))).status == 200
        assert (await client.chat(chat_body(), bearer("secret-c"))).status == 200
        assert _priorities(cluster, "decode") == [0, 3, "absent"]
    async with stack(sim=SIM) as (cluster, proxy, client):  # no tenants: the body as sent
        assert (await client.chat(chat_body(priority=-10))).status == 200
        assert _priorities(cluster, "decode") == [-10]


async def test_counters_live_under_the_deployments_prefix(tmp_path, redis_server):
    tenants = {"store": redis_server.url, "keys": [{"name": "team-a", "requests_per_minute": 1}]}
    async with stack(sim=SIM, api_key_file=key_file(tmp_path), tenants=tenants, state_store_prefix="blue:") as (
            _, _, blue), stack(sim=SIM, api_key_file=key_file(tmp_path), tenants=tenants,
                               state_store_prefix="green:") as (_, _, green):
        assert (await blue.chat(chat_body(), bearer("secret-a"))).status == 200
        assert (await green.chat(chat_body(), bearer("secret-a"))).status == 200  # another deployment's counters
        assert (await blue.chat(chat_body(), bearer("secret-a"))).status == 429
    import redis

    keys = [k.decode() for k in redis.Redis.from_url(redis_server.url).keys("*")]
    assert keys and all(k.startswith(("blue:rl:", "green:rl:")) for k in keys), keys


def test_no_key_shares_the_anonymous_counters(tmp_path):
    assert key_digest(None) != key_digest("-")
    path = tmp_path / "keys"
    path.write_text("ok:secret\n-:other-secret\n")
    with pytest.raises(ValueError, match="reserved"):
        read_key_file(str(path))


async def test_an_adapter_not_found_names_only_the_keys_models(tmp_path):
    tenants = {"keys": [{"name": "team-a", "models": ["sim-model", "lora-q"]}]}
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, allow_runtime_lora=True, models=("sim-model", "sim-large"))
    config = ProxyConfig(probe_interval=0.05, scrape_interval=0, api_key_file=key_file(tmp_path), tenants=tenants,
                         lora_dir=str(tmp_path))  # holds no adapter lora-q
    async with SimCluster(pd=1, config=sim) as cluster, await start_proxy(config_for_cluster(cluster, config)) as proxy:
        client = Client(proxy.url)
        try:
            await _served_known(proxy)
            reply = await client.chat(chat_body(model="lora-q"), bearer("secret-a"))
            assert reply.status == 404, reply.body
            assert reply.json()["error"]["message"].endswith("This cluster serves: sim-model "
                                                             "(GET /v1/models lists them).")
            other = await client.chat(chat_body(model="lora-q"), bearer("secret-b"))
            assert other.status == 404 and "sim-large" in other.json()["error"]["message"]
        finally:
            await client.close()
