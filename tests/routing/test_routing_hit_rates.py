"""Prefix- and encoder-cache hit rates per routing policy on a small multi-turn workload, read
from the simulator's /metrics. The test checks the ordering; run the module to print the table
for docs/architecture.md ("Routing"):

    PYTHONPATH=src python tests/routing/test_routing_hit_rates.py
"""

import asyncio
import random
import sys

from helpers import Client
from test_routing_cluster import Conversation, metric

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig

# Per-instance cache capacity well below the working set (24 conversations x 4 turns of about
# 190 tokens at the end, about 12 blocks each, about 290 blocks in all, on 3 prefills of 40).
SIM = SimConfig(itl_ms=0, ttft_ms=0.5, prefix_cache_blocks=40, encoder_cache_tokens=400)


async def run_workload(prefill_policy: str, *, prefills=3, pd=0, encode_policy="cache-aware",
                       conversations=24, turns=4, lanes=6, images=0, sim: SimConfig = SIM) -> dict:
    """``conversations`` multi-turn chats of ``turns`` turns, each turn after the previous
    answer; ``lanes`` clients each take the next turn of a conversation drawn at random (seeded)
    from those not finished, so turns of different conversations interleave as with real users;
    ``images`` distinct pictures shared round the conversations (first turn)."""
    async with SimCluster(encode=2 if images else 0, prefill=prefills if not pd else 0, decode=0 if pd else 2,
                          pd=pd, config=sim) as cluster:
        role = "pd" if pd else "prefill"
        cfg = ProxyConfig(probe_interval=0, scrape_interval=0.05, encode_policy=encode_policy,
                          **({"decode_policy": prefill_policy} if pd else {"prefill_policy": prefill_policy}))
        async with await start_proxy(config_for_cluster(cluster, cfg)) as proxy:
            active = [Conversation(c, images=[f"https://x/img{c % images}.png"] if images else ())
                      for c in range(conversations)]
            pick = random.Random(1).randrange
            busy: set[int] = set()

            async def lane():
                client = Client(proxy.url)
                try:
                    while True:
                        ready = [c for c in active if c.conv not in busy]
                        if not ready:
                            if not active:
                                return
                            await asyncio.sleep(0.001)
                            continue
                        conv = ready[pick(len(ready))]
                        busy.add(conv.conv)
                        await conv.say(client)
                        busy.discard(conv.conv)
                        if conv.turns == turns:
                            active.remove(conv)
                finally:
                    await client.close()

            await asyncio.gather(*(lane() for _ in range(lanes)))
        insts = cluster.instances(role)
        queries = sum([await metric(i.url, b"vllm:prefix_cache_queries_total") for i in insts])
        hits = sum([await metric(i.url, b"vllm:prefix_cache_hits_total") for i in insts])
        per = [len(i.generation_records()) for i in insts]
        out = {"prefix_hit_rate": hits / queries, "requests_max_min": (max(per), min(per))}
        if images:
            enc = cluster.instances("encode")
            eq = sum([await metric(i.url, b"sim:encoder_cache_queries_total") for i in enc])
            eh = sum([await metric(i.url, b"sim:encoder_cache_hits_total") for i in enc])
            out["encoder_hit_rate"] = eh / eq
        return out


async def test_cache_aware_has_the_best_prefix_hit_rate():
    rates = {p: (await run_workload(p, conversations=12, turns=3, lanes=4))["prefix_hit_rate"]
             for p in ("cache-aware", "round-robin", "least-loaded")}
    assert rates["cache-aware"] > rates["least-loaded"] and rates["cache-aware"] > rates["round-robin"], rates


async def test_item_affinity_has_the_best_encoder_hit_rate():
    # Caches that hold every image: affinity then misses each image once (4 of 24 encodes),
    # whatever encoders the hashes pick; a rotation sends images to encoders that lack them.
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, encoder_cache_tokens=1 << 16)
    rates = {p: (await run_workload("cache-aware", encode_policy=p, conversations=12, turns=2, lanes=4,
                                    images=4, sim=sim))["encoder_hit_rate"]
             for p in ("cache-aware", "round-robin")}
    assert rates["cache-aware"] == 20 / 24 and rates["round-robin"] < rates["cache-aware"], rates


async def main() -> None:  # pragma: no cover - the table for the docs
    print("| topology | policy | prefix-cache hit rate | requests per instance max/min |")
    print("|---|---|---|---|")
    for pd in (0, 3):
        for policy in ("round-robin", "least-loaded", "load-aware", "power-of-two", "cache-aware"):
            r = await run_workload(policy, pd=pd)
            print(f"| {'PD x3' if pd else 'P x3 + D x2'} | {policy} | {r['prefix_hit_rate']:.1%} | "
                  f"{r['requests_max_min'][0]}/{r['requests_max_min'][1]} |")
    print()
    print("| encode policy | encoder-cache hit rate |")
    print("|---|---|")
    for policy in ("round-robin", "least-loaded", "load-aware", "power-of-two", "cache-aware"):
        r = await run_workload("cache-aware", encode_policy=policy, images=8, turns=2)
        print(f"| {policy} | {r['encoder_hit_rate']:.1%} |")


if __name__ == "__main__":  # pragma: no cover
    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    asyncio.run(main())
