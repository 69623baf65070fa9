"""Multi-turn KV reuse with --workers N and no external store: the parent holds the kept
parameters for all its workers (state/parent.py), so a conversation's next turn read on
another worker reads the previous answer from decode, even after the worker that kept it
was killed."""

import asyncio
import json
import os
import re
import signal

from helpers import Client
from proxy_process import ProxyProcess

from epd_proxy.http.transport import UpstreamError
from epd_proxy.sim import SimCluster, SimConfig, expected_text

KEY = [(b"x-api-key", b"k3y")]
SYSTEM = " ".join(f"w{i}" for i in range(300))


def _chat(user: str, prev: dict | None = None, answer: str = "") -> dict:
    msgs = [{"role": "system", "content": SYSTEM}] if prev is None else \
        prev["messages"] + [{"role": "assistant", "content": answer}]
    return {"model": "sim-model", "max_tokens": 60, "messages": msgs + [{"role": "user", "content": user}]}


def _unknown(metrics: bytes) -> float:
    m = re.search(rb'^epd_proxy_kv_reuse_turns_total\{outcome="not_held"\} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


async def _turn(proxy: ProxyProcess, body: dict, avoid: int | None = None) -> tuple[int, str, float]:
    """``body`` over a new connection to a worker other than ``avoid`` (one connection: one
    worker): that worker's pid, the answer, and the ``not_held`` turns after the turn."""
    for _ in range(200):
        client = Client(proxy.url)
        try:
            try:
                pid = (await client.request("GET", "/status", headers=KEY)).json()["pid"]
            except UpstreamError:  # queued at a worker just killed
                continue
            if pid == avoid:
                continue
            r = await client.chat(body)
            assert r.status == 200, r.body
            doc = r.json()
            assert doc["kv_transfer_params"] is None
            metrics = (await client.request("GET", "/metrics", headers=KEY)).body  # every worker's, summed
            return pid, doc["choices"][0]["message"]["content"], _unknown(metrics)
        finally:
            await client.close()
    raise AssertionError("the kernel never picked another worker")


def _reads(cluster) -> list[dict]:
    bodies = [json.loads(r.body) for r in cluster.records("prefill") if r.body]
    return [b["kv_transfer_params"] for b in bodies if (b.get("kv_transfer_params") or {}).get("remote_num_tokens")]


async def test_a_turn_on_another_worker_reads_what_the_first_kept():
    config = SimConfig(itl_ms=0, ttft_ms=0.5, bidirectional=True)
    async with SimCluster(prefill=1, decode=1, config=config) as cluster:
        p, d = cluster.instances("prefill")[0], cluster.instances("decode")[0]
        async with ProxyProcess(["--workers", "2", "--prefill", p.url, "--decode", d.url, "--probe-interval", "0",
                                 "--admin-api-key", "k3y", "--log-level", "warning",
                                 "--local-prefill-max-tokens", "0"]) as proxy:
            pid0, _, _ = await _turn(proxy, _chat("warm up"))  # one worker learns that decode keeps blocks
            # ... and the other from the parent's store within a second
            for _ in range(50):
                b1 = _chat("first question")
                pid1, a1, _ = await _turn(proxy, b1, avoid=pid0)
                b2 = _chat(" ".join(f"u{i}" for i in range(60)), b1, a1)
                pid2, a2, unknown = await _turn(proxy, b2, avoid=pid1)
                assert a1 == expected_text(b1) and a2 == expected_text(b2)
                if _reads(cluster):
                    break
                await asyncio.sleep(0.1)  # the second worker has not learnt it yet
            assert pid2 != pid1 and len(_reads(cluster)) == 1
            # The worker that kept turn 2 is killed: turn 3 on the other one still reads it.
            b3 = _chat(" ".join(f"v{i}" for i in range(60)), b2, a2)
            os.kill(pid2, signal.SIGKILL)
            _, a3, _ = await _turn(proxy, b3, avoid=pid2)
            assert a3 == expected_text(b3)
            assert len(_reads(cluster)) == 2 and p.stats.wrong_answers == 0
            client = Client(proxy.url)
            try:
                status = (await client.request("GET", "/status", headers=KEY)).json()
            finally:
                await client.close()
            assert status["state_store"]["kind"] == "parent" and status["state_store"]["up"] is True
