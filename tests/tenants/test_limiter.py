"""Per-key limits through the proxy over real sockets: 429 with the SDKs' headers, tokens
settled from the usage, 403 for a model the key may not use, aliases, /status, /metrics,
the access log's key and class, a reload of the table."""

import io
import logging

from helpers import Client, chat_body, stack, wait_for

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.cli import build_parser
from epd_proxy.cli.serve import ServeSettings
from epd_proxy.observe.access_log import AccessLog
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig

SIM = SimConfig(itl_ms=0, ttft_ms=0.5)
ADMIN = [(b"x-api-key", b"admin")]


def bearer(secret: str) -> list:
    return [(b"authorization", f"Bearer {secret}".encode())]


def key_file(tmp_path) -> str:
    path = tmp_path / "keys"
    path.write_text("team-a:secret-a\nteam-b:secret-b\nbatch:secret-c\n")
    return str(path)


async def test_over_its_requests_a_key_gets_429_with_retry_after_and_the_sdk_headers(tmp_path):
    tenants = {"default": {"requests_per_minute": 100},
               "keys": [{"name": "team-a", "requests_per_minute": 2}]}
    async with stack(sim=SIM, api_key_file=key_file(tmp_path), tenants=tenants, admin_api_key="admin") as (
            cluster, proxy, client):
        ok = await client.chat(chat_body(), bearer("secret-a"))
        assert ok.status == 200
        assert ok.headers[b"x-ratelimit-limit-requests"] == b"2"
        assert ok.headers[b"x-ratelimit-remaining-requests"] == b"1"
        assert (await client.chat(chat_body(), bearer("secret-a"))).status == 200
        refused = await client.chat(chat_body(), bearer("secret-a"))
        assert refused.status == 429
        assert 1 <= int(refused.headers[b"retry-after"]) <= 60
        assert refused.headers[b"x-ratelimit-remaining-requests"] == b"0"
        assert refused.headers[b"x-ratelimit-reset-requests"].endswith(b"s")
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "team-a" in error["message"]
        assert "secret" not in refused.body.decode()
        # Another key is not held back by team-a's limit (its own, the default's, applies).
        other = await client.chat(chat_body(), bearer("secret-b"))
        assert other.status == 200 and other.headers[b"x-ratelimit-limit-requests"] == b"100"
        # Messages: Anthropic's headers.
        messages = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        refused = await client.post("/v1/messages", messages, bearer("secret-a"))
        assert refused.status == 429 and refused.headers[b"anthropic-ratelimit-requests-limit"] == b"2"
        assert refused.headers[b"anthropic-ratelimit-requests-remaining"] == b"0"
        assert refused.headers[b"anthropic-ratelimit-requests-reset"].endswith(b"Z")
        assert b"x-ratelimit-limit-requests" not in refused.headers
        # Refused requests never reached an instance.
        assert len(cluster.instances("decode")[0].generation_records()) == 3
        status = (await client.request("GET", "/status", headers=ADMIN)).json()["tenants"]
        assert status["keys"]["team-a"]["limits"]["requests_per_minute"]["used"] == 2
        assert status["keys"]["team-b"]["policy"] == "default"
        metrics = (await client.request("GET", "/metrics", headers=ADMIN)).body.decode()
        assert 'epd_proxy_tenant_requests_total{key="team-a",result="limited_requests_per_minute"} 2.0' in metrics
        assert 'epd_proxy_tenant_requests_total{key="default",result="admitted"} 1.0' in metrics


async def test_input_tokens_are_estimated_then_settled_from_the_usage(tmp_path):
    tenants = {"keys": [{"name": "team-a", "input_tokens_per_minute": 100000, "output_tokens_per_minute": 20,
                         "tokens_per_day": 100000}]}
    async with stack(sim=SIM, api_key_file=key_file(tmp_path), tenants=tenants) as (cluster, proxy, client):
        body = chat_body("one two three four", max_tokens=8)
        reply = await client.chat(body, bearer("secret-a"))
        assert reply.status == 200
        usage = reply.json()["usage"]
        tenants_ = proxy.app.pipeline.tenants
        status = await tenants_.status()
        limits = status["keys"]["team-a"]["limits"]
        assert limits["input_tokens_per_minute"]["used"] == usage["prompt_tokens"]  # not the estimate
        assert limits["output_tokens_per_minute"]["used"] == usage["completion_tokens"] == 8
        assert limits["tokens_per_day"]["used"] == usage["prompt_tokens"] + 8
        # A stream's usage settles too (the proxy asks decode for it).
        assert (await client.chat(chat_body(stream=True, max_tokens=8), bearer("secret-a"))).status == 200
        assert (await tenants_.status())["keys"]["team-a"]["limits"]["output_tokens_per_minute"]["used"] == 16
        # 16 of 20 output tokens used: let in (the answer's length is not known up front) ...
        assert (await client.chat(chat_body(max_tokens=8), bearer("secret-a"))).status == 200
        # ... and now past it: refused until the minute turns.
        refused = await client.chat(chat_body(max_tokens=8), bearer("secret-a"))
        assert refused.status == 429 and b"output tokens per minute" in refused.body
        assert refused.headers[b"x-ratelimit-limit-tokens"]


async def test_a_concurrent_limit(tmp_path):
    import asyncio
    sim = SimConfig(itl_ms=0, ttft_ms=200)
    tenants = {"keys": [{"name": "team-a", "concurrent": 1}]}
    async with stack(sim=sim, api_key_file=key_file(tmp_path), tenants=tenants) as (cluster, proxy, client):
        other = Client(proxy.url)
        try:
            first = asyncio.ensure_future(client.chat(chat_body(), bearer("secret-a")))
            await asyncio.sleep(0.05)
            second = await other.chat(chat_body(), bearer("secret-a"))
            assert second.status == 429 and second.headers[b"retry-after"] == b"1"
            assert (await first).status == 200
            assert (await other.chat(chat_body(), bearer("secret-a"))).status == 200
        finally:
            await other.close()


async def test_models_a_key_may_use_and_aliases(tmp_path):
    tenants = {"keys": [{"name": "team-a", "models": ["claude-sonnet-4"], "class": "critical"}]}
    aliases = {"names": {"claude-sonnet-4": "sim-model"}, "listed": "both", "default": "sim-model"}
    config = ProxyConfig(probe_interval=0.05, scrape_interval=0, api_key_file=key_file(tmp_path), tenants=tenants,
                         model_aliases=aliases)
    async with SimCluster(pd=1, config=SIM) as cluster, await start_proxy(config_for_cluster(cluster, config)) as proxy:
        client = Client(proxy.url)
        out = io.StringIO()
        proxy.app.pipeline.access_log = AccessLog("text", stream=out)
        try:
            await wait_for(lambda: not proxy.app.pipeline.models.current.open)
            # An alias is served by its target; the answer names the served model.
            reply = await client.chat(chat_body(model="claude-sonnet-4"), bearer("secret-a"))
            assert reply.status == 200 and reply.json()["model"] == "sim-model"
            # team-a may use the alias only, not the served name itself.
            refused = await client.chat(chat_body(model="sim-model"), bearer("secret-a"))
            assert refused.status == 403 and refused.json()["error"]["code"] == "model_not_allowed"
            # A name nobody serves goes to the default; a key without a list may use it.
            reply = await client.chat(chat_body(model="gpt-4o"), bearer("secret-b"))
            assert reply.status == 200 and reply.json()["model"] == "sim-model"
            models = await client.request("GET", "/v1/models", headers=bearer("secret-b"))
            assert [c["id"] for c in models.json()["data"]] == ["sim-model", "claude-sonnet-4"]
            card = await client.request("GET", "/v1/models/claude-sonnet-4", headers=bearer("secret-b"))
            assert card.status == 200 and card.json()["id"] == "claude-sonnet-4"
        finally:
            await client.close()
    log = out.getvalue()
    assert "model=sim-model key=team-a class=critical ok" in log and "key=team-b class=standard ok" in log


async def test_a_reload_applies_a_new_table_and_a_bad_one_changes_nothing(tmp_path, caplog):
    async with SimCluster(decode=1, config=SIM) as cluster:
        path = tmp_path / "cluster.toml"
        keys = key_file(tmp_path)
        head = f'probe_interval = 0\napi_key_file = "{keys}"\ndecode = ["{cluster.instances("decode")[0].url}"]\n'
        path.write_text(head + '[[tenants.keys]]\nname = "team-a"\nrequests_per_minute = 1\n')
        argv = ["serve", "--config", str(path)]
        settings = ServeSettings(argv, build_parser().parse_args(argv))
        settings.started = settings.load()
        async with await start_proxy(settings.config(settings.started), reloads=True, settings=settings,
                                     watch=False) as proxy:
            client = Client(proxy.url)
            try:
                assert (await client.chat(chat_body(), bearer("secret-a"))).status == 200
                assert (await client.chat(chat_body(), bearer("secret-a"))).status == 429
                path.write_text(head + '[[tenants.keys]]\nname = "team-a"\nrequests_per_minute = 3\n')
                with caplog.at_level(logging.INFO, "epd_proxy.reload"):
                    assert proxy.reloader.reload()
                assert "applied at the next restart" not in caplog.text
                assert (await client.chat(chat_body(), bearer("secret-a"))).status == 200
                path.write_text(head + '[[tenants.keys]]\nname = "team-a"\nrequests_per_minute = -3\n')
                with caplog.at_level(logging.ERROR, "epd_proxy.reload"):
                    assert not proxy.reloader.reload()
                assert "requests_per_minute must be a whole number" in caplog.text
                assert proxy.app.pipeline.tenants.table.policy("team-a").limits == {"requests_per_minute": 3}
            finally:
                await client.close()


def test_check_config_reports_every_mistake_of_the_tables(tmp_path, capsys):
    from epd_proxy.cli import check_config

    path = tmp_path / "cluster.toml"
    path.write_text('decode = ["http://d:1"]\n[tenants]\nstore_failure = "maybe"\n[[tenants.keys]]\nweight = 1\n'
                    '[model_aliases]\nlisted = "all"\n')
    import argparse

    assert check_config.run(argparse.Namespace(file=str(path))) == 2
    err = capsys.readouterr().err
    assert "3 mistakes" in err and "store_failure" in err and "needs a 'name'" in err and "listed" in err


async def test_the_routed_endpoints_keep_the_limits_and_resolve_aliases(tmp_path):
    tenants = {"keys": [{"name": "team-a", "requests_per_minute": 2, "models": ["emb"]}]}
    async with stack(sim=SIM, api_key_file=key_file(tmp_path), tenants=tenants,
                     model_aliases={"names": {"emb": "sim-model"}}) as (cluster, proxy, client):
        body = {"model": "emb", "input": "hello world"}
        ok = await client.post("/v1/embeddings", body, bearer("secret-a"))
        assert ok.status == 200, ok.body
        forwarded = [r for r in cluster.records() if r.path == "/v1/embeddings"]
        assert b'"model":"sim-model"' in forwarded[-1].body
        refused = await client.post("/v1/embeddings", {"model": "sim-model", "input": "x"}, bearer("secret-a"))
        assert refused.status == 403  # before the limits: it spends none of them
        assert (await client.post("/v1/embeddings", body, bearer("secret-a"))).status == 200
        limited = await client.post("/v1/embeddings", body, bearer("secret-a"))
        assert limited.status == 429 and limited.headers[b"x-ratelimit-limit-requests"] == b"2"
        used = (await proxy.app.pipeline.tenants.status())["keys"]["team-a"]["limits"]
        assert used["requests_per_minute"]["used"] == 2


def test_check_config_prints_the_tables(tmp_path, capsys):
    import argparse

    from epd_proxy.cli import check_config

    path = tmp_path / "cluster.toml"
    keys = tmp_path / "keys"
    keys.write_text("a:sk-a\n")
    path.write_text(f'decode = ["http://d:1"]\napi_key_file = "{keys}"\n[tenants.default]\nrequests_per_minute = 60\n'
                    '[[tenants.keys]]\nname = "a"\nclass = "critical"\nmodels = ["m"]\n'
                    '[model_aliases.names]\n"gpt-4o" = "m"\n')
    assert check_config.run(argparse.Namespace(file=str(path))) == 0
    out = capsys.readouterr().out
    assert "tenants: counters in-process, store failure open" in out
    assert "  (default): requests_per_minute=60; class standard, weight 1" in out
    assert "  a: requests_per_minute=60; class critical, weight 1; models m" in out
    assert "model aliases: gpt-4o -> m; /v1/models lists served" in out
