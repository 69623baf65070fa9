"""The proxy's own endpoints (/ready is about the proxy, not its backends) and switches."""

import logging
import socket

from helpers import Client, chat_body, stack

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.config import InstanceSpec


async def test_ready_stays_200_when_every_backend_is_failing():
    async with stack() as (cluster, proxy, client):
        for inst in cluster.all_instances():
            inst.set_health(False)  # /health answers 503: the probes take every instance out
        for pool in proxy.app.pools.values():
            for _ in range(proxy.app.config.fail_threshold):
                await pool.probe_once(1.0)
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
