"""The cluster scenario's KV events comparison: today's approximate ``cache-aware``, the exact
index (``exact``: the instances publish vLLM's KV events, the proxy subscribes), vllm-router's
``cache_aware`` and the oracle, side by side on the workloads where approximation fails
(:mod:`~epd_proxy.bench.scenarios.cluster.kv_cases`), at one load level, each cell on a fresh
cluster that publishes KV events whichever policy routes (so every policy faces the same
instances)."""

from __future__ import annotations

import sys

from epd_proxy.bench.conversations import image_pool, make_conversations, working_set
from epd_proxy.bench.scenarios.base import csv_list
from epd_proxy.bench.scenarios.cluster import kv_evaluate
from epd_proxy.bench.scenarios.cluster.cell import CellLoad, chat_spec, measured_cell, sim_settings
from epd_proxy.bench.scenarios.cluster.kv_cases import DEFAULT_KV_CASES, oracle_cases, parse_cases
from epd_proxy.bench.scenarios.cluster.policies import parse_policies

DEFAULT_KV_POLICIES = ("cache-aware", "exact", "vllm-router:cache_aware", "oracle")


def add_arguments(group) -> None:
    group.add_argument("--cluster-kv-cases", type=csv_list, default=[],
                       help="cluster: the KV events comparison's workloads ('default' = "
                            f"{','.join(DEFAULT_KV_CASES)}): + joins evict|roomy, rN (N proxy replicas, turns "
                            "alternating), direct[S] (a second client population straight to the instances), "
                            "restart (a prefill restarted mid-run); none: not run")
    group.add_argument("--cluster-kv-policies", type=csv_list, default=list(DEFAULT_KV_POLICIES),
                       help="cluster: the KV comparison's policies (exact: cache-aware on the KV events' index)")
    group.add_argument("--cluster-kv-rate", type=float, default=None,
                       help="cluster: the KV comparison's load, requests/s (default: the top of --cluster-rates)")
    group.add_argument("--cluster-kv-workload", default="text", choices=("text", "chat"),
                       help="cluster: the KV comparison's conversations (text: what vllm-router can serve)")
    group.add_argument("--cluster-roomy-ratio", type=float, default=1.0,
                       help="cluster: each prefill's cache in the roomy cases, as a share of the working set "
                            "(1: no evictions)")
    group.add_argument("--cluster-direct-share", type=float, default=0.3,
                       help="cluster: the second population of a 'direct' case: this share of the proxy's "
                            "conversations, at this share of its rate, added")
    group.add_argument("--cluster-restart-down-s", type=float, default=1.0,
                       help="cluster: how long the prefill of a 'restart' case is down")
    group.add_argument("--cluster-client-retries", type=int, default=2,
                       help="cluster: in 'restart' cases the clients send a failed turn again up to this many times "
                            "(as the OpenAI SDK does)")


async def run_kv(args) -> dict | None:
    """Every case × policy; None when no case is asked for."""
    names = list(DEFAULT_KV_CASES) if args.cluster_kv_cases == ["default"] else args.cluster_kv_cases
    if not names:
        return None
    cases = parse_cases(names, args.cluster_direct_share)
    policies = parse_policies(args.cluster_kv_policies, args.policy_def)
    oracle_of = oracle_cases(cases)
    rate = args.cluster_kv_rate or max(args.cluster_rates)
    workload = args.cluster_kv_workload
    spec = chat_spec(args, workload)
    convs, images = make_conversations(spec), image_pool(spec)
    ws = working_set(spec, convs, images, args.cluster_block_size)
    names_of = {p.kind: p.name for p in reversed(policies)}
    kv: dict = {"rate": rate, "workload": workload, "policies": [p.name for p in policies],
                "exact": next((p.name for p in policies if p.kv_events), "exact"),
                "today": next((p.name for p in policies if p.name == "cache-aware"), None),
                "router": names_of.get("vllm-router"), "working_set": ws,
                "spec": spec.__dict__.copy(), "cases": {}}
    print(f"bench: cluster KV comparison: {len(cases)} cases x {len(policies)} policies at {rate:g} req/s, "
          f"{spec.conversations} conversations", file=sys.stderr, flush=True)
    for k, case in enumerate(cases):
        ratio = args.cluster_cache_ratio if case.evictions else args.cluster_roomy_ratio
        _, simcfg, _ = sim_settings(args, ws, ratio)
        entry: dict = {"case": case.__dict__.copy(), "oracle_of": oracle_of[case.name], "cache_ratio": ratio,
                       "prefix_cache_blocks_per_instance": simcfg["prefix_cache_blocks"], "cells": {}}
        kv["cases"][case.name] = entry
        load = CellLoad(direct=case.direct, restart_down_s=args.cluster_restart_down_s if case.restart else None,
                        client_retries=args.cluster_client_retries if case.restart else 0, cache_ratio=ratio,
                        kv_events=True)
        order = policies[k % len(policies):] + policies[:k % len(policies)]
        for policy in order:
            if policy.kind == "oracle" and oracle_of[case.name] != case.name:
                continue  # the oracle has no replicas: its cell is an earlier case's
            if policy.text_only and spec.image_share > 0:
                continue
            entry["cells"][policy.name] = await measured_cell(args, workload, spec, convs, images, ws, policy, rate,
                                                              replicas=case.replicas, load=load)
    kv["targets"] = kv_evaluate.targets(kv)
    return kv
