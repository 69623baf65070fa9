"""The proxy's own endpoints: /ready is about the proxy, not its backends."""

import socket

from helpers import Client, stack

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
        proxy.app.draining = True
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
