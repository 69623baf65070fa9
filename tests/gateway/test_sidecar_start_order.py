"""``epd-proxy sidecar`` started before its decode, as a pod's containers start in any order:
until the decode answers, a request gets 503 in its API's envelope (a gateway retries it
elsewhere); once the decode is up, the same requests are answered, with no restart. (The
sidecar's ``/ready`` is its own, as the proxy's is: the pod's readiness waits for vLLM's
startup probe, docs/deploy/gateway-sidecar.yaml.) Real processes and sockets: the sidecar a child process, the
decode a simulated vLLM that starts on the port the sidecar was given."""

from __future__ import annotations

import asyncio

import msgspec
from envoy_gateway import SidecarProcess
from helpers import Client, chat_body
from procs import free_port

from epd_proxy.sim import SimCluster, SimConfig, expected_text


async def _send(url: str, method: str, path: str, body: dict | None = None):
    client = Client(url)
    try:
        if body is None:
            return await client.request("GET", path)
        return await client.post(path, body)
    finally:
        await client.close()


async def test_a_sidecar_up_before_its_decode_answers_503_in_envelope_then_serves_once_it_is_up():
    port = free_port()
    async with SidecarProcess(["--decode", f"http://127.0.0.1:{port}"], ready=False) as sidecar:
        body = chat_body("before and after", max_tokens=5)
        early = await _send(sidecar.url, "POST", "/v1/chat/completions", body)
        assert early.status == 503, early.body
        error = msgspec.json.decode(early.body)["error"]  # OpenAI's envelope, not a bare text
        assert error["message"] and error["code"] == 503
        messages = await _send(sidecar.url, "POST", "/v1/messages",
                               {"model": "sim-model", "max_tokens": 5,
                                "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status == 503 and msgspec.json.decode(messages.body)["type"] == "error"

        async with SimCluster(decode=1, config=SimConfig(), base_port=port):
            for _ in range(150):  # the decode, out since the first request, is probed back in
                late = await _send(sidecar.url, "POST", "/v1/chat/completions", body)
                if late.status != 503:
                    break
                await asyncio.sleep(0.1)
            assert late.status == 200, (late.body, sidecar.log()[-2000:])
            assert msgspec.json.decode(late.body)["choices"][0]["message"]["content"] == expected_text(body)
