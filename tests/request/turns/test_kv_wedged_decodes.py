"""Both decodes of a P/D cluster with bidirectional transfer filled with the blocks vLLM 0.32
pins for every finished stream (which the proxy cannot release), over real sockets: each is
out as ``wedged`` at once (the passive cap does not keep one in rotation), new requests are
answered by the prefill alone within a moment (a plain request pins nothing there), and once
the pins expire the decodes are back (docs/operations.md, "A decode starved by kept KV")."""

from __future__ import annotations

import asyncio
import io

import msgspec
from helpers import stack, wait_for

from epd_proxy.instances.load_signals import wedged
from epd_proxy.observe.access_log import AccessLog
from epd_proxy.sim import SimConfig, expected_text

TTL = 8.0  # the decodes' decoder_kv_blocks_ttl: the wedge ends when the first pins expire
PROMPT = " ".join(f"w{i}" for i in range(180))  # ~12 blocks of 16 tokens


def _sim() -> SimConfig:
    # Decodes of 48 blocks: three finished streams pin ~39, so a fourth waits with none running.
    # ``strict_roles`` off: a prefill answers a plain request, as vLLM does.
    return SimConfig(itl_ms=2, ttft_ms=2, bidirectional=True, bidirectional_kv_ttl=TTL, num_gpu_blocks=48,
                     strict_roles=False)


def _body(n: int, stream: bool) -> dict:
    return {"model": "sim-model", "max_tokens": 16, "stream": stream,
            "messages": [{"role": "user", "content": f"request {n}: {PROMPT}"}]}


async def test_both_decodes_wedged_by_pinned_streams_the_prefill_answers_at_once_until_they_recover():
    out = io.StringIO()
    async with stack(prefill=1, decode=2, sim=_sim(), scrape_interval=0.25, routing="round-robin",
                     max_ejection_percent=50) as (cluster, proxy, client):
        proxy.app.pipeline.access_log = AccessLog("text", stream=out)
        await client.request("GET", "/console/api/state")  # a console looks: requests are recorded
        prefill = cluster.instances("prefill")[0]
        assert prefill.engine is not None
        prefill.engine.num_blocks = 65536
        decodes = cluster.instances("decode")
        pool = proxy.app.pools["decode"]
        # Six streams, three per decode: each pins its blocks for the TTL (no parameters reach us).
        for n in range(6):
            r = await client.chat(_body(n, True))
            assert r.status == 200 and r.text() == expected_text(_body(n, True))
        assert all(d.kv_reuse.kept_blocks >= 36 for d in decodes)
        # One more each, a second apart: they wait, none runs; the scrape sees both stand still.
        # The first decode's is failed over to the second, still in rotation, where it waits
        # again until that one is out too: then the prefill answers it (not a 502 for a spent
        # retry).
        stuck = [asyncio.ensure_future(client.chat(_body(10, True), timeout=30))]
        await asyncio.sleep(1.0)
        stuck.append(asyncio.ensure_future(client.chat(_body(11, True), timeout=30)))
        loop = asyncio.get_running_loop()
        await wait_for(lambda: not any(i.healthy for i in pool.instances), timeout=10)

        # New requests, streamed and whole: answered within a moment, by the prefill alone.
        t0 = loop.time()
        bodies = [_body(100 + n, n % 2 == 0) for n in range(6)]
        replies = await asyncio.gather(*(client.chat(b, timeout=4) for b in bodies))
        assert loop.time() - t0 < 4
        for b, r in zip(bodies, replies):
            assert r.status == 200, r.body
            assert r.text() == expected_text(b)
        # the requests that waited in the decodes' queues were failed over and answered too
        for n, s in enumerate(stuck):
            r = await asyncio.wait_for(s, 2)
            assert r.status == 200, r.body
            assert r.text() == expected_text(_body(10 + n, True))
        assert prefill.kv_reuse.kept_blocks == 0  # plain requests pin nothing on the prefill
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert 'epd_proxy_wedged_routing_total{outcome="prefill_alone",role="decode"} 8.0' in metrics
        assert 'epd_proxy_instance_failures_total{kind="wedged"' in metrics
        status = (await client.request("GET", "/status")).json()
        assert [i["state"] for i in status["pools"]["decode"]] == ["ejected", "ejected"]
        assert all("none running" in i["last_error"] for i in status["pools"]["decode"])
        recent = (await client.request("GET", "/console/api/state")).json()["recent"]
        alone = [r for r in recent if (r.get("placement") or {}).get("decode", {}).get("why", "").startswith(
            "every decode wedged")]
        assert len(alone) == 8 and all(r["placement"]["decode"]["instance"] == prefill.url for r in alone)
        step = [w for w in alone[0]["waterfall"] if w["stage"] == "decode"][0]
        assert step["instances"] == [prefill.url] and step["why"] == "every decode wedged: the prefill answers alone"
        lines = [line for line in out.getvalue().splitlines() if "/v1/chat" in line]
        port = prefill.url.rsplit(":", 1)[1]
        assert sum(f" p=127.0.0.1:{port} " in line and " d=" not in line for line in lines) >= 6

        # The pins expire: the decodes run again and are back; new requests go to them.
        await wait_for(lambda: not pool.wedged and all(i.healthy for i in pool.instances), timeout=TTL + 10)
        before = len(cluster.records("decode"))
        r = await client.chat(_body(200, False))
        assert r.status == 200 and r.text() == expected_text(_body(200, False))
        assert len(cluster.records("decode")) == before + 1
        assert proxy.app.pools["decode"].wedged_routing == {"prefill_alone": 8, "refused": 0}


async def test_every_decode_wedged_without_a_prefill_is_refused_at_once_with_the_api_envelope():
    sim = SimConfig(itl_ms=2, ttft_ms=2, bidirectional=True, bidirectional_kv_ttl=TTL, num_gpu_blocks=48,
                    strict_roles=False)
    async with stack(prefill=1, decode=1, sim=sim, scrape_interval=0.25) as (cluster, proxy, client):
        prefill = cluster.instances("prefill")[0]
        assert prefill.engine is not None
        prefill.engine.num_blocks = 65536
        pool = proxy.app.pools["decode"]
        for n in range(3):
            assert (await client.chat(_body(n, True))).status == 200
        stuck = asyncio.ensure_future(client.chat(_body(10, True), timeout=30))
        loop = asyncio.get_running_loop()
        await wait_for(lambda: wedged(pool.instances[0].signals, loop.time()) is not None, timeout=10)
        await asyncio.sleep(0.6)
        # the prefill is out too (its probes fail): nothing can take a request
        for _ in range(3):
            proxy.app.pools["prefill"].outliers.probe_failed(prefill and proxy.app.pools["prefill"].instances[0],
                                                             "connection", "probe")
        t0 = loop.time()
        r = await client.chat(_body(20, False), timeout=4)
        assert loop.time() - t0 < 1.5
        assert r.status == 503 and r.headers.get(b"retry-after") == b"5"
        err = r.json()["error"]
        assert err["code"] == "overloaded" and err["message"] == "the decode instances are at capacity; retry later"
        r = await client.post("/v1/messages", {"model": "sim-model", "max_tokens": 8,
                                               "messages": [{"role": "user", "content": "hi"}]}, timeout=4)
        assert r.status == 503 and msgspec.json.decode(r.body)["error"]["type"] == "overloaded_error"
        stuck.cancel()


async def test_a_stream_on_a_decode_taken_out_for_standing_still_is_continued_on_the_prefill_alone():
    """The same rule for a stream's continuation (request/migration.py): its decode taken out
    for standing still mid-answer (vLLM preempts it when pinned blocks fill the cache) and the
    other decode out too, the stream goes on on the prefill alone, whole."""
    sim = SimConfig(itl_ms=20, ttft_ms=1, strict_roles=False)
    async with stack(prefill=1, decode=2, sim=sim) as (cluster, proxy, client):
        pool = proxy.app.pools["decode"]
        body = {"model": "sim-model", "max_tokens": 40, "stream": True,
                "messages": [{"role": "user", "content": "a long answer please"}]}
        reply = asyncio.ensure_future(client.chat(body, timeout=20))
        await wait_for(lambda: any(i.inflight for i in pool.instances), timeout=5)
        await asyncio.sleep(0.2)  # the stream committed, a few events relayed
        for inst in pool.instances:  # the load scrape's verdict on both
            pool.outliers.standing(inst, "4 requests waiting, none running for 2.0 s (KV cache 100.0% full)")
        r = await asyncio.wait_for(reply, 10)
        assert r.status == 200
        events = [e for e in r.events if e != b"data: [DONE]"]
        assert r.events[-1] == b"data: [DONE]" and b'"error"' not in r.body
        texts = [c["delta"].get("content") for e in events for c in msgspec.json.decode(e[6:])["choices"]]
        assert len([t for t in texts if t]) == 40
        assert pool.wedged_routing["prefill_alone"] == 1
        assert len(cluster.records("prefill")) == 2  # its prefill leg, then the continuation
