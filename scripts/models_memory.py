"""The proxy's memory with many instances, each serving many LoRA adapters: for docs/benchmarks.md's
"Memory with many models" and docs/architecture.md's "Models".

    PYTHONPATH=src python scripts/models_memory.py [--instances 300] [--adapters 2000] [--per-instance 200]
        [--rounds 3] [--round-s 3] [--probe-s 1]

A child process serves ``--instances`` fake vLLM instances on loopback ports: each answers
``GET /health`` and ``GET /v1/models`` as vLLM 0.32 does (the base ``base`` and its LoRA cards
with ``parent``; ``created`` and each ``permission`` id new on every answer, as vLLM makes
them), its adapters ``--per-instance`` of ``--adapters`` (instance i holds a window starting at
i * step, so the sets overlap without being equal: the case that shares least). This process
runs the proxy in front of them (``start_proxy``, probing every ``--probe-s``), waits until every
instance has said what it serves, and reports the Python heap (tracemalloc) and the RSS before
any instance was read, once all were, and after further rounds of probes (steady: no growth).
Then the request path's per-model metric labels with 100,000 distinct names. Every figure is
this process's only (the fake instances live in the child).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import time
import tracemalloc
import uuid


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def models_body(adapters: list[str]) -> bytes:
    now = int(time.time())

    def card(name: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": now, "owned_by": "vllm",
                "root": f"/models/{name}" if parent else "/models/base", "parent": parent, "max_model_len": 4096,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                                "created": now, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}
    return json.dumps({"object": "list", "data": [card("base", None)] + [card(a, "base") for a in adapters]}).encode()


def serve_instances(n: int, adapters: int, per: int, ports, ready) -> None:
    """The child: ``n`` fake instances, their ports sent back through ``ports``."""
    step = max(1, (adapters - per) // max(1, n - 1))

    async def main() -> None:
        servers = []
        for i in range(n):
            start = (i * step) % max(1, adapters - per + 1)
            names = [f"adapter-{k}" for k in range(start, start + per)]

            async def handle(reader, writer, names=names):
                try:
                    while True:
                        head = await reader.readuntil(b"\r\n\r\n")
                        path = head.split(b" ", 2)[1]
                        body = models_body(names) if path == b"/v1/models" else b""
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\n\r\n" % len(body) + body)
                        await writer.drain()
                except (asyncio.IncompleteReadError, ConnectionError):
                    writer.close()

            servers.append(await asyncio.start_server(handle, "127.0.0.1", 0))
        ports.send([s.sockets[0].getsockname()[1] for s in servers])
        await asyncio.Event().wait()

    asyncio.run(main())


async def measure(args) -> dict:
    from epd_proxy import ProxyConfig, start_proxy
    from epd_proxy.config import InstanceSpec

    parent_end, child_end = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(target=serve_instances, args=(args.instances, args.adapters,
                                                                  args.per_instance, child_end, None), daemon=True)
    child.start()
    ports = parent_end.recv()
    out: dict = {"instances": args.instances, "adapters": args.adapters, "per_instance": args.per_instance}
    try:
        specs = [InstanceSpec(f"http://127.0.0.1:{p}", "decode") for p in ports]
        config = ProxyConfig(decode=specs, probe_interval=0, scrape_interval=0, access_log=False)
        gc.collect()
        tracemalloc.start()
        async with await start_proxy(config) as proxy:
            pools = proxy.app.pools
            gc.collect()
            out["before"] = {"heap_mib": tracemalloc.get_traced_memory()[0] / 2**20, "rss_mib": rss_mib()}
            for pool in pools.values():
                pool.start_probing(args.probe_s, 10.0)
            t0 = time.perf_counter()
            while not all(i.served is not None for p in pools.values() for i in p.instances):
                await asyncio.sleep(0.1)
            out["learn_s"] = round(time.perf_counter() - t0, 2)
            gc.collect()
            out["known"] = {"heap_mib": tracemalloc.get_traced_memory()[0] / 2**20, "rss_mib": rss_mib(),
                            "catalog_ids": len(proxy.app.pipeline.models.current.parents)}
            for k in range(args.rounds):
                await asyncio.sleep(args.round_s)
                gc.collect()
                out[f"round{k + 1}"] = {"heap_mib": tracemalloc.get_traced_memory()[0] / 2**20,
                                        "rss_mib": rss_mib()}
            snap = tracemalloc.take_snapshot()
            out["top"] = [f"{s.traceback[0].filename.rsplit('/src/', 1)[-1]}:{s.traceback[0].lineno} "
                          f"{s.size / 2**20:.1f} MiB" for s in snap.statistics("lineno")[:6]]
            metrics = proxy.app.metrics
            before = tracemalloc.get_traced_memory()[0]
            for k in range(100_000):
                metrics.observe_request("/v1/chat/completions", 200, 0.01, False, metrics.model(f"lora-{k}"))
            gc.collect()
            out["labels"] = {"series": len(metrics.models) + 2,
                             "heap_kib": round((tracemalloc.get_traced_memory()[0] - before) / 1024, 1)}
        tracemalloc.stop()
    finally:
        child.terminate()
        child.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=300)
    p.add_argument("--adapters", type=int, default=2000, help="distinct adapters in the cluster")
    p.add_argument("--per-instance", type=int, default=200, help="adapters each instance serves")
    p.add_argument("--rounds", type=int, default=3, help="measurements after the first, --round-s apart")
    p.add_argument("--round-s", type=float, default=3.0)
    p.add_argument("--probe-s", type=float, default=1.0, help="the proxy's probe interval (each reads /v1/models)")
    args = p.parse_args()
    out = asyncio.run(measure(args))
    for key in ("before", "known", *(f"round{k + 1}" for k in range(args.rounds))):
        print(f"{key:>7}: heap {out[key]['heap_mib']:7.1f} MiB   RSS {out[key]['rss_mib']:7.1f} MiB")
    print(f"learnt in {out['learn_s']} s; catalog ids {out['known']['catalog_ids']}")
    print("largest allocations:", *out["top"], sep="\n  ")
    print(f"per-model labels after 100,000 names: {out['labels']['series']} series, "
          f"{out['labels']['heap_kib']} KiB")
    print(json.dumps({k: v for k, v in out.items() if k != "top"}))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
