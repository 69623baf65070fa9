"""tenants: three keys on a saturated simulated cluster (a flood at ten times its share, an
interactive key, a batch key), today's first-come-first-served admission against the fair
queue with per-key limits; then replicas sharing one Redis store, each key held to its limit.

The proxy is saturated at its own admission limit (``--max-inflight``), where the fair queue
works: the simulator has room for more, so what is measured is the proxy's ordering.
vllm-router has no per-key limits or priorities and is not run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time

from epd_proxy.bench.exchange import Outcome, send
from epd_proxy.bench.lab import Lab, lab_settings, workload_requests
from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.scenarios.base import Limit, Scenario, target_check
from epd_proxy.bench.stats import summarize
from epd_proxy.bench.targets import free_port
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts

perf = time.perf_counter
KEYS = {"flood": "s-flood", "agent": "s-agent", "batch": "s-batch"}
TIMEOUTS = TransportTimeouts(connect=10, headers=60, idle=60)
TTFT_LIMIT = Limit("tenants: the interactive key's TTFT p99 beside a flood, against alone", 1.2, "x", "<=")
SHARE_LIMIT = Limit("tenants: a key's admitted rate through replicas sharing a store, off its limit", 10.0, "%", "<=")


def add_arguments(group) -> None:
    group.add_argument("--tenants-duration", type=float, default=10.0, help="tenants: seconds per cell")
    group.add_argument("--tenants-max-inflight", type=int, default=16, help="tenants: the proxy's --max-inflight")
    group.add_argument("--tenants-flood", type=int, default=40,
                       help="tenants: the flooding key's closed-loop concurrency (10x its share of the slots)")
    group.add_argument("--tenants-agent-rate", type=float, default=4.0,
                       help="tenants: the interactive key's open-loop rate, req/s")
    group.add_argument("--tenants-batch", type=int, default=4, help="tenants: the batch key's concurrency")
    group.add_argument("--tenants-tokens", type=int, default=16,
                       help="tenants: tokens per answer (few, slow ones: the load generator's own work stays small)")
    group.add_argument("--tenants-itl-ms", type=float, default=20.0, help="tenants: the simulator's token delay")
    group.add_argument("--tenants-replicas", type=int, default=3, help="tenants: replicas sharing one store")
    group.add_argument("--tenants-flood-limit", type=int, default=20,
                       help="tenants: the flooding key's requests per second in the fair cell")
    group.add_argument("--tenants-reserved", type=int, default=4,
                       help="tenants: the fair cell's reserved_slots (admission slots only the critical key takes)")
    group.add_argument("--tenants-limit", type=int, default=20,
                       help="tenants: the requests per second each replica's key is held to, shared")


def _files(log_dir: str, fair: bool, store: str | None = None, limit: int = 0, reserved: int = 0) -> list[str]:
    """The key file and cluster file of one cell; the flags that name them."""
    keys = os.path.join(log_dir, "tenants-keys")
    with open(keys, "w") as f:
        f.write("".join(f"{name}:{secret}\n" for name, secret in KEYS.items()))
    lines = []
    if fair:
        lines += ["[tenants]", f"reserved_slots = {reserved}"] + ([f'store = "{store}"'] if store else []) + [
            '[[tenants.keys]]', 'name = "agent"', 'class = "critical"',
            '[[tenants.keys]]', 'name = "flood"', 'class = "standard"',
            f"requests_per_second = {limit}" if limit else "",
            '[[tenants.keys]]', 'name = "batch"', 'class = "sheddable"']
    path = os.path.join(log_dir, f"tenants-{'fair' if fair else 'fifo'}{'-shared' if store else ''}.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return ["--api-key-file", keys, "--config", path]


async def _closed(url: str, reqs, secret: str, n: int, until: float, log: list) -> None:
    pool = ConnectionPool(url, idle_timeout=30.0, max_idle=n + 8)
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {secret}".encode())]

    async def worker(i: int) -> None:
        while perf() < until:
            o = await send(pool, reqs[i % len(reqs)], TIMEOUTS, headers=headers)
            log.append(o)
            if o.status == 429:
                await asyncio.sleep(0.5)  # as an SDK waits for Retry-After (1 s at most here)
    try:
        await asyncio.gather(*(worker(i) for i in range(n)))
    finally:
        await pool.close()


async def _open(urls: list[str], reqs, secret: str, rate: float, until: float, log: list) -> None:
    pools = [ConnectionPool(u, idle_timeout=30.0, max_idle=64) for u in urls]
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {secret}".encode())]
    tasks = []
    i = 0
    t0 = perf()
    try:
        while perf() < until:
            tasks.append(asyncio.ensure_future(send(pools[i % len(pools)], reqs[i % len(reqs)], TIMEOUTS,
                                                    headers=headers)))
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - perf()))
        log.extend(await asyncio.gather(*tasks))
    finally:
        for p in pools:
            await p.close()


async def _probe(url: str, reqs, until: float, out: dict) -> None:
    """During the load: what a flood request refused by its limit carries (the last one sent)."""
    pool = ConnectionPool(url)
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {KEYS['flood']}".encode())]
    try:
        await asyncio.sleep(0.5)
        while perf() < until and out.get("status") != 429:
            resp = await pool.request("POST", reqs[0].path, body=reqs[0].body, timeouts=TIMEOUTS, headers=headers)
            await resp.read()
            resp.close()
            out.update(status=resp.status, headers={k.decode(): v.decode() for k, v in resp.headers.items()
                                                    if k.startswith((b"x-ratelimit", b"retry-after"))})
            await asyncio.sleep(0.02)
    finally:
        await pool.close()


def _per_key(log: list[Outcome], seconds: float) -> dict:
    ok = [o for o in log if o.ok]
    return {"requests": len(log), "ok": len(ok), "shed_429": sum(1 for o in log if o.status == 429),
            "errors": sum(1 for o in log if not o.ok and o.status != 429), "ok_per_s": len(ok) / seconds,
            "ttft_ms": summarize([o.ttft for o in ok if o.ttft is not None], 1000)}


async def _cell(lab: Lab, args, name: str, flags: list[str], keys: tuple[str, ...]) -> dict:
    proxy = lab.start_proxy(name=f"epd-proxy-{name}", extra=["--max-inflight", str(args.tenants_max_inflight),
                                                             "--queue-size", "256", "--queue-timeout", "30"] + flags)
    reqs = workload_requests(args, "stream", max_tokens=args.tenants_tokens)
    logs: dict[str, list] = {k: [] for k in keys}
    until = perf() + args.tenants_duration
    jobs = []
    if "flood" in keys:
        jobs.append(_closed(proxy.url, reqs, KEYS["flood"], args.tenants_flood, until, logs["flood"]))
    if "batch" in keys:
        jobs.append(_closed(proxy.url, reqs, KEYS["batch"], args.tenants_batch, until, logs["batch"]))
    jobs.append(_open([proxy.url], reqs, KEYS["agent"], args.tenants_agent_rate, until, logs["agent"]))
    probe: dict = {}
    if "flood" in keys:
        jobs.append(_probe(proxy.url, reqs, until, probe))
    await asyncio.gather(*jobs)
    out = {k: _per_key(v, args.tenants_duration) for k, v in logs.items()}
    if "flood" in keys:
        out["flood_probe"] = probe
    assert proxy.service is not None
    proxy.service.stop()
    return out


async def _shared(lab: Lab, args) -> dict:
    """Replicas sharing one redis-server: the flooding key, held to ``--tenants-limit`` req/s,
    sent twice that through all of them."""
    exe = shutil.which("redis-server")
    if exe is None:
        return {"skipped": "redis-server is not installed"}
    port = free_port()
    redis = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        flags = _files(lab.s.log_dir, True, f"redis://127.0.0.1:{port}/0", args.tenants_limit)
        proxies = [lab.start_proxy(name=f"epd-proxy-replica{i}", pinned=False, extra=flags)
                   for i in range(args.tenants_replicas)]
        log: list[Outcome] = []
        reqs = workload_requests(args, "nonstream", max_tokens=4)
        await asyncio.sleep(1.05 - time.time() % 1)  # whole windows
        seconds = max(3.0, args.tenants_duration)
        await _open([p.url for p in proxies], reqs, KEYS["flood"], 2.0 * args.tenants_limit, perf() + seconds, log)
        for p in proxies:
            assert p.service is not None
            p.service.stop()
        ok = sum(1 for o in log if o.ok)
        rate = ok / seconds
        return {"replicas": len(proxies), "limit": args.tenants_limit, "sent_per_s": 2.0 * args.tenants_limit,
                "admitted_per_s": rate, "off_by_percent": abs(rate - args.tenants_limit) / args.tenants_limit * 100,
                "shed_429": sum(1 for o in log if o.status == 429),
                "errors": sum(1 for o in log if not o.ok and o.status != 429)}
    finally:
        redis.terminate()
        redis.wait(5)


async def run(args) -> dict:
    settings = lab_settings(args, counts={"encode": 0, "prefill": 0, "decode": 1},
                            sim={"max_num_seqs": 4096, "records": False, "itl_ms": args.tenants_itl_ms})
    out: dict = {"duration_s": args.tenants_duration, "max_inflight": args.tenants_max_inflight,
                 "reserved": args.tenants_reserved,
                 "flood": args.tenants_flood, "agent_rate": args.tenants_agent_rate, "batch": args.tenants_batch}
    with Lab(settings) as lab:
        lab.pin_self()
        lab.start_sim()
        out["alone"] = await _cell(lab, args, "alone", _files(lab.s.log_dir, True), ("agent",))
        out["fifo"] = await _cell(lab, args, "fifo", _files(lab.s.log_dir, False), ("flood", "agent", "batch"))
        out["fair"] = await _cell(lab, args, "fair", _files(lab.s.log_dir, True, limit=args.tenants_flood_limit,
                                                            reserved=args.tenants_reserved),
                                  ("flood", "agent", "batch"))
        out["shared"] = await _shared(lab, args)
    return out


def checks(r: dict) -> list[dict]:
    alone = r.get("alone", {}).get("agent", {}).get("ttft_ms", {}).get("p99")
    fair = r.get("fair", {}).get("agent", {}).get("ttft_ms", {}).get("p99")
    ratio = fair / alone if alone and fair else None
    shared = r.get("shared", {})
    return [target_check("tenants_ttft", TTFT_LIMIT, ratio, "tenants", f"{fmt(fair)} ms against {fmt(alone)} ms"),
            target_check("tenants_share", SHARE_LIMIT, shared.get("off_by_percent"), "tenants",
                         f"{fmt(shared.get('admitted_per_s'))} req/s admitted of {shared.get('limit')}")]


def section(r: dict, plots: dict) -> list[str]:
    out = ["## Tenants: a flood, an interactive key and a batch key at saturation", "",
           f"`--max-inflight {r['max_inflight']}`; the flooding key at concurrency {r['flood']}, the interactive "
           f"key open-loop at {fmt(r['agent_rate'])} req/s, the batch key at concurrency {r['batch']}, "
           f"{fmt(r['duration_s'], 0)} s per cell. *fifo*: client keys only (first come, first served); *fair*: "
           "the interactive key `critical`, the flood `standard` with a per-second limit, the batch key "
           f"`sheddable`, `reserved_slots = {r.get('reserved', 0)}`.", ""]
    rows = []
    for cell in ("alone", "fifo", "fair"):
        for key, k in r.get(cell, {}).items():
            if key == "flood_probe":
                continue
            t = k["ttft_ms"]
            rows.append([cell, key, str(k["requests"]), str(k["ok"]), str(k["shed_429"]), str(k["errors"]),
                         fmt(k["ok_per_s"]), fmt(t.get("p50")), fmt(t.get("p99"))])
    out += [table(["cell", "key", "requests", "ok", "429", "other errors", "ok/s", "TTFT p50 ms", "TTFT p99 ms"],
                  rows), ""]
    probe = r.get("fair", {}).get("flood_probe")
    if probe:
        out += [f"A flood request past its limit: {probe['status']}, " + ", ".join(
            f"`{k}: {v}`" for k, v in sorted(probe["headers"].items())) + ".", ""]
    s = r.get("shared", {})
    if "skipped" in s:
        out += [f"Shared store: skipped ({s['skipped']}).", ""]
    elif s:
        out += [f"Shared store: {s['replicas']} replicas, one key held to {s['limit']} req/s, sent "
                f"{fmt(s['sent_per_s'])} req/s over all of them: {fmt(s['admitted_per_s'])} req/s admitted "
                f"({fmt(s['off_by_percent'])} % off), {s['shed_429']} refused, {s['errors']} other errors.", ""]
    return out


SCENARIO = Scenario("tenants", run=run, section=section, add_arguments=add_arguments, checks=checks)
