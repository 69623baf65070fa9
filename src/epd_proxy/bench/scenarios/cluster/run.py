"""The cluster scenario: its flags, one cell (a policy at a load level on a fresh cluster), and the
matrix of workloads, load levels and policies."""

from __future__ import annotations

import argparse
import math
import sys

from epd_proxy.bench.conversations import image_pool, make_conversations, working_set
from epd_proxy.bench.scenarios.base import Scenario, csv_list, float_list
from epd_proxy.bench.scenarios.cluster import kv_matrix
from epd_proxy.bench.scenarios.cluster.cell import WORKLOADS, chat_spec, measured_cell, run_cell, sim_settings
from epd_proxy.bench.scenarios.cluster.evaluate import checks, evaluate_targets, merge_repeats, policy_cells
from epd_proxy.bench.scenarios.cluster.policies import candidate_policy, parse_policies
from epd_proxy.bench.scenarios.cluster.section import plot, section

__all__ = ["SCENARIO", "WORKLOADS", "add_arguments", "chat_spec", "run", "run_cell", "sim_settings"]

DEFAULT_CLUSTER_POLICIES = ("round-robin", "least-loaded", "load-aware", "power-of-two", "cache-aware", "oracle",
                            "vllm-router:cache_aware", "vllm-router:power_of_two", "vllm-router:consistent_hash")


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
    kv_matrix.add_arguments(group)


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
                    cell = await measured_cell(args, workload, spec, convs, images, ws, policy, rate)
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
            single = await measured_cell(args, "chat", spec, convs, images, ws, cand, rate)
        else:  # the matrix's cell: what the comparison needs, not a second copy of its counts
            single = {k: single[k] for k in ("prefix_hit_rate", "ttft_ms", "errors", "requests", "error")
                      if k in single}
            single["same_as"] = f"chat / {cand.name} / {rate:g} req/s"
        rep = await measured_cell(args, "chat", spec, convs, images, ws, cand, rate, replicas=2, restart=True)
        out["replicas"] = {"policy": cand.name, "rate": rate, "single": single, "replicas": rep}
    # The matrix's targets when it ran (--cluster-workloads '' runs only the KV comparison).
    out["targets"] = evaluate_targets(out, cand.name if cand else None) if out["workloads"] else []
    kv = await kv_matrix.run_kv(args)
    if kv is not None:
        out["kv"] = kv
        out["targets"] += kv["targets"]
    return out


SCENARIO = Scenario("cluster", run=run, section=section, add_arguments=add_arguments, plot=plot, checks=checks,
                    group="cluster scenario (routing policies on a simulated cluster with caches)")
