"""encoders: encoder-pool scheduling on a simulated E+P+D cluster (3 encoders, 1 prefill,
1 decode): a mix of new and repeated images of several sizes at a fixed rate, against
``cache-aware`` (work-levelled placement, repeats on their home), ``round-robin`` (the
reference proxy's rotation), the previous cache-aware placement (an older revision's
``src``, extracted with ``git archive``) and, given ``--epd-proxy-script``, vLLM's
``disagg_epd_proxy.py``.

The simulator's encoder time for an item missing from its cache is ``encode_ms_per_item +
encode_ms_per_mm_token * tokens``, where ``tokens`` come from the image grid the simulator
derives from a crc of the payload, not from its byte size. So that an image's encoder cost
grows with its size, each image here is drawn until its simulated grid falls in its size
class's token range (:func:`image_for`). Each target gets a fresh simulator (empty caches).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass

from epd_proxy.bench import targets as T
from epd_proxy.bench.lab import Lab, lab_settings
from epd_proxy.bench.markdown import fmt, table
from epd_proxy.bench.procs import Service
from epd_proxy.bench.scenarios.base import Figures, Limit, Scenario, csv_list, target_check
from epd_proxy.bench.workloads import CHAT_PATH, Prepared, image_data_url, prompt_text, simulator_expected


@dataclass(frozen=True)
class SizeClass:
    """Images of ``kb`` KiB whose simulated encoder tokens lie in ``tokens`` (inclusive)."""

    name: str
    kb: float
    tokens: tuple[int, int]
    weight: float


# The simulator's grid is h x w with h, w in 4..32 (tokens = h*w/4: 4..256).
SIZE_CLASSES = (SizeClass("small", 24, (4, 49), 0.5), SizeClass("medium", 96, (64, 144), 0.3),
                SizeClass("large", 384, (169, 256), 0.2))

# The previous cache-aware placement: the parent of the commit that made it level by work.
PREVIOUS_REV = "7272984^"


def plan_mix(n: int, *, new_share: float, hot: int, classes=SIZE_CLASSES, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` requests as (image key, size class): a share ``new_share`` of images never seen
    before, the rest repeats drawn uniformly from ``hot`` fixed images. Classes by weight;
    a hot image keeps its class. Deterministic for a seed."""
    rng = random.Random(f"encoders-mix:{seed}")
    names = [c.name for c in classes]
    weights = [c.weight for c in classes]
    hot_set = [(f"hot{i}", rng.choices(names, weights)[0]) for i in range(max(hot, 1))]
    out: list[tuple[str, str]] = []
    fresh = 0
    for _ in range(n):
        if hot <= 0 or rng.random() < new_share:
            out.append((f"new{fresh}", rng.choices(names, weights)[0]))
            fresh += 1
        else:
            out.append(rng.choice(hot_set))
    return out


def spread(work: list[float]) -> float:
    """max/min of the encoders' work (1 = level; inf when one did none while another did some)."""
    if not work:
        return math.nan
    lo, hi = min(work), max(work)
    if hi <= 0:
        return 1.0
    return hi / lo if lo > 0 else math.inf


def image_for(key: str, cls: SizeClass, seed: int = 0, tries: int = 400) -> str:
    """A ``data:`` URL of ``cls.kb`` KiB for ``key`` whose simulated grid falls in the class's
    token range (the first of up to ``tries`` draws that does, else the last)."""
    from epd_proxy.sim.tokens import media_metadata, media_tokens

    rng = random.Random(f"encoders-image:{seed}:{key}")
    url = ""
    for _ in range(tries):
        url = image_data_url(cls.kb, rng)
        tokens = media_tokens("image", media_metadata({"type": "image_url", "image_url": {"url": url}}))
        if cls.tokens[0] <= tokens <= cls.tokens[1]:
            break
    return url


def build_requests(plan: list[tuple[str, str]], *, seed: int, max_tokens: int, model: str,
                   verify: bool) -> list[Prepared]:
    import msgspec

    classes = {c.name: c for c in SIZE_CLASSES}
    urls: dict[str, str] = {}
    expected = simulator_expected() if verify else None
    out = []
    for i, (key, cname) in enumerate(plan):
        if key not in urls:
            urls[key] = image_for(key, classes[cname], seed)
        text = f"[{i}] " + prompt_text(120, random.Random(f"{seed}:{i}"))
        body = {"model": model, "max_tokens": max_tokens, "stream": True,
                "messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                          {"type": "image_url", "image_url": {"url": urls[key]}}]}]}
        out.append(Prepared(kind="mm", path=CHAT_PATH, body=msgspec.json.encode(body), stream=True,
                            expected=expected(body) if expected else None, obj=body))
    return out


def add_arguments(group) -> None:
    group.add_argument("--enc-rate", type=float, default=8.0, help="encoders: requests per second (Poisson)")
    group.add_argument("--enc-duration", type=float, default=15.0, help="encoders: seconds of load per target")
    group.add_argument("--enc-new-share", type=float, default=0.6, help="encoders: share of never-seen images")
    group.add_argument("--enc-hot", type=int, default=6, help="encoders: images in the repeated hot set")
    group.add_argument("--enc-ms-per-token", type=float, default=0.5,
                       help="encoders: simulated encoder ms per placeholder token (plus --encode-ms per item)")
    group.add_argument("--enc-cache-tokens", type=int, default=4096, help="encoders: each encoder's cache (tokens)")
    group.add_argument("--enc-targets", type=csv_list, default=["cache-aware", "round-robin", "previous", "vllm-epd"],
                       help="encoders: targets (cache-aware, round-robin, previous, vllm-epd)")
    group.add_argument("--enc-previous-rev", default=PREVIOUS_REV,
                       help="encoders: git revision whose cache-aware placement is 'previous'")
    group.add_argument("--epd-proxy-script", default=None,
                       help="encoders: path to vLLM's disagg_epd_proxy.py (vllm 0.33.0 sdist); never vendored")


def _previous_src(rev: str, where: str) -> str | None:
    """``rev``'s ``src`` directory extracted under ``where`` (None when git cannot)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    dest = os.path.join(where, "previous")
    try:
        os.makedirs(dest, exist_ok=True)
        archive = subprocess.run(["git", "-C", root, "archive", rev, "src"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"bench: encoders: no previous placement ({exc})", file=sys.stderr)
        return None
    return os.path.join(dest, "src")


def _vllm_target(sim: T.SimInfo, script: str, log_dir: str, cpus) -> T.Target:
    """vLLM's EPD proxy script in front of the simulator (its flags as of vllm 0.33.0)."""
    port = T.free_port()
    argv = [sys.executable, script, "--host", "127.0.0.1", "--port", str(port),
            "--encode-servers-urls", ",".join(sim.encode), "--prefill-servers-urls", ",".join(sim.prefill),
            "--decode-servers-urls", ",".join(sim.decode)]
    url = f"http://127.0.0.1:{port}"
    svc = Service("vllm-epd", argv, cpus=cpus, log_path=os.path.join(log_dir, "vllm-epd.log"), url=url,
                  ready_path="/health")
    return T.Target("vllm-epd", url, svc, T.ALL_KINDS, note=f"{os.path.basename(script)} (vllm 0.33.0)")


def _encoder_counters(urls: list[str]) -> list[dict]:
    import json

    out = []
    for u in urls:
        with urllib.request.urlopen(u + "/sim/state", timeout=5) as r:
            st = json.loads(r.read())
        ec = st.get("encoder_cache") or {}
        s = st["stats"]
        out.append({"url": u, "items": s.get("encoded_items", 0), "encode_ms": s.get("encode_ms", 0.0),
                    "tokens": s.get("encoded_tokens", 0), "queries": ec.get("queries", 0), "hits": ec.get("hits", 0)})
    return out


async def _one(args, name: str, reqs: list[Prepared], previous: str | None) -> dict:
    settings = lab_settings(args, counts={"encode": 3, "prefill": 1, "decode": 1},
                            sim={"itl_ms": 1.0, "encode_ms_per_mm_token": args.enc_ms_per_token,
                                 "encoder_cache_tokens": args.enc_cache_tokens})
    with Lab(settings) as lab:
        lab.pin_self()
        sim = lab.start_sim()
        if name == "vllm-epd":
            target = lab.add(_vllm_target(sim, args.epd_proxy_script, args.log_dir, settings.proxy_cpus))
            if not target.available:
                return {"target": name, "skipped": target.note}
        elif name == "previous":
            target = T.epd_proxy_target(sim, cpus=settings.proxy_cpus, log_dir=args.log_dir, name=name,
                                        extra=["--encode-policy", "cache-aware"])
            assert target.service is not None and previous is not None
            target.service.env = {**os.environ, "PYTHONPATH": previous}
            target = lab.add(target)
            if not target.available:
                return {"target": name, "skipped": target.note}
        else:
            target = lab.start_proxy(what=name, name=name, extra=["--encode-policy", name])
        res = await lab.phase(target, reqs, rate=args.enc_rate, warmup=0.0, duration=args.enc_duration,
                              max_requests=None, verify=args.verify != "off", label=f"encoders {name}",
                              progress=args.progress, seed=args.seed)
        enc = _encoder_counters(sim.encode)
    return {"target": name, "requests": res["requests"], "errors": res["errors"],
            "verify_errors": res["verify_errors"] + res["outside_window"]["verify_errors"],
            "ttft_p50": res["ttft_ms"]["p50"], "ttft_p99": res["ttft_ms"]["p99"], "req_s": res["req_s"],
            "encoders": enc, "items": sum(e["items"] for e in enc), "encode_ms": sum(e["encode_ms"] for e in enc),
            "hits": sum(e["hits"] for e in enc), "spread": spread([e["encode_ms"] for e in enc]),
            "spread_items": spread([e["items"] - e["hits"] for e in enc])}


async def run(args) -> dict:
    n = int(math.ceil(args.enc_rate * args.enc_duration * 1.3)) + 20  # never cycles within the window
    plan = plan_mix(n, new_share=args.enc_new_share, hot=args.enc_hot, seed=args.seed)
    reqs = build_requests(plan, seed=args.seed, max_tokens=4, model=args.model, verify=args.verify != "off")
    out: dict = {"rate": args.enc_rate, "duration": args.enc_duration, "new_share": args.enc_new_share,
                 "hot": args.enc_hot, "ms_per_token": args.enc_ms_per_token, "ms_per_item": args.encode_ms,
                 "cache_tokens": args.enc_cache_tokens, "results": [], "skipped": {}}
    tmp = tempfile.mkdtemp(prefix="encbench-", dir=args.log_dir)
    for name in args.enc_targets:
        previous = None
        if name == "previous":
            previous = _previous_src(args.enc_previous_rev, tmp)
            if previous is None:
                out["skipped"][name] = f"git archive {args.enc_previous_rev} failed"
                continue
        if name == "vllm-epd" and not args.epd_proxy_script:
            out["skipped"][name] = "no --epd-proxy-script (vLLM's disagg_epd_proxy.py from the vllm 0.33.0 sdist)"
            continue
        r = await _one(args, name, reqs, previous)
        if "skipped" in r:
            out["skipped"][name] = r["skipped"]
        else:
            out["results"].append(r)
    return out


def section(r: dict, plots: dict) -> list[str]:
    out = ["## Encoder pool scheduling", "",
           f"3 encoders, 1 prefill, 1 decode (simulated); {fmt(r['rate'])} req/s for {fmt(r['duration'])} s, one "
           f"image each: {fmt(100 * r['new_share'])} % new, the rest repeats of {r['hot']} hot images; sizes "
           + ", ".join(f"{c.name} {c.kb:g} KiB ({c.tokens[0]}-{c.tokens[1]} tokens, {100 * c.weight:g} %)"
                       for c in SIZE_CLASSES)
           + f". Encoder time {fmt(r['ms_per_item'])} ms + {fmt(r['ms_per_token'])} ms/token per item not in its "
           f"cache ({r['cache_tokens']} tokens each).", ""]
    rows = []
    for t in r.get("results", []):
        per = " / ".join(f"{e['items'] - e['hits']}" for e in t["encoders"])
        ms = " / ".join(f"{e['encode_ms']:.0f}" for e in t["encoders"])
        rows.append([t["target"], str(t["requests"]), per, ms, f"{t['encode_ms']:.0f}", str(t["hits"]),
                     fmt(t["spread"], 2), fmt(t["ttft_p50"], 1), fmt(t["ttft_p99"], 1),
                     f"{t['errors']} / {t['verify_errors']}"])
    out += [table(["target", "requests", "items encoded per encoder", "encoder ms per encoder", "encoder ms total",
                   "cache hits", "spread (max/min ms)", "TTFT p50 ms", "TTFT p99 ms", "errors / mismatches"], rows), ""]
    for name, why in r.get("skipped", {}).items():
        out.append(f"- {name}: not run: {why}")
    if r.get("skipped"):
        out.append("")
    if "encoders" in plots:
        out += [f"![encoder work per target]({plots['encoders']})", ""]
    return out


LIMITS = {"enc_spread": Limit("cache-aware: encoder work spread (max/min encoder ms)", 1.2, "", "<="),
          "enc_work": Limit("cache-aware: encoder work vs round-robin's", 1.0, "x", "<=")}


def plot(r: dict, figures: Figures) -> dict[str, str]:
    res = r.get("results")
    if not res:
        return {}
    fig, ax = figures.new(figsize=(6, 4))
    width = 0.8 / max(len(res), 1)
    for i, t in enumerate(res):
        xs = [j + i * width for j in range(len(t["encoders"]))]
        ax.bar(xs, [e["encode_ms"] for e in t["encoders"]], width, label=t["target"])
    ax.set_xlabel("encoder")
    ax.set_ylabel("simulated encoder ms")
    ax.set_title("encoder work per encoder")
    return {"encoders": figures.save(fig, [ax], "encoders_work.png", grid_axis="y")}


def checks(r: dict) -> list[dict]:
    by = {t["target"]: t for t in r.get("results", [])}
    ca = by.get("cache-aware")
    if ca is None:
        return []
    out = [target_check("enc_spread", LIMITS["enc_spread"], ca["spread"], "encoders")]
    rr = by.get("round-robin")
    if rr is not None and rr["encode_ms"] > 0:
        out.append(target_check("enc_work", LIMITS["enc_work"], ca["encode_ms"] / rr["encode_ms"], "encoders",
                                f"{ca['encode_ms']:.0f} ms against {rr['encode_ms']:.0f} ms"))
    return out


SCENARIO = Scenario("encoders", run=run, section=section, add_arguments=add_arguments, plot=plot, checks=checks,
                    group="encoders scenario")
