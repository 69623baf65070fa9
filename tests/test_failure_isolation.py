"""Failure isolation over real sockets: every stage × every fault × stream/non-stream,
with one instance per role and with two, against one shared simulated cluster.

Each case checks what the client gets (status and envelope, or an SSE stream
ending in ``data: [DONE]``) and what the pools look like afterwards: a fault
that one request carries ejects nothing, every in-flight count is back to zero,
and normal requests right after all succeed. Then poison isolation: a client
repeatedly sending a request that prefill fails with HTTP 500 never costs the
other clients a request.
"""

import asyncio

import msgspec
import pytest
import pytest_asyncio
from helpers import Client, chat_body

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.config import StageTimeouts
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROLES = ("encode", "prefill", "decode")
FAULTS = ("refused", "500", "400", "503", "hang", "reset", "in-band", "stall")
# Long enough that a loaded machine does not time out a healthy stage: a timed-out instance
# is not tried again for the request, so a spurious timeout would decide the answer.
STAGE_TIMEOUT = 0.6


def fault_spec(role: str, fault: str) -> str:
    """The simulator fault that travels with the request (``X-Sim-Fault``, forwarded to every
    stage; the role prefix picks the stage). Decode's token faults act mid-stream, after the
    commit point; encode and prefill produce no streamed tokens, so theirs act at once."""
    mid = 3 if role == "decode" else 0
    return {
        "500": f"{role}:status=500",
        "400": f"{role}:status=400",
        "503": f"{role}:status=503",
        "hang": f"{role}:hang",
        "reset": f"{role}:reset-after={mid}",
        "in-band": f"{role}:error-after={mid}",
        "stall": f"{role}:stall-after={mid}:5",
    }[fault]


def expected(role: str, fault: str, stream: bool, size: int) -> int | str:
    """The client's status, or "in-band" for a committed stream ending in an error event."""
    if fault == "refused":
        return 200 if size > 1 else 503
    if role == "decode" and stream and fault in ("reset", "in-band", "stall"):
        return "in-band"
    return {"500": 502, "400": 400, "503": 502, "hang": 504, "reset": 502, "in-band": 502, "stall": 504}[fault]


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=[1, 2], ids=["x1", "x2"])
async def deployment(request):
    size = request.param
    sim = SimConfig(itl_ms=0, ttft_ms=0.5)
    async with SimCluster(encode=size, prefill=size, decode=size, config=sim) as cluster:
        t = StageTimeouts(connect=1.0, encode=STAGE_TIMEOUT, prefill=STAGE_TIMEOUT, decode_first=STAGE_TIMEOUT,
                     stream_idle=STAGE_TIMEOUT)
        # fail_threshold=2: counting every attempt of one request (or its 500s) would eject.
        # least-loaded: every request here has the same prompt, so affinity would send all first
        # attempts to one instance and only the faulty retries to the other.
        base = ProxyConfig(probe_interval=0, fail_threshold=2, decode_retries=1, timeouts=t, routing="least-loaded",
                           forward_headers=("traceparent", "tracestate", "x-sim-fault"))
        async with await start_proxy(config_for_cluster(cluster, base)) as proxy:
            client = Client(proxy.url)
            try:
                yield size, cluster, proxy, client
            finally:
                await client.close()


def body(stream: bool) -> dict:
    return chat_body(stream=stream, images=["https://x/a.png"])


async def assert_pools_unharmed(proxy, client):
    status = (await client.request("GET", "/status")).json()
    for role, insts in status["pools"].items():
        for inst in insts:
            assert inst["state"] == "healthy", (role, inst)
            assert inst["inflight"] == 0, (role, inst)
    for stream in (False, True, False, True):
        reply = await client.chat(body(stream))
        assert reply.status == 200, reply.body
        if stream:
            assert reply.body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("role", ROLES)
async def test_fault_matrix(deployment, role, fault, stream):
    size, cluster, proxy, client = deployment
    victim = cluster.instances(role)[0]
    headers = []
    if fault == "refused":
        await victim.crash()
    else:
        headers = [(b"x-sim-fault", fault_spec(role, fault).encode())]
    try:
        reply = await client.chat(body(stream), headers)
    finally:
        if fault == "refused":
            await victim.restart()
    want = expected(role, fault, stream, size)
    if want == "in-band":
        assert reply.status == 200
        events = reply.events
        assert events[-1] == b"data: [DONE]"
        assert b'"error"' in events[-2]
    elif want == 200:
        assert reply.status == 200, reply.body
        assert not stream or reply.body.endswith(b"data: [DONE]\n\n")
    else:
        assert reply.status == want, reply.body
        err = reply.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "127.0.0.1" not in err["message"]  # the role, never the address
        if want == 503:
            assert reply.headers[b"retry-after"] == b"5"
            assert f"no {role} instance" in err["message"]
        elif want >= 500:
            assert role in err["message"]
    await assert_pools_unharmed(proxy, client)


# -- poison isolation ---------------------------------------------------------------------------

@pytest.mark.parametrize("prefills", [1, 2])
@pytest.mark.parametrize("pair", [False, True], ids=["single", "pairs"])
async def test_a_poison_request_never_fails_anyone_else(prefills, pair):
    """A client sends a request prefill fails with HTTP 500 (vLLM failing one odd
    request) every ~0.2 s, alone or in pairs, while others send normal traffic."""
    sim = SimConfig(itl_ms=0, ttft_ms=0.5)
    async with SimCluster(prefill=prefills, decode=1, config=sim) as cluster:
        # least-loaded, as above: one prompt for all traffic would otherwise leave the poison's
        # retries alone on the second instance.
        cfg = ProxyConfig(probe_interval=0, routing="least-loaded")
        async with await start_proxy(config_for_cluster(cluster, cfg)) as proxy:
            loop = asyncio.get_running_loop()
            end = loop.time() + 2.0
            poison = chat_body(sim_fault="prefill:status=500")
            outcomes: list[int] = []
            poisoned: list[int] = []

            async def normal():
                client = Client(proxy.url)
                try:
                    while loop.time() < end:
                        outcomes.append((await client.chat(chat_body(stream=len(outcomes) % 2 == 0))).status)
                finally:
                    await client.close()

            async def poisoner():
                client = Client(proxy.url)
                try:
                    while loop.time() < end:
                        sent = [client.chat(poison)] + ([Client(proxy.url).chat(poison)] if pair else [])
                        poisoned.extend(r.status for r in await asyncio.gather(*sent))
                        await asyncio.sleep(0.2)
                finally:
                    await client.close()

            await asyncio.gather(normal(), normal(), poisoner())
            assert poisoned and set(poisoned) == {502}
            assert len(outcomes) > 20
            assert outcomes.count(200) == len(outcomes), [s for s in outcomes if s != 200][:5]
            assert all(i.healthy for i in proxy.app.pools["prefill"].instances)


async def test_expectations_cover_the_whole_matrix():
    # Pure: every case has a defined outcome (guards edits to FAULTS).
    for role in ROLES:
        for fault in FAULTS:
            for stream in (False, True):
                for size in (1, 2):
                    assert expected(role, fault, stream, size) in (200, 400, 502, 503, 504, "in-band")
                    if fault != "refused":
                        msgspec.json.encode(fault_spec(role, fault))
