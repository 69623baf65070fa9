"""The multiturn scenario: its flags, one cell (a target at a load level on a fresh cluster) and the
matrix of workloads, load levels and targets."""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import shutil
import socket
import subprocess
import sys
import time

import msgspec

from epd_proxy.bench import targets as T
from epd_proxy.bench.conversations import ChatSpec, make_conversations, working_set
from epd_proxy.bench.exchange import Outcome
from epd_proxy.bench.lab import ForeignMeter, Lab, lab_settings
from epd_proxy.bench.procs import Service
from epd_proxy.bench.reference_proxy import reference_target
from epd_proxy.bench.scenarios.base import Scenario, csv_list, float_list
from epd_proxy.bench.scenarios.cluster.drive import ProxyClient, drive, instance_states
from epd_proxy.bench.scenarios.multiturn.evaluate import checks, counters, evaluate_targets, section
from epd_proxy.bench.stats import summarize
from epd_proxy.bench.workloads import Prepared
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts

perf = time.perf_counter

DEFAULT_TARGETS = ("cache-aware", "reuse", "reuse-skip", "vllm-multiturn", "vllm-router:cache_aware",
                   "vllm-router:power_of_two", "vllm-router:consistent_hash")
# Turns spread per request over several processes, as a Service spreads them (ProxyClient: turn t to
# replica t % n): `reuse` on REPLICAS replicas each with its own memory, the same sharing one
# redis-server (--state-store), and one replica of WORKERS workers (the parent's table).
REPLICAS, WORKERS = 3, 4
SPREAD = {"reuse-x3": (REPLICAS, 1, False), "reuse-x3-store": (REPLICAS, 1, True), "reuse-w4": (1, WORKERS, False)}
WORKLOADS = ("long", "short")
# Today's routing: cache-aware prefill, load-aware decode (the proxy's per-role defaults, spelled out).
CACHE_AWARE = ("--prefill-policy", "cache-aware", "--decode-policy", "load-aware")


def add_arguments(group) -> None:
    group.add_argument("--mt-targets", type=csv_list, default=list(DEFAULT_TARGETS),
                       help="multiturn: cache-aware (today's, --no-kv-reuse), reuse, reuse-skip "
                            "(--local-prefill-max-tokens), reuse-x3 / reuse-x3-store (reuse on 3 replicas, "
                            "turns spread per request; -store: sharing one redis-server), reuse-w4 (--workers 4), "
                            "vllm-multiturn (vLLM 0.33's reference proxy), vllm-router:POLICY")
    group.add_argument("--mt-candidate", default="reuse-skip", help="multiturn: the target the issue's targets are "
                                                                     "checked for")
    group.add_argument("--mt-workloads", type=csv_list, default=list(WORKLOADS),
                       help="multiturn: long (answers several times the user turn), short (answers shorter)")
    group.add_argument("--mt-rates", type=float_list, default=[25.0],
                       help="multiturn: offered load levels, requests per second (the targets use the first)")
    group.add_argument("--mt-conversations", type=int, default=60)
    group.add_argument("--mt-turns", type=int, default=4)
    group.add_argument("--mt-system-prompts", type=int, default=3)
    group.add_argument("--mt-system-words", type=int, default=300)
    group.add_argument("--mt-user-words", type=int, default=40)
    group.add_argument("--mt-long-tokens", type=int, default=200, help="multiturn: answer tokens, long workload")
    group.add_argument("--mt-short-tokens", type=int, default=16, help="multiturn: answer tokens, short workload")
    group.add_argument("--mt-think-s", type=float, default=1.0, help="multiturn: mean think time between turns")
    group.add_argument("--mt-prefills", type=int, default=3)
    group.add_argument("--mt-decoders", type=int, default=4)
    group.add_argument("--mt-cache-ratio", type=float, default=0.15,
                       help="multiturn: each instance's prefix cache as a share of the working set (distinct blocks)")
    group.add_argument("--mt-ttft-per-token-ms", type=float, default=0.1,
                       help="multiturn: prefill time per prompt token computed (plus --ttft-ms)")
    group.add_argument("--mt-decode-chunk-tokens", type=int, default=512,
                       help="multiturn: decodes' chunked-prefill budget per step (their local prefills slow their "
                            "streams)")
    group.add_argument("--mt-ttl", type=float, default=480.0,
                       help="multiturn: seconds a decode keeps a finished request's blocks (decoder_kv_blocks_ttl)")
    group.add_argument("--mt-local-prefill-max-tokens", type=int, default=None,
                       help="multiturn: the reuse-skip target's --local-prefill-max-tokens (default: the proxy's; "
                            "the reuse target runs with 0)")
    group.add_argument("--mt-local-prefill-max-streams", type=int, default=None,
                       help="multiturn: the reuse-skip target's --local-prefill-max-streams (default: the proxy's)")
    group.add_argument("--mt-stream", action=argparse.BooleanOptionalAction, default=True,
                       help="multiturn: clients stream (TTFT and ITL measured); --no-mt-stream sends non-stream "
                            "requests, whose TTFT is the whole answer's time and which have no ITL (vLLM 0.32's "
                            "decode names its kept blocks only in a non-stream answer)")
    group.add_argument("--mt-stream-share", type=float, default=1.0,
                       help="multiturn: with --mt-stream, the share of conversations that stream; the others send "
                            "non-stream requests (which the proxy can reuse under vLLM 0.32), so the streams measure "
                            "what their reuse and local prefills cost the decodes they share")
    group.add_argument("--vllm-multiturn-proxy", default=None, metavar="PATH",
                       help="multiturn: vLLM's disagg_proxy_multiturn.py (default: fetched once from the vllm "
                            "0.33.0 sdist on the package index into ~/.cache/epd-proxy-bench)")


@functools.lru_cache(maxsize=1)
def proxy_has_reuse() -> bool:
    """Whether this build's ``serve`` has multi-turn reuse (its ``--no-kv-reuse`` flag)."""
    out = subprocess.run([sys.executable, "-m", "epd_proxy", "serve", "--help"], capture_output=True, text=True)
    return "--no-kv-reuse" in out.stdout


def proxy_flags(name: str, args) -> list[str] | None:
    """``serve`` flags of a proxy target; None when this build cannot run it."""
    if name == "cache-aware":
        return list(CACHE_AWARE) + (["--no-kv-reuse"] if proxy_has_reuse() else [])
    if not proxy_has_reuse():
        return None
    if name == "reuse" or name in SPREAD:
        return list(CACHE_AWARE) + ["--local-prefill-max-tokens", "0"]
    if name == "reuse-skip":
        n, streams = args.mt_local_prefill_max_tokens, args.mt_local_prefill_max_streams
        return (list(CACHE_AWARE) + (["--local-prefill-max-tokens", str(n)] if n is not None else [])
                + (["--local-prefill-max-streams", str(streams)] if streams is not None else []))
    raise ValueError(f"unknown multiturn target {name!r} (known: {', '.join(DEFAULT_TARGETS)}, vllm-router:POLICY)")


def chat_spec(args, workload: str) -> ChatSpec:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown multiturn workload {workload!r} (known: {', '.join(WORKLOADS)})")
    return ChatSpec(conversations=args.mt_conversations, turns=args.mt_turns, system_prompts=args.mt_system_prompts,
                    system_words=args.mt_system_words, user_words=args.mt_user_words,
                    max_tokens=args.mt_long_tokens if workload == "long" else args.mt_short_tokens,
                    image_share=0.0, image_pool=0, think_s=args.mt_think_s, model=args.model, seed=args.seed)


def sim_settings(args, ws: dict) -> tuple[dict, dict, dict]:
    counts = {"encode": 0, "prefill": args.mt_prefills, "decode": args.mt_decoders}
    sim = {"itl_ms": args.itl_ms, "ttft_ms": args.ttft_ms, "ttft_per_token_ms": args.mt_ttft_per_token_ms,
           "block_size": 16, "prefix_cache_blocks": max(1, int(args.mt_cache_ratio * ws["blocks"])),
           "bidirectional": True, "bidirectional_stream_params": True, "bidirectional_kv_ttl": args.mt_ttl}
    roles = {"prefill": {"max_num_seqs": 1}, "decode": {"chunked_prefill_tokens": args.mt_decode_chunk_tokens}}
    return counts, sim, roles


class RecordingClient:
    """A client that keeps every stream's inter-token gaps; with ``conversation_id`` it adds the
    conversation's id to each body (what vLLM's reference proxy needs to link turns); with
    ``stream`` False it sends each turn as a non-stream request."""

    def __init__(self, inner, *, conversation_id: bool = False, stream: bool = True, stream_share: float = 1.0) -> None:
        self.inner = inner
        self.conversation_id = conversation_id
        self.stream = stream
        self.stream_share = stream_share if stream else 0.0
        self.itl: list[float] = []
        self.stream_ttft: list[float] = []  # the streams' alone (a non-stream answer's "TTFT" is its whole time)

    def streams(self, index: int) -> bool:
        """Whether conversation ``index`` streams: ``stream_share`` of them, spread evenly."""
        s = self.stream_share
        return s >= 1.0 or int((index + 1) * s) > int(index * s)

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def send(self, conv, turn: int, prep: Prepared, timeouts: TransportTimeouts) -> Outcome:
        stream = self.streams(conv.index)
        if self.conversation_id or not stream:
            body = dict(prep.obj)
            if self.conversation_id:
                body["conversation_id"] = conv.id
            if not stream:
                body["stream"] = False
            prep = Prepared(prep.kind if stream else "nonstream", prep.path, msgspec.json.encode(body),
                            stream, prep.expected, body)
        o = await self.inner.send(conv, turn, prep, timeouts)
        if o.ok:
            self.itl.extend(o.itl)
            if stream and o.ttft is not None:
                self.stream_ttft.append(o.ttft)
        return o


class HeldSampler:
    """Samples the blocks every decode keeps (``sim:kept_kv_blocks``) once a second."""

    def __init__(self, urls: list[str], period: float = 1.0) -> None:
        self.urls = urls
        self.period = period
        self.samples: list[list[float]] = []
        self._task: asyncio.Task | None = None

    async def _one(self, pool: ConnectionPool) -> float:
        resp = await pool.request("GET", "/metrics", timeouts=TransportTimeouts(connect=2.0, headers=5.0, idle=5.0))
        try:
            text = (await resp.read()).decode()
        finally:
            resp.close()
        for line in text.splitlines():
            if line.startswith("sim:kept_kv_blocks{"):
                return float(line.rpartition(" ")[2])
        return math.nan

    async def _run(self) -> None:
        pools = [ConnectionPool(u) for u in self.urls]
        try:
            while True:
                try:
                    self.samples.append([await self._one(p) for p in pools])
                except Exception:  # a missed sample is no reason to stop measuring
                    pass
                await asyncio.sleep(self.period)
        finally:
            for p in pools:
                await p.close()

    def start(self) -> "HeldSampler":
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> dict:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        totals = [sum(s) for s in self.samples]
        return {"samples": len(self.samples), "peak_total": int(max(totals)) if totals else None,
                "peak_per_decode": int(max((max(s) for s in self.samples), default=0)) if self.samples else None,
                "mean_total": sum(totals) / len(totals) if totals else None}


def _start_redis(lab: Lab, settings) -> str | None:
    """A redis-server (or valkey-server) for the replicas to share, stopped with the lab's targets;
    None when there is none on this machine."""
    server = shutil.which("valkey-server") or shutil.which("redis-server")
    if server is None:
        return None
    port = T.free_port()
    svc = Service("state-store", [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--protected-mode", "no"],
                  cpus=settings.proxy_cpus, log_path=os.path.join(settings.log_dir, "state-store.log"))
    svc.start()
    lab.targets.append(T.Target("state-store", "", svc))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    return None


def _start_spread(lab: Lab, name: str, sim: T.SimInfo, args, settings) -> tuple[list[str], str]:
    """The replicas of a SPREAD target (and their store): their URLs, or none and why."""
    replicas, workers, shared = SPREAD[name]
    flags = proxy_flags(name, args) or []
    if shared:
        url = _start_redis(lab, settings)
        if url is None:
            return [], "no redis-server or valkey-server on this machine"
        flags = flags + ["--state-store", url]
    urls = []
    for i in range(replicas):
        t = lab.add(T.epd_proxy_target(sim, cpus=settings.proxy_cpus, log_dir=settings.log_dir, workers=workers,
                                       name=f"epd-proxy-{name}-{i}", extra=flags))
        if not t.available:
            return [], t.note
        urls.append(t.url)
    how = f"{replicas} replicas" if replicas > 1 else f"--workers {workers}"
    return urls, f"python -m epd_proxy serve: {how}, turns spread per request" + (", --state-store" if shared else "")


def _start_target(lab: Lab, name: str, sim: T.SimInfo, args, settings) -> tuple[T.Target | None, str]:
    cpus, log_dir = settings.proxy_cpus, settings.log_dir
    if name.startswith("vllm-router:"):
        t = T.vllm_router_target(sim, cpus=cpus, log_dir=log_dir, policy=name.split(":", 1)[1],
                                 name="vllm-router-" + name.split(":", 1)[1])
    elif name == "vllm-multiturn":
        t = reference_target(sim, cpus=cpus, log_dir=log_dir, path=args.vllm_multiturn_proxy)
    else:
        flags = proxy_flags(name, args)
        if flags is None:
            return None, "this build's proxy has no multi-turn reuse (no --no-kv-reuse flag)"
        t = T.epd_proxy_target(sim, cpus=cpus, log_dir=log_dir, name=f"epd-proxy-{name}", extra=flags)
    if not t.available:
        return None, t.note
    t = lab.add(t)
    if not t.available:
        return None, t.note
    return t, t.note


async def run_cell(args, workload: str, spec: ChatSpec, convs, ws: dict, name: str, rate: float) -> dict:
    """One target at one load level on a fresh cluster."""
    counts, simcfg, roles = sim_settings(args, ws)
    settings = lab_settings(args, counts=counts, sim=simcfg, roles=roles)
    res: dict = {"target": name, "rate": rate}
    with Lab(settings) as lab:
        lab.pin_self()
        sim = lab.start_sim()
        if name in SPREAD:
            urls, note = _start_spread(lab, name, sim, args, settings)
        else:
            target, note = _start_target(lab, name, sim, args, settings)
            urls = [target.url] if target is not None else []
        res["note"] = note
        if not urls:
            res.update({"available": False})
            return res
        client = RecordingClient(ProxyClient(urls), conversation_id=name == "vllm-multiturn",
                                 stream=args.mt_stream, stream_share=args.mt_stream_share)
        await client.start()
        try:
            if lab.s.quiet_wait > 0:
                await lab.wait_quiet()
            before = await instance_states(sim)
            meter = ForeignMeter(lab).start()
            sampler = HeldSampler(sim.decode).start()
            t0 = perf()
            tally = await drive(spec, convs, [], rate, client, seed=args.seed, verify=args.verify != "off")
            wall = perf() - t0
            held = await sampler.stop()
            foreign = meter.stop()
            after = await instance_states(sim)
        finally:
            await client.close()
    res.update(tally.summary())
    res.update({"wall_s": wall, "foreign_cpu_util": foreign, "held": held, "itl_ms": summarize(client.itl, 1000.0),
                "counters": counters(before, after)})
    if 0.0 < client.stream_share < 1.0:  # TTFT of the streams; every answer's time beside it
        res["answer_ms"] = res["ttft_ms"]
        res["ttft_ms"] = summarize(client.stream_ttft, 1000.0)
    if args.progress:
        k = res["counters"]
        print(f"multiturn {workload} {name} @ {rate:g} req/s: TTFT p50 {res['ttft_ms']['p50']:.1f} p99 "
              f"{res['ttft_ms']['p99']:.1f} ms, ITL p99 {res['itl_ms']['p99']:.1f} ms (decode's "
              f"{k['decode_itl_ms']['p99']:.1f}, {k['decode_itl_ms']['longer']} tokens after a longer step), "
              f"computed {k['computed']} "
              f"(P {k['computed_prefill']}, D {k['computed_decode']}), read from D {k['read_from_decode']}, "
              f"errors {res['errors']}, mismatches {res['verify_errors']}+{k['wrong_kv_reads']}",
              file=sys.stderr, flush=True)
    return res


async def _safe_cell(*a) -> dict:
    try:
        return await run_cell(*a)
    except Exception as exc:  # keep the other cells
        print(f"bench: multiturn {a[1]} {a[5]} @ {a[6]:g}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {"target": a[5], "rate": a[6], "error": f"{type(exc).__name__}: {exc}"}


async def run(args) -> dict:
    names = list(args.mt_targets)
    for n in names:
        if not n.startswith("vllm-router:") and n != "vllm-multiturn":
            proxy_flags(n, args)  # unknown names fail before anything starts
    cand = args.mt_candidate if args.mt_candidate in names else None
    rates = list(args.mt_rates)
    out: dict = {"targets_run": names, "candidate": cand, "rates": rates, "proxy_has_reuse": proxy_has_reuse(),
                 "counts": {"prefill": args.mt_prefills, "decode": args.mt_decoders}, "ttl_s": args.mt_ttl,
                 "ttft_per_token_ms": args.mt_ttft_per_token_ms, "decode_chunk_tokens": args.mt_decode_chunk_tokens,
                 "local_prefill_max_tokens": args.mt_local_prefill_max_tokens,
                 "local_prefill_max_streams": args.mt_local_prefill_max_streams, "stream": args.mt_stream,
                 "stream_share": args.mt_stream_share if args.mt_stream else 0.0,
                 "workloads": {}}
    partial = getattr(args, "partial", None)
    if isinstance(partial, dict):
        partial["result"] = out
    for workload in args.mt_workloads:
        spec = chat_spec(args, workload)
        convs = make_conversations(spec)
        ws = working_set(spec, convs, [], 16)
        _, simcfg, roles = sim_settings(args, ws)
        w: dict = {"spec": spec.__dict__.copy(), "working_set": ws, "sim": simcfg, "roles": roles, "rates": rates,
                   "prefix_cache_blocks": simcfg["prefix_cache_blocks"],
                   "cache_ratio": simcfg["prefix_cache_blocks"] / ws["blocks"] if ws["blocks"] else math.nan,
                   "targets": {n: {"rates": {}} for n in names}}
        out["workloads"][workload] = w
        print(f"bench: multiturn {workload}: {spec.conversations} conversations x {spec.turns} turns, answers "
              f"{spec.max_tokens} tokens, working set {ws['blocks']} blocks", file=sys.stderr, flush=True)
        for k, rate in enumerate(rates):
            order = names[k % len(names):] + names[:k % len(names)]  # no target always first
            for name in order:
                w["targets"][name]["rates"][str(rate)] = await _safe_cell(args, workload, spec, convs, ws, name, rate)
    out["targets"] = evaluate_targets(out)
    return out


SCENARIO = Scenario("multiturn", run=run, section=section, add_arguments=add_arguments, checks=checks,
                    group="multiturn scenario (KV reuse between decode and prefill, prefill skipping)")
