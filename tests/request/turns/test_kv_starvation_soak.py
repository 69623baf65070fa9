"""A short soak of the mixed traffic that starved both decodes (docs/operations.md, "A decode
starved by kept KV"): an E+P+D cluster with bidirectional transfer, two decodes with small KV
caches, multi-turn chat conversations half streamed, images, Messages and Responses, at
concurrency 16 for ~25 s. vLLM 0.32's decodes pin every finished request's blocks for the TTL;
what the proxy keeps for a next turn it must keep within each decode's capacity."""

from __future__ import annotations

import asyncio
import os
import time

from helpers import stack

from epd_proxy.sim import SimConfig, expected_text

SYSTEM = " ".join(f"s{i}" for i in range(160))
IMAGE = "https://example.com/cat.png"
DEADLINE = 10.0  # a request still waiting then counts as waiting that long
# A longer run (the 10 minutes at c=32): EPD_KV_SOAK_SECONDS=600 EPD_KV_SOAK_CONCURRENCY=32.
SECONDS = float(os.environ.get("EPD_KV_SOAK_SECONDS", "25"))
CONCURRENCY = int(os.environ.get("EPD_KV_SOAK_CONCURRENCY", "16"))


def _user(conv: int, turn: int, image: bool) -> object:
    text = f"conversation {conv} turn {turn}: " + " ".join(f"w{conv}x{turn}x{i}" for i in range(30))
    if not image:
        return text
    return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": IMAGE}}]


async def _soak(client, seconds: float, concurrency: int) -> dict:
    waits: list[float] = []
    errors: list[str] = []
    stuck: list[str] = []
    stop = time.monotonic() + seconds
    counter = iter(range(1_000_000))

    async def timed(path: str, body: dict) -> dict | None:
        t0 = time.monotonic()
        try:
            r = await asyncio.wait_for(client.post(path, body, timeout=DEADLINE + 5), DEADLINE)
        except TimeoutError:
            waits.append(DEADLINE)
            stuck.append(f"{path} stream={body.get('stream')} image={IMAGE in str(body)}")
            return None
        waits.append(time.monotonic() - t0)
        if r.status != 200:
            errors.append(f"{path} {r.status}")
            return None
        return {"text": r.text()} if path == "/v1/chat/completions" else {}

    async def conversation(conv: int) -> None:
        stream = conv % 2 == 1
        body = {"model": "sim-model", "max_tokens": 24, "stream": stream,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": _user(conv, 0, conv % 4 == 0)}]}
        for turn in range(3):
            got = await timed("/v1/chat/completions", body)
            if got is None:
                return
            if got["text"] != expected_text(body):
                errors.append("wrong answer")
            body = dict(body, messages=body["messages"] + [{"role": "assistant", "content": got["text"]},
                                                           {"role": "user", "content": _user(conv, turn + 1, False)}])
            await asyncio.sleep(0.05)

    async def worker() -> None:
        while time.monotonic() < stop:
            n = next(counter)
            if n % 5 == 3:
                await timed("/v1/messages", {"model": "sim-model", "max_tokens": 24,
                                             "messages": [{"role": "user", "content": _user(n, 0, False)}]})
            elif n % 5 == 4:
                await timed("/v1/responses", {"model": "sim-model", "max_output_tokens": 24,
                                              "input": _user(n, 0, False)})
            else:
                await conversation(n)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    waits.sort()
    return {"requests": len(waits), "errors": errors, "max_s": waits[-1] if waits else 0.0,
            "p99_s": waits[int(0.99 * (len(waits) - 1))] if waits else 0.0,
            "over_5s": sum(1 for w in waits if w >= 5.0), "stuck": stuck}


def _sim() -> SimConfig:
    # Decodes of 2,048 blocks (32k tokens) each and a TTL longer than the run; the prefill's
    # unclaimed blocks (an early release's own prompt) freed after vLLM's 30 s lease.
    return SimConfig(itl_ms=2, ttft_ms=2, bidirectional=True, bidirectional_kv_ttl=120.0, num_gpu_blocks=2048,
                     bidirectional_stream_params=True, kv_abort_timeout=30.0)


def _large_prefill(cluster) -> None:
    # The decodes' caches are the ones under test: the prefill's as large as a real one (each
    # early release holds a block of its own there for the lease, as vLLM's prefill does).
    for p in cluster.instances("prefill"):
        assert p.engine is not None
        p.engine.num_blocks = 65536


async def test_a_short_soak_of_mixed_traffic_never_starves_a_decode():
    async with stack(encode=1, prefill=1, decode=2, sim=_sim(), scrape_interval=0.25,
                     kv_reuse_ttl=120.0) as (cluster, proxy, client):
        _large_prefill(cluster)
        out = await _soak(client, SECONDS, CONCURRENCY)
        decodes = cluster.instances("decode")
        print("soak:", {k: v for k, v in out.items() if k != "stuck"}, "stuck:", out["stuck"][:5],
              "kept blocks per decode:", [d.kv_reuse.kept_blocks for d in decodes])
        assert not out["errors"], out["errors"][:5]
        assert out["requests"] > 8 * SECONDS
        assert out["max_s"] < 4.0, out
