"""One cell of the cluster scenario: a policy at a load level on a fresh cluster, with the
workload's dimensions (proxy replicas, a second client population straight to the instances,
a prefill restarted mid-run, the caches' size)."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass, replace

from epd_proxy.bench import targets as T
from epd_proxy.bench.conversations import ChatSpec, make_conversations
from epd_proxy.bench.lab import ForeignMeter, Lab, lab_settings
from epd_proxy.bench.procs import self_cpu_seconds
from epd_proxy.bench.scenarios.cluster.drive import (
    DirectClient,
    OracleClient,
    ProxyClient,
    drive,
    instance_states,
    proxy_kv_metrics,
    sim_post,
)
from epd_proxy.bench.scenarios.cluster.evaluate import cluster_counters
from epd_proxy.bench.scenarios.cluster.policies import PolicySpec

perf = time.perf_counter

WORKLOADS = ("chat", "text", "unique")


@dataclass(frozen=True)
class CellLoad:
    """What a cell adds to its policy's traffic: a second client population of its own
    conversations sent straight to the instances (``direct``: its share of the proxy's
    conversations and rate), a prefill instance restarted when half the conversations have
    started (``restart_down_s``: how long it is down; None: none), the clients' retries of a
    failed turn (``client_retries``, as the OpenAI SDK retries a reset connection or a 5xx), the
    prefix caches' size (``cache_ratio``; None: ``--cluster-cache-ratio``) and whether the
    instances publish KV events (``kv_events``; on whenever the policy subscribes)."""

    direct: float = 0.0
    restart_down_s: float | None = None
    client_retries: int = 0
    cache_ratio: float | None = None
    kv_events: bool = False


def chat_spec(args, workload: str) -> ChatSpec:
    base = ChatSpec(conversations=args.cluster_conversations, turns=args.cluster_turns,
                    system_prompts=args.cluster_system_prompts, system_words=args.cluster_system_words,
                    user_words=args.cluster_user_words, max_tokens=args.cluster_max_tokens,
                    image_share=args.cluster_image_share, image_pool=args.cluster_image_pool,
                    image_kb=args.cluster_image_kb, think_s=args.cluster_think_s, model=args.model, seed=args.seed)
    if workload == "chat":
        return base
    if workload == "text":
        return base.text_only()
    if workload == "unique":
        return replace(base.text_only(), turns=1, system_prompts=0, think_s=0.0)
    raise ValueError(f"unknown cluster workload {workload!r} (known: {', '.join(WORKLOADS)})")


def sim_settings(args, ws: dict, cache_ratio: float | None = None) -> tuple[dict, dict, dict]:
    """(counts, SimConfig fields, per-role overrides) of the cluster, its caches sized to
    ``cache_ratio`` (default ``--cluster-cache-ratio``) of the working set ``ws`` (encoders:
    ``--cluster-encoder-cache-ratio`` of the distinct images' tokens, by default the same share)."""
    ratio = args.cluster_cache_ratio if cache_ratio is None else cache_ratio
    enc_ratio = ratio if args.cluster_encoder_cache_ratio is None else args.cluster_encoder_cache_ratio
    counts = {"encode": args.cluster_encoders, "prefill": args.cluster_prefills, "decode": args.cluster_decoders}
    sim = {"itl_ms": args.itl_ms, "ttft_ms": args.ttft_ms, "ttft_per_token_ms": args.cluster_ttft_per_token_ms,
           "encode_ms_per_item": args.encode_ms, "encode_ms_per_mm_token": args.cluster_encode_ms_per_mm_token,
           "block_size": args.cluster_block_size,
           "prefix_cache_blocks": max(1, int(ratio * ws["blocks"])),
           "encoder_cache_tokens": max(1, int(enc_ratio * ws["image_tokens"])) if ws["image_tokens"] else 16384}
    roles = {"prefill": {"max_num_seqs": args.cluster_prefill_seqs}}
    return counts, sim, roles


async def _start_policy(lab, policy: PolicySpec, sim: T.SimInfo, settings, replicas: int = 1):
    """(client, services) for ``policy`` in front of the lab's cluster, or (None, note)."""
    if policy.kind == "oracle":
        return OracleClient(sim), []
    tl = []
    for r in range(replicas):  # replicas of vllm-router too: each its own process, as a Service spreads them
        if policy.kind == "vllm-router":
            name = "vllm-router-" + policy.args[0] + (f"-{r}" if replicas > 1 else "")
            t = lab.add(T.vllm_router_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir,
                                             policy=policy.args[0], name=name))
        else:
            name = f"epd-proxy-{policy.name}" + (f"-{r}" if replicas > 1 else "")
            t = lab.add(T.epd_proxy_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir, name=name,
                                           extra=list(policy.args), kv_events=policy.kv_events))
        if not t.available:
            return None, t.note
        tl.append(t)
    return ProxyClient([t.url for t in tl]), [t.service for t in tl]


async def run_cell(args, workload: str, spec: ChatSpec, convs, images, ws: dict, policy: PolicySpec,
                   rate: float, *, replicas: int = 1, restart: bool = False, load: CellLoad | None = None) -> dict:
    """One policy at one load level on a fresh cluster: latency, the instances' counters,
    proxy CPU per request. With ``replicas`` > 1 the turns alternate between proxies (vllm-router
    processes) and, with ``restart``, the second is restarted once half the conversations have
    started. ``load`` adds a direct population, a prefill's restart, client retries."""
    load = load or CellLoad()
    counts, simcfg, roles = sim_settings(args, ws, load.cache_ratio)
    if load.kv_events or policy.kv_events:
        simcfg["kv_events"] = True
    settings = lab_settings(args, counts=counts, sim=simcfg, roles=roles)
    label = f"cluster {workload} {policy.name} @ {rate:g} req/s" + (f" ({replicas} replicas)" if replicas > 1 else "")
    res: dict = {"policy": policy.name, "rate": rate, "replicas": replicas if policy.kind != "oracle" else 1}
    if policy.kind == "oracle":
        replicas = 1
    direct_spec = replace(spec, seed=spec.seed + 1, conversations=round(load.direct * spec.conversations))
    direct_convs = make_conversations(direct_spec) if load.direct > 0 else []
    with Lab(settings) as lab:
        lab.pin_self()
        sim = lab.start_sim()
        client, services = await _start_policy(lab, policy, sim, settings, replicas)
        if client is None:
            res.update({"available": False, "note": services})
            return res
        cpu_done = 0.0  # CPU of proxy processes already stopped (restart)
        restarts: list[dict] = []
        await client.start()
        try:
            if lab.s.quiet_wait > 0:
                await lab.wait_quiet()
            before = await instance_states(sim)
            meter = ForeignMeter(lab).start()
            cpu0 = sum(s.cpu_seconds() for s in services)
            assert lab.sim_service is not None  # started with the lab
            sim0, lg0 = lab.sim_service.cpu_seconds(), self_cpu_seconds()
            tasks: list[asyncio.Task] = []

            async def restart_second() -> None:
                nonlocal cpu_done
                svc = services[1]
                client.down.add(1)
                t0 = perf()
                while client.inflight[1]:
                    await asyncio.sleep(0.01)
                cpu_done += svc.cpu_seconds()
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, svc.stop)
                svc.start()
                await loop.run_in_executor(None, svc.wait_ready, 60.0)
                svc.repin()
                cpu_done -= svc.cpu_seconds()  # its start-up is not request work
                await client.reopen(1)
                client.down.discard(1)
                restarts.append({"proxy": 1, "down_s": perf() - t0})

            async def restart_prefill() -> None:
                # vLLM's restart as the simulator does it: the next request it receives crashes it (every
                # connection reset, its caches emptied, its KV events' sequence from 0), back after the delay.
                await sim_post(sim.prefill[0], "/sim/fault", {"spec": f"crash={load.restart_down_s:g}", "times": 1})
                restarts.append({"instance": sim.prefill[0], "down_s": load.restart_down_s, "t": perf() - t_run})

            def on_start(i: int) -> None:
                if restart and replicas > 1 and i == len(convs) // 2:
                    tasks.append(asyncio.get_running_loop().create_task(restart_second()))
                if load.restart_down_s is not None and i == len(convs) // 2:
                    tasks.append(asyncio.get_running_loop().create_task(restart_prefill()))

            t_run = perf()
            verify = args.verify != "off"
            direct: DirectClient | None = None
            runs = [drive(spec, convs, images, rate, client, seed=args.seed, verify=verify, on_start=on_start,
                          retries=load.client_retries)]
            if direct_convs:
                direct = DirectClient(sim)
                await direct.start()
                runs.append(drive(direct_spec, direct_convs, images, rate * load.direct, direct, seed=args.seed + 1,
                                  verify=verify, retries=load.client_retries))
            try:
                tallies = await asyncio.gather(*runs)
            finally:
                if direct is not None:
                    await direct.close()
            tally = tallies[0]
            for t in tasks:
                await t
            wall = perf() - t_run
            cpu1 = sum(s.cpu_seconds() for s in services) + cpu_done
            sim1, lg1 = lab.sim_service.cpu_seconds(), self_cpu_seconds()
            foreign = meter.stop()
            after = await instance_states(sim)
            kv_metrics = await proxy_kv_metrics(client.urls) if policy.kind == "proxy" else {}
        finally:
            await client.close()
    res.update(tally.summary())
    if direct_convs:  # the second population: its own requests (its tokens are in the instances' counters)
        d = tallies[1].summary()
        res["direct"] = {k: d[k] for k in ("requests", "ok", "errors", "verify_errors", "unsent_turns", "retried")}
        res["direct"]["ttft_ms"] = d["ttft_ms"]
    res["wall_s"] = wall
    # The load's side (simulator, load generator) and everything else on the machine meanwhile.
    res["sim_cpu_util"] = (sim1 - sim0) / wall if wall > 0 else math.nan
    res["loadgen_cpu_util"] = (lg1 - lg0) / wall if wall > 0 else math.nan
    res["foreign_cpu_util"] = foreign
    res["counters"] = cluster_counters(before, after)
    res["prefix_hit_rate"] = res["counters"]["prefix_hit_rate"]
    res["encoder_hit_rate"] = res["counters"]["encoder_hit_rate"]
    res["prefill_tokens_computed"] = res["counters"]["prefill_tokens_computed"]
    if services:
        res["proxy_cpu_s"] = cpu1 - cpu0
        res["proxy_cpu_ms_per_req"] = 1000.0 * (cpu1 - cpu0) / res["requests"] if res["requests"] else math.nan
    else:
        res["proxy_cpu_s"] = None
        res["proxy_cpu_ms_per_req"] = None
    if restarts:
        res["restarts"] = restarts
    res["load"] = load.__dict__.copy()
    if kv_metrics:
        res["proxy_kv_metrics"] = kv_metrics
    if replicas > 1:
        res["requests_per_proxy"] = list(client.sent)
    if args.progress:
        c = res["counters"]
        print(f"{label}: TTFT p50 {res['ttft_ms']['p50']:.1f} ms p99 {res['ttft_ms']['p99']:.1f} ms, prefix hits "
              f"{100 * c['prefix_hit_rate']:.1f} %, computed {c['prefill_tokens_computed']} tokens, prefill "
              f"requests {c['requests']['prefill']}, errors {res['errors']}", file=sys.stderr, flush=True)
    return res


async def measured_cell(args, workload, spec, convs, images, ws, policy, rate, **kw) -> dict:
    """:func:`run_cell`, again (up to ``--retries`` times) when other processes used more than
    ``--max-foreign`` cores meanwhile; a cell that fails is kept as its error."""
    tries = 0
    while True:
        try:
            cell = await run_cell(args, workload, spec, convs, images, ws, policy, rate, **kw)
        except Exception as exc:  # keep the other cells
            cell = {"policy": policy.name, "rate": rate, "error": f"{type(exc).__name__}: {exc}"}
            print(f"bench: cluster {workload} {policy.name} @ {rate:g}: {cell['error']}", file=sys.stderr)
            return cell
        f = cell.get("foreign_cpu_util", 0.0)
        if f is None or math.isnan(f) or f <= getattr(args, "max_foreign", math.inf) or tries >= args.retries:
            cell["retries"] = tries
            return cell
        tries += 1
        print(f"bench: cluster {workload} {policy.name} @ {rate:g}: other processes used {f:.2f} cores; "
              f"measuring again ({tries}/{args.retries})", file=sys.stderr)
