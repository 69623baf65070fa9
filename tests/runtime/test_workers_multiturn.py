"""Multi-turn KV reuse with --workers N: the kept parameters are per worker process, so a
conversation whose next turn lands on another worker falls back (counted ``not_held``) and
answers the same; decode frees what nobody reads at its TTL."""

import json
import re

from helpers import Client, wait_for
from proxy_process import ProxyProcess

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
            pid = (await client.request("GET", "/status", headers=KEY)).json()["pid"]
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


async def test_a_turn_on_another_worker_falls_back_and_nothing_is_stranded():
    config = SimConfig(itl_ms=0, ttft_ms=0.5, bidirectional=True, bidirectional_kv_ttl=2.0)
    async with SimCluster(prefill=1, decode=1, config=config) as cluster:
        p, d = cluster.instances("prefill")[0], cluster.instances("decode")[0]
        async with ProxyProcess(["--workers", "2", "--prefill", p.url, "--decode", d.url, "--probe-interval", "0",
                                 "--admin-api-key", "k3y", "--log-level", "warning", "--kv-reuse-ttl", "2",
                                 "--kv-reuse-margin", "0.5", "--local-prefill-max-tokens", "0"]) as proxy:
            # Each worker learns from an answer of its own that decode keeps blocks.
            warmed: set[int] = set()
            for i in range(200):
                pid, _, _ = await _turn(proxy, _chat(f"warm {i}"), avoid=next(iter(warmed)) if warmed else None)
                warmed.add(pid)
                if len(warmed) == 2:
                    break
            assert len(warmed) == 2
            b1 = _chat("first question")
            pid1, a1, _ = await _turn(proxy, b1)
            b2 = _chat(" ".join(f"u{i}" for i in range(60)), b1, a1)
            assert a1 == expected_text(b1)
            # the other worker: it never saw turn 1's parameters
            before = (await _turn(proxy, _chat("probe"), avoid=pid1))[2]
            pid2, a2, after = await _turn(proxy, b2, avoid=pid1)
            assert pid2 != pid1 and a2 == expected_text(b2)
            assert after - before == 1, (before, after)
            bodies = [json.loads(r.body) for r in cluster.records("prefill") if r.body]
            reads = [b["kv_transfer_params"] for b in bodies
                     if (b.get("kv_transfer_params") or {}).get("remote_num_tokens")]
            assert reads == []
            assert p.stats.wrong_answers == 0
            # Nothing stranded: what nobody read (turn 1's blocks, kept by the first worker) is
            # freed by decode's TTL.
            await wait_for(lambda: d.kv_reuse.kept_requests == 0, timeout=10.0)
