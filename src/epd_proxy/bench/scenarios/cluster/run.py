"""The cluster scenario: its flags, one cell (a policy at a load level on a fresh cluster), and the
matrix of workloads, load levels and policies."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import replace

from epd_proxy.bench import targets as T
from epd_proxy.bench.conversations import ChatSpec, image_pool, make_conversations, working_set
from epd_proxy.bench.lab import ForeignMeter, Lab, lab_settings
from epd_proxy.bench.procs import self_cpu_seconds
from epd_proxy.bench.scenarios.base import Scenario, csv_list, float_list
from epd_proxy.bench.scenarios.cluster.drive import OracleClient, ProxyClient, drive, instance_states
from epd_proxy.bench.scenarios.cluster.evaluate import (
    checks,
    cluster_counters,
    evaluate_targets,
    merge_repeats,
    policy_cells,
)
from epd_proxy.bench.scenarios.cluster.policies import PolicySpec, candidate_policy, parse_policies
from epd_proxy.bench.scenarios.cluster.section import plot, section

perf = time.perf_counter


DEFAULT_CLUSTER_POLICIES = ("round-robin", "least-loaded", "load-aware", "power-of-two", "cache-aware", "oracle",
                            "vllm-router:cache_aware", "vllm-router:power_of_two", "vllm-router:consistent_hash")


WORKLOADS = ("chat", "text", "unique")


def add_arguments(group) -> None:
    group.add_argument("--policies", type=csv_list, default=list(DEFAULT_CLUSTER_POLICIES),
                       help="cluster: policies to compare: the proxy's round-robin, least-loaded, load-aware, "
                            "power-of-two, cache-aware; oracle (each conversation pinned to one instance per role, no "
                            "proxy); vllm-router:POLICY (text workloads only); or a name given with --policy-def")
    group.add_argument("--policy-def", action="append", default=[], metavar="NAME=ARGS",
                       help="cluster: a proxy policy: NAME runs epd-proxy serve with ARGS added (e.g. "
                            "prefix='--prefill-policy prefix'); repeatable")
    group.add_argument("--cluster-candidate", default=None, metavar="NAME",
                       help="cluster: the proxy policy the targets are checked for (default: the last proxy policy "
                            "listed that is not round-robin or least-loaded, else least-loaded)")
    group.add_argument("--cluster-workloads", type=csv_list, default=["chat", "text", "unique"],
                       help="cluster: chat (multi-turn, shared system prompts, repeated images: E+P+D), text (the same "
                            "without images: P/D, where vllm-router runs), unique (one turn, no shared prefix: spread)")
    group.add_argument("--cluster-rates", type=float_list, default=[10.0, 25.0, 50.0],
                       help="cluster: offered load levels, requests per second (conversations start as Poisson "
                            "arrivals at rate / turns)")
    group.add_argument("--cluster-repeat", type=int, default=1,
                       help="cluster: run every cell this many times, each on a fresh cluster, and compare the "
                            "median of its latency quantiles (hit rates pooled, the worst spread)")
    group.add_argument("--cluster-unique-rate", type=float, default=None,
                       help="cluster: load of the unique workload (default: the middle of --cluster-rates)")
    group.add_argument("--cluster-encoders", type=int, default=2)
    group.add_argument("--cluster-prefills", type=int, default=3)
    group.add_argument("--cluster-decoders", type=int, default=4)
    group.add_argument("--cluster-cache-ratio", type=float, default=0.15,
                       help="cluster: each prefill's prefix-cache capacity as a share of the workload's working set "
                            "(distinct blocks)")
    group.add_argument("--cluster-encoder-cache-ratio", type=float, default=None,
                       help="cluster: each encoder's cache as a share of the distinct images' tokens (default: "
                            "--cluster-cache-ratio)")
    group.add_argument("--cluster-block-size", type=int, default=16)
    group.add_argument("--cluster-ttft-per-token-ms", type=float, default=0.1,
                       help="cluster: prefill time per prompt token not in the prefix cache (plus --ttft-ms)")
    group.add_argument("--cluster-encode-ms-per-mm-token", type=float, default=0.05,
                       help="cluster: encoder time per placeholder token of an item missing from its cache")
    group.add_argument("--cluster-prefill-seqs", type=int, default=1,
                       help="cluster: prefills one instance computes at once (max_num_seqs): the rest queue, so "
                            "computed tokens cost time under load")
    group.add_argument("--cluster-conversations", type=int, default=120)
    group.add_argument("--cluster-turns", type=int, default=4)
    group.add_argument("--cluster-system-prompts", type=int, default=3, help="cluster: shared system prompts")
    group.add_argument("--cluster-system-words", type=int, default=300)
    group.add_argument("--cluster-user-words", type=int, default=40)
    group.add_argument("--cluster-max-tokens", type=int, default=48)
    group.add_argument("--cluster-image-share", type=float, default=0.25, help="cluster: share of turns with an image")
    group.add_argument("--cluster-image-pool", type=int, default=24, help="cluster: distinct images (they repeat)")
    group.add_argument("--cluster-image-kb", type=float, default=32.0)
    group.add_argument("--cluster-think-s", type=float, default=1.0,
                       help="cluster: mean think time between an answer and the conversation's next turn")
    group.add_argument("--cluster-replicas", action=argparse.BooleanOptionalAction, default=True,
                       help="cluster: also run the candidate policy as two proxies, turns alternating between them, "
                            "one restarted mid-run")


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


def sim_settings(args, ws: dict) -> tuple[dict, dict, dict]:
    """(counts, SimConfig fields, per-role overrides) of the cluster, its caches sized to
    ``--cluster-cache-ratio`` of the working set ``ws`` (encoders: ``--cluster-encoder-cache-ratio``
    of the distinct images' tokens, by default the same share)."""
    ratio = args.cluster_cache_ratio
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
    if policy.kind == "vllm-router":
        t = lab.add(T.vllm_router_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir,
                                         policy=policy.args[0], name="vllm-router-" + policy.args[0]))
        if not t.available:
            return None, t.note
        return ProxyClient([t.url]), [t.service]
    tl = []
    for r in range(replicas):
        name = f"epd-proxy-{policy.name}" + (f"-{r}" if replicas > 1 else "")
        t = lab.add(T.epd_proxy_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir, name=name,
                                       extra=list(policy.args)))
        if not t.available:
            return None, t.note
        tl.append(t)
    return ProxyClient([t.url for t in tl]), [t.service for t in tl]


async def run_cell(args, workload: str, spec: ChatSpec, convs, images, ws: dict, policy: PolicySpec,
                   rate: float, *, replicas: int = 1, restart: bool = False) -> dict:
    """One policy at one load level on a fresh cluster: latency, the instances' counters,
    proxy CPU per request. With ``replicas`` > 1 the turns alternate between proxies and,
    with ``restart``, the second is restarted once half the conversations have started."""
    counts, simcfg, roles = sim_settings(args, ws)
    settings = lab_settings(args, counts=counts, sim=simcfg, roles=roles)
    label = f"cluster {workload} {policy.name} @ {rate:g} req/s" + (f" ({replicas} replicas)" if replicas > 1 else "")
    res: dict = {"policy": policy.name, "rate": rate, "replicas": replicas}
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

            def on_start(i: int) -> None:
                if restart and replicas > 1 and i == len(convs) // 2:
                    tasks.append(asyncio.get_running_loop().create_task(restart_second()))

            t_run = perf()
            tally = await drive(spec, convs, images, rate, client, seed=args.seed, verify=args.verify != "off",
                                on_start=on_start)
            for t in tasks:
                await t
            wall = perf() - t_run
            cpu1 = sum(s.cpu_seconds() for s in services) + cpu_done
            sim1, lg1 = lab.sim_service.cpu_seconds(), self_cpu_seconds()
            foreign = meter.stop()
            after = await instance_states(sim)
        finally:
            await client.close()
    res.update(tally.summary())
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
    if replicas > 1:
        res["requests_per_proxy"] = list(client.sent)
    if args.progress:
        c = res["counters"]
        print(f"{label}: TTFT p50 {res['ttft_ms']['p50']:.1f} ms p99 {res['ttft_ms']['p99']:.1f} ms, prefix hits "
              f"{100 * c['prefix_hit_rate']:.1f} %, computed {c['prefill_tokens_computed']} tokens, prefill "
              f"requests {c['requests']['prefill']}, errors {res['errors']}", file=sys.stderr, flush=True)
    return res


async def _measured_cell(args, workload, spec, convs, images, ws, policy, rate, **kw) -> dict:
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


async def run(args) -> dict:
    policies = parse_policies(args.policies, args.policy_def)
    cand = candidate_policy(policies, args.cluster_candidate)
    rates = list(args.cluster_rates)
    out: dict = {"policies": [p.name for p in policies], "candidate": cand.name if cand else None,
                 "rates": rates, "counts": {"encode": args.cluster_encoders, "prefill": args.cluster_prefills,
                                            "decode": args.cluster_decoders},
                 "workloads": {}}
    partial = getattr(args, "partial", None)
    if isinstance(partial, dict):
        partial["result"] = out
    for workload in args.cluster_workloads:
        spec = chat_spec(args, workload)
        convs = make_conversations(spec)
        images = image_pool(spec)
        ws = working_set(spec, convs, images, args.cluster_block_size)
        counts, simcfg, roles = sim_settings(args, ws)
        w_rates = rates if workload != "unique" else [args.cluster_unique_rate or rates[len(rates) // 2]]
        w_pols = [p for p in policies if not (p.text_only and spec.image_share > 0)
                  and not (workload == "unique" and p.kind != "proxy")]
        w: dict = {"spec": spec.__dict__.copy(), "working_set": ws,
                   "prefix_cache_blocks_per_instance": simcfg["prefix_cache_blocks"],
                   "cache_ratio": simcfg["prefix_cache_blocks"] / ws["blocks"] if ws["blocks"] else math.nan,
                   "encoder_cache_tokens_per_instance": simcfg["encoder_cache_tokens"] if ws["image_tokens"] else None,
                   "sim": simcfg, "roles": roles, "rates": w_rates, "policies": {}}
        out["workloads"][workload] = w
        print(f"bench: cluster {workload}: {spec.conversations} conversations x {spec.turns} turns, working set "
              f"{ws['blocks']} blocks, {simcfg['prefix_cache_blocks']} per prefill instance "
              f"({100 * w['cache_ratio']:.0f} %)", file=sys.stderr, flush=True)
        repeat = max(1, getattr(args, "cluster_repeat", 1))
        for k, rate in enumerate(w_rates):
            runs: dict[str, list[dict]] = {}
            for r in range(repeat):  # each repeat in another order, so no policy always runs first
                n = k + r
                order = w_pols[n % len(w_pols):] + w_pols[:n % len(w_pols)] if w_pols else []
                for policy in order:
                    cell = await _measured_cell(args, workload, spec, convs, images, ws, policy, rate)
                    runs.setdefault(policy.name, []).append(cell)
            for name, cells in runs.items():
                w["policies"].setdefault(name, {"rates": {}})["rates"][str(rate)] = merge_repeats(cells)
    if args.cluster_replicas and "chat" in args.cluster_workloads and cand is not None:
        rate = rates[len(rates) // 2]
        spec = chat_spec(args, "chat")
        convs, images = make_conversations(spec), image_pool(spec)
        ws = out["workloads"]["chat"]["working_set"]
        single = policy_cells(out, "chat", cand.name).get(str(rate))
        if single is None:
            single = await _measured_cell(args, "chat", spec, convs, images, ws, cand, rate)
        else:  # the matrix's cell: what the comparison needs, not a second copy of its counts
            single = {k: single[k] for k in ("prefix_hit_rate", "ttft_ms", "errors", "requests", "error")
                      if k in single}
            single["same_as"] = f"chat / {cand.name} / {rate:g} req/s"
        rep = await _measured_cell(args, "chat", spec, convs, images, ws, cand, rate, replicas=2, restart=True)
        out["replicas"] = {"policy": cand.name, "rate": rate, "single": single, "replicas": rep}
    out["targets"] = evaluate_targets(out, cand.name if cand else None)
    return out


SCENARIO = Scenario("cluster", run=run, section=section, add_arguments=add_arguments, plot=plot, checks=checks,
                    group="cluster scenario (routing policies on a simulated cluster with caches)")
