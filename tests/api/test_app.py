"""The proxy's own endpoints (/ready is about the proxy, not its backends) and switches."""

import logging
import socket

from helpers import Client, chat_body, probe_round, stack

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.api.app import merge_pool_status
from epd_proxy.config import InstanceSpec


async def test_ready_stays_200_when_every_backend_is_failing():
    async with stack() as (cluster, proxy, client):
        for inst in cluster.all_instances():
            inst.set_health(False)  # /health answers 503: the probes take every instance out
        for pool in proxy.app.pools.values():
            for _ in range(proxy.app.config.fail_threshold):
                await probe_round(pool, 1.0)
            assert not any(inst.healthy for inst in pool.instances)
        reply = await client.request("GET", "/ready")
        assert reply.status == 200 and reply.json() == {"status": "ready"}
        # Backend health is in /status.
        status = (await client.request("GET", "/status")).json()
        assert not any(i["healthy"] for pool in status["pools"].values() for i in pool)


async def test_ready_is_503_for_a_role_without_any_instance():
    async with stack() as (cluster, proxy, client):
        proxy.app.pools["prefill"].instances = []  # as a roster with every prefill gone would leave it
        reply = await client.request("GET", "/ready")
        assert reply.status == 503 and reply.json()["no_instances"] == ["prefill"]
        assert reply.headers[b"retry-after"] == b"5"


async def test_ready_is_503_while_draining_and_responses_close_their_connection():
    async with stack() as (cluster, proxy, client):
        proxy.app.shutting_down = True
        reply = await client.request("GET", "/ready")
        assert reply.status == 503 and reply.json() == {"status": "draining"}
        assert reply.headers[b"connection"] == b"close"
        reply = await client.request("GET", "/health")
        assert reply.status == 200 and reply.headers[b"connection"] == b"close"


async def test_models_error_names_the_role_not_the_address():
    """The body used to say 'decode instance http://127.0.0.1:PORT unreachable'."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        config = ProxyConfig(decode=[InstanceSpec(dead, "decode")], probe_interval=0)
        async with await start_proxy(config) as proxy:
            client = Client(proxy.url)
            try:
                reply = await client.request("GET", "/v1/models")
            finally:
                await client.close()
    assert reply.status >= 500
    assert "decode instance" in reply.json()["error"]["message"]
    assert b"127.0.0.1" not in reply.body and dead.encode() not in reply.body


async def test_log_requests_logs_one_line_per_request(caplog):
    """--log-requests (the reference's flag): one debug line per request, with its status."""
    caplog.set_level(logging.DEBUG, logger="epd_proxy.app")
    async with stack(log_requests=True) as (cluster, proxy, client):
        assert (await client.chat(chat_body(), headers=[(b"x-request-id", b"rid-1")])).status == 200
        assert (await client.request("GET", "/nowhere")).status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "epd_proxy.app"]
    assert any(m.startswith("POST /v1/chat/completions -> 200") and "rid-1" in m for m in lines), lines
    assert any(m.startswith("GET /nowhere -> 404") for m in lines), lines


async def test_no_request_lines_by_default(caplog):
    caplog.set_level(logging.DEBUG, logger="epd_proxy.app")
    async with stack() as (cluster, proxy, client):
        assert (await client.chat(chat_body())).status == 200
    assert not [r for r in caplog.records if r.name == "epd_proxy.app" and "->" in r.getMessage()]


async def test_models_with_no_decode_instance_is_503_with_retry_after():
    from test_admin import empty_proxy

    async with empty_proxy(decode=1, admin_api_key="K") as (cluster, proxy, client):
        reply = await client.request("GET", "/v1/models")
        assert reply.status == 503 and reply.headers[b"retry-after"] == b"5"
        assert reply.json()["error"]["message"] == "no decode instance available"


async def test_models_from_an_unreachable_decode_names_the_role_not_the_address():
    async with stack(decode=2) as (cluster, proxy, client):
        for inst in cluster.instances("decode"):
            await inst.crash()
        reply = await client.request("GET", "/v1/models")
        assert reply.status == 502
        message = reply.json()["error"]["message"]
        assert message == "decode instance unreachable" and "127.0.0.1" not in message


# -- routes ---------------------------------------------------------------------------------------

async def test_unknown_route_and_method():
    async with stack() as (cluster, proxy, client):
        assert (await client.request("GET", "/nope")).status == 404
        assert (await client.request("GET", "/v1/chat/completions")).status == 405


async def test_models_health_ready_metrics():
    async with stack() as (cluster, proxy, client):
        models = await client.request("GET", "/v1/models")
        assert models.status == 200 and models.json()["data"][0]["id"] == "sim-model"
        assert (await client.request("GET", "/health")).status == 200
        assert (await client.request("GET", "/ready")).status == 200
        await client.chat(chat_body())
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert 'epd_proxy_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in metrics
        assert "epd_proxy_stage_duration_seconds_count{stage=\"prefill\"} 1.0" in metrics
        assert 'epd_proxy_instance_healthy{role="decode"' in metrics


async def test_health_never_waits_on_a_hung_backend():
    async with stack() as (cluster, proxy, client):
        for inst in cluster.all_instances():
            inst.inject("hang", times=100)
        reply = await client.request("GET", "/health", timeout=1.0)
        assert reply.status == 200


async def test_unknown_paths_and_methods_get_the_error_envelope():
    async with stack() as (cluster, proxy, client):
        reply = await client.request("GET", "/nope")
        assert reply.status == 404
        assert reply.json() == {"error": {"message": "no route for GET /nope", "type": "NotFoundError",
                                          "param": None, "code": 404}}
        for method, path in (("GET", "/v1/completions"), ("DELETE", "/health"), ("POST", "/metrics")):
            reply = await client.request(method, path)
            assert reply.status == 405, (method, path)
            assert reply.json()["error"]["message"] == f"method {method} not allowed on {path}"
            assert reply.json()["error"]["type"] == "MethodNotAllowedError"
        # None of it reached an instance.
        assert cluster.records() == []
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert 'epd_proxy_requests_total{endpoint="other",status="404"} 1.0' in metrics
        assert 'epd_proxy_requests_total{endpoint="other",status="405"} 3.0' in metrics


async def test_health_and_ready_answer_head_without_a_body():
    async with stack() as (cluster, proxy, client):
        for path in ("/health", "/ready"):
            reply = await client.request("HEAD", path)
            assert reply.status == 200 and reply.body == b"", path
        assert (await client.request("GET", "/health")).json() == {"status": "ok"}


async def test_status_names_topology_pools_and_policies():
    async with stack(encode=1) as (cluster, proxy, client):
        status = (await client.request("GET", "/status")).json()
        assert status["topology"] == "E+P+D"
        assert status["kv_connector"] == "nixl"
        assert {role: [i["url"] for i in insts] for role, insts in status["pools"].items() if insts} == {
            role: cluster.urls(role) for role in ("encode", "prefill", "decode")}
        assert set(status["routing"]) == {"encode", "prefill", "decode"}
        assert status["pid"] > 0


def _inst(url, healthy, **kw):
    view = {"url": url, "state": "healthy" if healthy else "ejected", "healthy": healthy,
            "consecutive_failures": 0, "ejections": 0, "ejected_until": None, "inflight": 0,
            "requests": 0, "errors": {}, "last_error": None}
    view.update(kw)
    return view


def test_merged_status_adds_counts_and_is_healthy_only_where_every_worker_says_so():
    one = {"decode": [_inst("http://d0", True, requests=3, inflight=1, errors={"connect": 1}),
                      _inst("http://d1", True, requests=2)]}
    two = {"decode": [_inst("http://d0", False, requests=4, consecutive_failures=3, ejections=1,
                            ejected_until=12.5, errors={"connect": 2, "http_503": 1}, last_error="refused"),
                      _inst("http://d1", True, requests=5)]}
    merged = {i["url"]: i for i in merge_pool_status([one, two])["decode"]}
    d0, d1 = merged["http://d0"], merged["http://d1"]
    assert (d0["requests"], d0["inflight"], d0["ejections"]) == (7, 1, 1)
    assert d0["errors"] == {"connect": 3, "http_503": 1}
    assert (d0["healthy"], d0["healthy_workers"], d0["state"]) == (False, 1, "mixed")
    assert (d0["consecutive_failures"], d0["ejected_until"], d0["last_error"]) == (3, 12.5, "refused")
    assert (d1["requests"], d1["healthy"], d1["healthy_workers"], d1["state"]) == (7, True, 2, "healthy")
    # The inputs are left as they were (they are the workers' own answers).
    assert one["decode"][0]["errors"] == {"connect": 1}


async def test_head_works_on_every_get_route_without_a_body():
    async with stack() as (cluster, proxy, client):
        gets = sorted(path for method, path in proxy.app._routes if method == "GET")
        assert {"/metrics", "/version", "/load", "/v1/models", "/health"} <= set(gets)
        for path in gets:
            got = await client.request("GET", path)
            head = await client.request("HEAD", path)
            assert head.status == got.status, path
            assert head.body == b"" and head.headers.get(b"content-type") == got.headers.get(b"content-type"), path


async def test_405_carries_allow_and_an_unknown_path_is_a_404_envelope():
    async with stack() as (cluster, proxy, client):
        reply = await client.request("DELETE", "/metrics")
        assert reply.status == 405 and reply.headers[b"allow"] == b"GET, HEAD"
        assert reply.json()["error"]["type"] == "MethodNotAllowedError"
        reply = await client.request("GET", "/tokenize")
        assert reply.status == 405 and reply.headers[b"allow"] == b"POST"
        reply = await client.request("POST", "/v1/nothing-here", b"{}")
        assert reply.status == 404 and b"allow" not in reply.headers
        assert reply.json()["error"] == {"message": "no route for POST /v1/nothing-here", "type": "NotFoundError",
                                         "param": None, "code": 404}


def test_merged_status_adds_each_workers_held_kv_per_decode():
    def held(keeps, tokens, conversations):
        return {"keeps_blocks": keeps, "held_tokens": tokens, "held_conversations": conversations}
    one = {"decode": [_inst("http://d0", True, kv_reuse=held(None, 0, 0)),
                      _inst("http://d1", True, kv_reuse=held(True, 300, 2))]}
    two = {"decode": [_inst("http://d0", True, kv_reuse=held(True, 120, 1)),
                      _inst("http://d1", True, kv_reuse=held(None, 0, 0))]}
    merged = {i["url"]: i["kv_reuse"] for i in merge_pool_status([one, two])["decode"]}
    assert merged == {"http://d0": held(True, 120, 1), "http://d1": held(True, 300, 2)}
    assert one["decode"][0]["kv_reuse"] == held(None, 0, 0)  # the workers' own answers untouched


async def test_the_proxys_own_version_is_in_status_and_metrics_and_version_stays_the_instances():
    from pathlib import Path

    import epd_proxy
    from epd_proxy.observe.version import VERSION

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'\nversion = "{VERSION}"\n' in pyproject and epd_proxy.__version__ == VERSION  # one version
    async with stack() as (cluster, proxy, client):
        assert (await client.request("GET", "/status")).json()["proxy"] == {"version": VERSION}
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert f'epd_proxy_build_info{{version="{VERSION}"}} 1.0' in metrics
        version = await client.request("GET", "/version")  # what vLLM clients read: the instance's
        assert version.status == 200 and version.json() == {"version": "0.32.0+sim"}, version.body
        assert b"server" not in version.headers  # no header on every answer: /status and /metrics tell it
