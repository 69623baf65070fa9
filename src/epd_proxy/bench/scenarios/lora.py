"""lora: LoRA adapter placement on a simulated P/D cluster (2 prefills, 2 decodes, every
instance with the same adapters and ``--max-loras`` slots): requests for several adapters,
popular ones more often (Zipf), at a fixed rate, against ``epd-proxy`` with adapter affinity,
``epd-proxy`` with round-robin and no affinity (routing that ignores adapters), and
``vllm-router`` (round_robin, and cache_aware) when it is installed.

The simulator charges ``lora_swap_ms`` each time an instance swaps an adapter into one of its
slots (least recently used out), before that request's first token; its counters say how many
swaps each target caused. Each target gets a fresh simulator (empty slots).
"""

from __future__ import annotations

import json
import math
import random
import urllib.request

import msgspec

from epd_proxy.bench import targets as T
from epd_proxy.bench.lab import Lab, lab_settings
from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.scenarios.base import Limit, Scenario, csv_list, target_check
from epd_proxy.bench.workloads import CHAT_PATH, Prepared, prompt_text

TARGETS = ("affinity", "round-robin", "vllm-router", "vllm-router-cache")


def adapter_path(name: str) -> str:
    return f"/adapters/{name}"


def plan_adapters(n: int, adapters: int, *, zipf: float, seed: int = 0) -> list[str]:
    """``n`` adapter names, adapter ``k`` drawn with weight 1/(k+1)^zipf. Deterministic for a seed."""
    rng = random.Random(f"lora-mix:{seed}")
    names = [f"adapter-{k}" for k in range(adapters)]
    weights = [1.0 / (k + 1) ** zipf for k in range(adapters)]
    return rng.choices(names, weights, k=n)


def build_requests(plan: list[str], *, seed: int, max_tokens: int, verify: bool) -> list[Prepared]:
    from epd_proxy.sim import expected_text

    out = []
    for i, name in enumerate(plan):
        text = f"[{i}] " + prompt_text(200, random.Random(f"lora:{seed}:{i}"))
        body = {"model": name, "max_tokens": max_tokens, "stream": True,
                "messages": [{"role": "user", "content": text}]}
        out.append(Prepared(kind="stream", path=CHAT_PATH, body=msgspec.json.encode(body), stream=True,
                            expected=expected_text(body, lora_path=adapter_path(name)) if verify else None,
                            obj=body))
    return out


def add_arguments(group) -> None:
    group.add_argument("--lora-rate", type=float, default=20.0, help="lora: requests per second (Poisson)")
    group.add_argument("--lora-duration", type=float, default=15.0, help="lora: seconds of load per target")
    group.add_argument("--lora-adapters", type=int, default=8, help="lora: adapters (each on every instance)")
    group.add_argument("--lora-zipf", type=float, default=1.0, help="lora: popularity skew of the adapters")
    group.add_argument("--lora-slots", type=int, default=2, help="lora: each instance's --max-loras")
    group.add_argument("--lora-swap-ms", type=float, default=40.0,
                       help="lora: simulated time to swap an adapter into a slot")
    group.add_argument("--lora-targets", type=csv_list, default=list(TARGETS),
                       help="lora: targets (" + ", ".join(TARGETS) + ")")


def _swaps(urls: list[str]) -> list[int]:
    out = []
    for u in urls:
        with urllib.request.urlopen(u + "/sim/state", timeout=5) as r:
            out.append(json.loads(r.read())["lora"]["swaps"])
    return out


def _learned(url: str, adapters: int) -> bool:
    """Whether the proxy at ``url`` lists every adapter (it has read the instances' models)."""
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
            ids = {m["id"] for m in json.loads(r.read())["data"]}
    except OSError:
        return False
    return all(f"adapter-{k}" in ids for k in range(adapters))


async def _one(args, name: str, reqs: list[Prepared]) -> dict:
    import asyncio

    modules = [f"adapter-{k}={adapter_path(f'adapter-{k}')}" for k in range(args.lora_adapters)]
    settings = lab_settings(args, counts={"encode": 0, "prefill": 2, "decode": 2},
                            sim={"itl_ms": 1.0, "lora_modules": modules, "max_loras": args.lora_slots,
                                 "lora_swap_ms": args.lora_swap_ms})
    with Lab(settings) as lab:
        lab.pin_self()
        sim = lab.start_sim()
        if name.startswith("vllm-router"):
            policy = "cache_aware" if name == "vllm-router-cache" else "round_robin"
            target = lab.add(T.vllm_router_target(sim, cpus=settings.proxy_cpus, log_dir=args.log_dir,
                                                  policy=policy, name=name))
            if not target.available:
                return {"target": name, "skipped": target.note}
        else:
            extra = [] if name == "affinity" else ["--routing", "round-robin", "--no-lora-affinity"]
            target = lab.start_proxy(what=name, name=name, extra=extra)
            for _ in range(100):
                if _learned(target.url, args.lora_adapters):
                    break
                await asyncio.sleep(0.1)
        res = await lab.phase(target, reqs, rate=args.lora_rate, warmup=0.0, duration=args.lora_duration,
                              max_requests=None, verify=args.verify != "off", label=f"lora {name}",
                              progress=args.progress, seed=args.seed)
        swaps = _swaps(sim.prefill + sim.decode)
    return {"target": name, "requests": res["requests"], "errors": res["errors"],
            "verify_errors": res["verify_errors"] + res["outside_window"]["verify_errors"],
            "ttft_p50": res["ttft_ms"]["p50"], "ttft_p99": res["ttft_ms"]["p99"], "req_s": res["req_s"],
            "swaps": swaps, "swaps_total": sum(swaps)}


async def run(args) -> dict:
    n = int(math.ceil(args.lora_rate * args.lora_duration * 1.3)) + 20  # never cycles within the window
    plan = plan_adapters(n, args.lora_adapters, zipf=args.lora_zipf, seed=args.seed)
    reqs = build_requests(plan, seed=args.seed, max_tokens=8, verify=args.verify != "off")
    out: dict = {"rate": args.lora_rate, "duration": args.lora_duration, "adapters": args.lora_adapters,
                 "zipf": args.lora_zipf, "slots": args.lora_slots, "swap_ms": args.lora_swap_ms,
                 "results": [], "skipped": {}}
    for name in args.lora_targets:
        r = await _one(args, name, reqs)
        if "skipped" in r:
            out["skipped"][name] = r["skipped"]
        else:
            out["results"].append(r)
    return out


def section(r: dict, plots: dict) -> list[str]:
    out = ["## LoRA adapter placement", "",
           f"2 prefills + 2 decodes (simulated), each with the same {r['adapters']} adapters and "
           f"{r['slots']} adapter slots (`--max-loras`), {fmt(r['swap_ms'])} ms per swap into a slot; "
           f"{fmt(r['rate'])} req/s for {fmt(r['duration'])} s, adapters drawn Zipf({fmt(r['zipf'])}).", ""]
    rows = []
    for t in r.get("results", []):
        rows.append([t["target"], str(t["requests"]), str(t["swaps_total"]), " / ".join(map(str, t["swaps"])),
                     fmt(t["ttft_p50"], 1), fmt(t["ttft_p99"], 1), f"{t['errors']} / {t['verify_errors']}"])
    out += [table(["target", "requests", "adapter swaps", "per instance (P0 / P1 / D0 / D1)", "TTFT p50 ms",
                   "TTFT p99 ms", "errors / mismatches"], rows), ""]
    for name, why in r.get("skipped", {}).items():
        out.append(f"- {name}: not run: {why}")
    if r.get("skipped"):
        out.append("")
    return out


LIMITS = {"lora_swaps": Limit("adapter affinity: adapter swaps vs round-robin's", 0.5, "x", "<=")}


def checks(r: dict) -> list[dict]:
    by = {t["target"]: t for t in r.get("results", [])}
    aff, rr = by.get("affinity"), by.get("round-robin")
    if aff is None or rr is None or not rr["swaps_total"]:
        return []
    return [target_check("lora_swaps", LIMITS["lora_swaps"], aff["swaps_total"] / rr["swaps_total"], "lora",
                         f"{aff['swaps_total']} swaps against {rr['swaps_total']}")]


SCENARIO = Scenario("lora", run=run, section=section, add_arguments=add_arguments, checks=checks,
                    group="lora scenario")
