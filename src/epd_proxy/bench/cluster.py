"""The cluster scenario: where the routing policy sends work, measured on a simulated cluster.

A cluster (2 encoders, 3 prefills, 4 decodes by default) whose prefill
instances keep a prefix cache smaller than the workload's working set
(``--cluster-cache-ratio`` of it, per instance; encoders likewise), and a
multi-turn chat workload (:mod:`epd_proxy.bench.conversations`) started as
Poisson arrivals of conversations at a few load levels. Each policy gets a
fresh cluster and a fresh proxy per (workload, load level) cell, so no policy
inherits another's warm caches; every answer is verified byte for byte, and
each turn's prompt carries the previous answer as received.

Policies (``--policies``; ``--policy-def NAME=ARGS`` adds proxy policies):

``round-robin``, ``least-loaded``,  epd-proxy with ``--routing NAME``
``load-aware``, ``power-of-two``
``cache-aware``                     epd-proxy with cache-aware prefill and encode, load-aware
                                    decode (the proxy's per-role defaults, spelled out)
``NAME`` from ``--policy-def``      epd-proxy with the given ``serve`` flags
``oracle``                          no proxy: the load generator runs E→P→D itself and
                                    pins each conversation (by its index) to one
                                    encoder, prefill and decode: the hit rate to reach
``vllm-router:POLICY``              vllm-router ``--policy POLICY`` (text workloads only:
                                    it has no encoder stage)

Workloads (``--cluster-workloads``): ``chat`` (with images, E+P+D), ``text``
(the same conversations without images, P/D: the one vllm-router can run),
``unique`` (one turn per conversation, no shared system prompt: no two
prompts share a prefix, for the load spread).

The pure parts (policy specs, counters from the instances' ``/sim/state``,
the targets) are functions over plain data; the runner is the I/O shell.
"""

from __future__ import annotations

import asyncio
import math
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import TypeGuard

import msgspec

from epd_proxy.bench import targets as T
from epd_proxy.bench.clients import send_stages
from epd_proxy.bench.conversations import ChatSpec, Conversation, image_pool, make_conversations, turn_body, working_set
from epd_proxy.bench.exchange import Outcome, send
from epd_proxy.bench.stats import percentile, summarize
from epd_proxy.bench.workloads import CHAT_PATH, Prepared, simulator_expected
from epd_proxy.http.client import ConnectionPool, TransportTimeouts

perf = time.perf_counter

WORKLOADS = ("chat", "text", "unique")
BASELINES = ("round-robin", "least-loaded")
# The targets for this scenario.
HIT_RATE_VS_ORACLE = 0.90
SPREAD_LIMIT = 1.3
CPU_VS_LEAST_LOADED = 1.05
REPLICAS_HIT_RATE = 0.95


# -- policies (pure) ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicySpec:
    """One routing policy under test: who routes (``kind``) and how (``args``)."""

    name: str
    kind: str  # "proxy", "oracle" or "vllm-router"
    args: tuple[str, ...] = ()  # proxy: extra `epd-proxy serve` flags; vllm-router: (policy,)

    @property
    def text_only(self) -> bool:
        return self.kind == "vllm-router"


def parse_policies(names: list[str], defs: list[str] | None = None) -> list[PolicySpec]:
    """``--policies`` names, resolved against the built-ins and ``--policy-def NAME=ARGS``."""
    table: dict[str, PolicySpec] = {
        "round-robin": PolicySpec("round-robin", "proxy", ("--routing", "round-robin")),
        "least-loaded": PolicySpec("least-loaded", "proxy", ("--routing", "least-loaded")),
        # The proxy's own policies (docs/architecture.md, "Routing"); the last is its per-role default.
        "load-aware": PolicySpec("load-aware", "proxy", ("--routing", "load-aware")),
        "power-of-two": PolicySpec("power-of-two", "proxy", ("--routing", "power-of-two")),
        "cache-aware": PolicySpec("cache-aware", "proxy", ("--prefill-policy", "cache-aware", "--decode-policy",
                                                          "load-aware", "--encode-policy", "cache-aware")),
        "oracle": PolicySpec("oracle", "oracle"),
    }
    for d in defs or []:
        name, sep, argv = d.partition("=")
        name = name.strip()
        if not sep or not name or ":" in name:
            raise ValueError(f"--policy-def expects NAME=ARGS (epd-proxy serve flags), got {d!r}")
        table[name] = PolicySpec(name, "proxy", tuple(shlex.split(argv)))
    out: list[PolicySpec] = []
    for n in names:
        if n.startswith("vllm-router:"):
            pol = n.split(":", 1)[1]
            if not pol:
                raise ValueError(f"{n!r}: name a vllm-router policy, e.g. vllm-router:cache_aware")
            out.append(PolicySpec(n, "vllm-router", (pol,)))
        elif n in table:
            out.append(table[n])
        else:
            raise ValueError(f"unknown policy {n!r}: define it with --policy-def {n}='--flag value ...' "
                             f"(built-in: {', '.join(table)}, vllm-router:POLICY)")
    if len({p.name for p in out}) != len(out):
        raise ValueError("a policy is listed twice")
    return out


def candidate_policy(policies: list[PolicySpec], name: str | None = None) -> PolicySpec | None:
    """The proxy policy the targets are checked for: ``name``, else the last proxy policy that
    is not a baseline (the cache-aware ones are listed last), else least-loaded."""
    proxies = [p for p in policies if p.kind == "proxy"]
    if name:
        for p in proxies:
            if p.name == name:
                return p
        raise ValueError(f"--cluster-candidate {name!r} is not one of the proxy policies run")
    rest = [p for p in proxies if p.name not in BASELINES]
    if rest:
        return rest[-1]
    for p in proxies:
        if p.name == "least-loaded":
            return p
    return proxies[-1] if proxies else None


# -- the instances' counters (pure) ----------------------------------------------------------------
def _spread(counts: list[int]) -> float | None:
    """max / min of requests per instance (inf when one got none while another got some)."""
    if not counts or max(counts) == 0:
        return None
    lo = min(counts)
    return math.inf if lo == 0 else max(counts) / lo


def cluster_counters(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> dict:
    """What the instances did between two ``/sim/state`` snapshots (per role, in instance
    order): requests per instance and their spread, prompt tokens looked up / found in the
    prefix caches / computed, and encoder-cache lookups and hits."""
    out: dict = {"requests": {}, "spread": {}}
    pq = ph = eq = eh = 0
    for role in ("encode", "prefill", "decode"):
        a_list, b_list = before.get(role, []), after.get(role, [])
        reqs = []
        for a, b in zip(a_list, b_list):
            reqs.append(b["stats"]["requests"] - a["stats"]["requests"])
            pa, pb = a.get("prefix_cache"), b.get("prefix_cache")
            if pa is not None and pb is not None:
                pq += pb["queries"] - pa["queries"]
                ph += pb["hits"] - pa["hits"]
            ea, eb = a.get("encoder_cache"), b.get("encoder_cache")
            if ea is not None and eb is not None:
                eq += eb["queries"] - ea["queries"]
                eh += eb["hits"] - ea["hits"]
        out["requests"][role] = reqs
        out["spread"][role] = _spread(reqs)
    out.update({"prefix_queried_tokens": pq, "prefix_hit_tokens": ph, "prefill_tokens_computed": pq - ph,
                "prefix_hit_rate": ph / pq if pq else math.nan,
                "encoder_queries": eq, "encoder_hits": eh, "encoder_hit_rate": eh / eq if eq else math.nan})
    return out


def merge_repeats(cells: list[dict]) -> dict:
    """One cell from ``--cluster-repeat`` runs of it, each on a fresh cluster (whose ports, so
    whose rendezvous draw, differ): latency quantiles are the median over the repeats, hit
    rates pooled over their tokens, the spread the worst repeat's, CPU summed over all
    requests. A p99 over one cell's 480 requests is its fifth-worst and moves by several ms
    between identical runs; the median of repeats is what policies are compared on."""
    ok = [c for c in cells if not c.get("error") and c.get("available", True)]
    if len(cells) == 1 or not ok:
        return cells[0]
    out = dict(ok[0])
    for key in ("ttft_ms", "e2e_ms"):
        qs = {}
        for q in ok[0][key]:
            vals = sorted(c[key][q] for c in ok)
            qs[q] = sum(vals) if q == "count" else percentile(vals, 50)
        out[key] = qs
    for key in ("requests", "ok", "errors", "verify_errors", "unsent_turns", "retries", "wall_s"):
        if all(isinstance(c.get(key), (int, float)) for c in ok):
            out[key] = sum(c[key] for c in ok)
    for key in ("sim_cpu_util", "loadgen_cpu_util"):
        out[key] = sum(c.get(key, math.nan) for c in ok) / len(ok)
    out["foreign_cpu_util"] = max(c.get("foreign_cpu_util", 0.0) for c in ok)
    out["req_s"] = sum(c["req_s"] for c in ok) / len(ok)
    worst = max(ok, key=lambda c: max((x for x in c["counters"]["spread"].values() if x is not None), default=0.0))
    counters = dict(worst["counters"])
    pooled = {k: sum(c["counters"][k] for c in ok) for k in
              ("prefix_queried_tokens", "prefix_hit_tokens", "encoder_queries", "encoder_hits")}
    counters.update(pooled)
    counters["prefill_tokens_computed"] = round(
        (pooled["prefix_queried_tokens"] - pooled["prefix_hit_tokens"]) / len(ok))  # per repeat
    counters["prefix_hit_rate"] = (pooled["prefix_hit_tokens"] / pooled["prefix_queried_tokens"]
                                   if pooled["prefix_queried_tokens"] else math.nan)
    counters["encoder_hit_rate"] = (pooled["encoder_hits"] / pooled["encoder_queries"]
                                    if pooled["encoder_queries"] else math.nan)
    counters["spread"] = {role: max((c["counters"]["spread"].get(role) for c in ok
                                     if c["counters"]["spread"].get(role) is not None), default=None)
                          for role in worst["counters"]["spread"]}
    out["counters"] = counters
    for key in ("prefix_hit_rate", "encoder_hit_rate", "prefill_tokens_computed"):
        out[key] = counters[key]
    if all(c.get("proxy_cpu_s") is not None for c in ok):
        out["proxy_cpu_s"] = sum(c["proxy_cpu_s"] for c in ok)
        out["proxy_cpu_ms_per_req"] = 1000.0 * out["proxy_cpu_s"] / out["requests"] if out["requests"] else math.nan
    out["repeats"] = [{"ttft_p50": c["ttft_ms"]["p50"], "ttft_p99": c["ttft_ms"]["p99"],
                       "prefix_hit_rate": c["prefix_hit_rate"], "spread": c["counters"]["spread"],
                       "proxy_cpu_ms_per_req": c.get("proxy_cpu_ms_per_req"), "errors": c["errors"]} for c in ok]
    out["failed_repeats"] = len(cells) - len(ok)
    return out


# -- targets (pure) ----------------------------------------------------------------------------------
def _target(key: str, text: str, limit: str, measured, met, source: str, note: str = "", unit: str = "") -> dict:
    return {"key": key, "target": text, "limit": limit, "measured": measured, "unit": unit, "met": met,
            "source": source, "note": note}


def _cells(result: dict, workload: str, policy: str) -> dict:
    return result.get("workloads", {}).get(workload, {}).get("policies", {}).get(policy, {}).get("rates", {})


def evaluate_targets(result: dict, candidate: str | None) -> list[dict]:
    """The issue's four targets (and the replicas one) for ``candidate``, from one run's cells.
    A target with nothing to compare against is reported with ``met: None``."""
    out: list[dict] = []
    if not candidate:
        return out
    def ok(c: dict | None) -> TypeGuard[dict]:
        return c is not None and bool(c) and bool(c.get("available", True)) and not c.get("error")
    # 1. prefix-cache hit rate >= 90 % of the oracle's, every workload and load level with both.
    worst, where = math.inf, ""
    for wl in ("chat", "text"):
        for rate, c in _cells(result, wl, candidate).items():
            o = _cells(result, wl, "oracle").get(rate)
            if ok(c) and ok(o) and o["prefix_hit_rate"] and not math.isnan(o["prefix_hit_rate"]):
                r = c["prefix_hit_rate"] / o["prefix_hit_rate"]
                if r < worst:
                    worst, where = r, (f"{wl} at {rate} req/s: {100 * c['prefix_hit_rate']:.1f} % vs the oracle's "
                                       f"{100 * o['prefix_hit_rate']:.1f} %")
    out.append(_target("cluster_hit_rate", f"Prefix-cache hit rate / the oracle's ({candidate}, worst cell)",
                       f">= {HIT_RATE_VS_ORACLE:g}", None if worst == math.inf else worst,
                       None if worst == math.inf else worst >= HIT_RATE_VS_ORACLE, "cluster", where, "x"))
    # 2. TTFT p50 and p99 on the text workload below every vllm-router policy's, at every load level.
    routers = [p for p in result.get("workloads", {}).get("text", {}).get("policies", {})
               if p.startswith("vllm-router:")]
    worst, where, compared = -math.inf, "", 0
    for rate, c in _cells(result, "text", candidate).items():
        for rp in routers:
            r = _cells(result, "text", rp).get(rate)
            if not (ok(c) and ok(r)):
                continue
            for q in ("p50", "p99"):
                mine, theirs = c["ttft_ms"][q], r["ttft_ms"][q]
                if math.isnan(mine) or math.isnan(theirs) or theirs <= 0:
                    continue
                compared += 1
                x = mine / theirs
                if x > worst:
                    worst, where = x, f"{q} at {rate} req/s: {mine:.1f} ms vs {rp} {theirs:.1f} ms"
    out.append(_target("cluster_ttft", f"TTFT p50/p99 on the text workload / vllm-router's ({candidate}, worst)",
                       "< 1", None if not compared else worst, None if not compared else worst < 1.0, "cluster",
                       where, "x"))
    # 3. spread max/min <= 1.3 on the workload without shared prefixes (prefill and decode).
    worst, where = -math.inf, ""
    for rate, c in _cells(result, "unique", candidate).items():
        if not ok(c):
            continue
        for role in ("prefill", "decode"):
            s = c["counters"]["spread"].get(role)
            if s is not None and s > worst:
                worst, where = s, f"{role} at {rate} req/s: {c['counters']['requests'][role]}"
    out.append(_target("cluster_spread", f"Requests per instance max/min, no shared prefixes ({candidate})",
                       f"<= {SPREAD_LIMIT:g}", None if worst == -math.inf else worst,
                       None if worst == -math.inf else worst <= SPREAD_LIMIT, "cluster", where, "x"))
    # 4. proxy CPU per request within 5 % of least-loaded's (over the same cells).
    mine_cpu = mine_n = base_cpu = base_n = 0.0
    for wl in ("chat", "text"):
        for rate, c in _cells(result, wl, candidate).items():
            b = _cells(result, wl, "least-loaded").get(rate)
            if ok(c) and ok(b) and c.get("proxy_cpu_s") is not None and b.get("proxy_cpu_s") is not None:
                mine_cpu += c["proxy_cpu_s"]
                mine_n += c["requests"]
                base_cpu += b["proxy_cpu_s"]
                base_n += b["requests"]
    ratio = (mine_cpu / mine_n) / (base_cpu / base_n) if mine_n and base_n and base_cpu else None
    out.append(_target("cluster_cpu", f"Proxy CPU per request / least-loaded's ({candidate})",
                       f"<= {CPU_VS_LEAST_LOADED:g}", ratio, None if ratio is None else ratio <= CPU_VS_LEAST_LOADED,
                       "cluster", "" if ratio is None else
                       f"{1000 * mine_cpu / mine_n:.3f} vs {1000 * base_cpu / base_n:.3f} ms per request", "x"))
    rep = result.get("replicas")
    if isinstance(rep, dict) and rep.get("single") and rep.get("replicas"):
        s, r = rep["single"], rep["replicas"]
        if ok(s) and ok(r) and s["prefix_hit_rate"]:
            x = r["prefix_hit_rate"] / s["prefix_hit_rate"]
            out.append(_target("cluster_replicas", f"Hit rate, 2 replicas (one restarted) / one proxy "
                               f"({rep['policy']})", f">= {REPLICAS_HIT_RATE:g}", x, x >= REPLICAS_HIT_RATE,
                               "cluster", f"{100 * r['prefix_hit_rate']:.1f} % vs {100 * s['prefix_hit_rate']:.1f} %",
                               "x"))
    return out


# -- clients ---------------------------------------------------------------------------------------
_HEADERS = (b"content-type", b"application/json")


class ProxyClient:
    """Requests to one or several proxies: turn ``t`` of a conversation goes to proxy
    ``t % n`` (the next one up while that one is marked down). Every request names its
    conversation in ``X-Session-ID`` (what session-affine routers key on)."""

    def __init__(self, urls: list[str], *, max_idle: int = 512) -> None:
        self.urls = list(urls)
        self.max_idle = max_idle
        self.pools: list[ConnectionPool] = []
        self.down: set[int] = set()
        self.inflight = [0] * len(urls)
        self.sent = [0] * len(urls)

    async def start(self) -> None:
        self.pools = [ConnectionPool(u, idle_timeout=2.0, max_idle=self.max_idle) for u in self.urls]

    async def reopen(self, i: int) -> None:
        """A fresh pool for proxy ``i`` (after its restart: its old connections are dead)."""
        old, self.pools[i] = self.pools[i], ConnectionPool(self.urls[i], idle_timeout=2.0, max_idle=self.max_idle)
        await old.close()

    async def send(self, conv: Conversation, turn: int, prep: Prepared, timeouts: TransportTimeouts) -> Outcome:
        n = len(self.pools)
        i = turn % n
        for _ in range(n):
            if i not in self.down:
                break
            i = (i + 1) % n
        self.inflight[i] += 1
        self.sent[i] += 1
        try:
            return await send(self.pools[i], prep, timeouts, verify=prep.expected is not None, keep_text=True,
                              headers=[_HEADERS, (b"x-session-id", conv.id.encode())])
        finally:
            self.inflight[i] -= 1

    async def close(self) -> None:
        for p in self.pools:
            await p.close()


class OracleClient:
    """No proxy: E→P→D run by the load generator with each conversation pinned, by its
    index, to one encoder, one prefill and one decode instance."""

    def __init__(self, sim: T.SimInfo, *, max_idle: int = 512) -> None:
        self.sim = sim
        self.max_idle = max_idle
        self.pools: dict[str, list[ConnectionPool]] = {}

    async def start(self) -> None:
        self.pools = {role: [ConnectionPool(u, idle_timeout=2.0, max_idle=self.max_idle) for u in urls]
                      for role, urls in (("encode", self.sim.encode), ("prefill", self.sim.prefill),
                                         ("decode", self.sim.decode))}

    def pinned(self, conv: Conversation) -> dict:
        i = conv.index
        return {role: (ps[i % len(ps)] if ps else None) for role, ps in self.pools.items()}

    async def send(self, conv: Conversation, turn: int, prep: Prepared, timeouts: TransportTimeouts) -> Outcome:
        return await send_stages(self.pinned(conv), prep, timeouts, verify=prep.expected is not None, keep_text=True)

    async def close(self) -> None:
        for ps in self.pools.values():
            for p in ps:
                await p.close()


# -- the driver ----------------------------------------------------------------------------------------
class Tally:
    """Every request's outcome, kept compact."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.ok = 0
        self.errors: Counter = Counter()
        self.verify_errors = 0
        self.examples: list[str] = []
        self.unsent = 0  # turns never sent because an earlier turn of their conversation failed
        self.live = 0  # conversations started and not finished
        self.max_live = 0
        self.t_first = math.inf
        self.t_last = -math.inf

    def add(self, o: Outcome) -> None:
        self.t_first = min(self.t_first, o.t_send)
        self.t_last = max(self.t_last, o.t_end)
        if o.ok:
            self.ok += 1
            if o.ttft is not None:
                self.ttft.append(o.ttft)
            self.e2e.append(o.e2e)
            return
        self.errors[(o.error or "error").split(":", 1)[0]] += 1
        if o.verify_error:
            self.verify_errors += 1
        if len(self.examples) < 5:
            self.examples.append(o.error or "?")

    def summary(self) -> dict:
        n = self.ok + sum(self.errors.values())
        span = self.t_last - self.t_first if n else math.nan
        return {"requests": n, "ok": self.ok, "errors": sum(self.errors.values()), "error_kinds": dict(self.errors),
                "verify_errors": self.verify_errors, "error_examples": self.examples, "unsent_turns": self.unsent,
                "max_live_conversations": self.max_live,
                # every request counts (no warm-up window: the caches start cold for every policy alike)
                "outside_window": {"ok": 0, "errors": 0, "verify_errors": 0},
                "span_s": span, "req_s": n / span if n and span > 0 else math.nan,
                "ttft_ms": summarize(self.ttft, 1000.0), "e2e_ms": summarize(self.e2e, 1000.0)}


async def drive(spec: ChatSpec, convs: list[Conversation], images: list[str], rate: float, client, *,
                seed: int = 0, verify: bool = True, timeouts: TransportTimeouts | None = None,
                tally: Tally | None = None, on_start=None) -> Tally:
    """Open loop: conversations start as Poisson arrivals (``rate / turns`` per second, so
    requests arrive at about ``rate`` per second once turns overlap); each sends its turns
    one after another, every prompt carrying the answers received so far, after each
    turn's think time. ``on_start(i)`` is called as conversation ``i`` starts."""
    timeouts = timeouts or TransportTimeouts(connect=10.0, headers=300.0, idle=300.0)
    tally = tally or Tally()
    expected = simulator_expected() if verify else None
    rng = random.Random(f"{seed}:arrivals:{rate}")
    conv_rate = rate / max(1, spec.turns)

    async def one(conv: Conversation) -> None:
        tally.live += 1
        tally.max_live = max(tally.max_live, tally.live)
        try:
            await turns(conv)
        finally:
            tally.live -= 1

    async def turns(conv: Conversation) -> None:
        answers: list[str] = []
        for t, turn in enumerate(conv.turns):
            if t and turn.think_s > 0:
                await asyncio.sleep(turn.think_s)
            body = turn_body(spec, conv, t, answers, images)
            kind = "mm" if any(isinstance(m["content"], list) for m in body["messages"]) else "stream"
            prep = Prepared(kind, CHAT_PATH, msgspec.json.encode(body), True,
                            expected(body) if expected else None, body)
            o = await client.send(conv, t, prep, timeouts)
            tally.add(o)
            if o.text is None or (not o.ok and not o.verify_error):
                tally.unsent += len(conv.turns) - t - 1
                return
            answers.append(o.text)

    loop = asyncio.get_running_loop()
    tasks = []
    t_next = perf()
    for i, conv in enumerate(convs):
        if i:
            t_next += rng.expovariate(conv_rate)
            delay = t_next - perf()
            if delay > 0:
                await asyncio.sleep(delay)
        if on_start is not None:
            on_start(i)
        tasks.append(loop.create_task(one(conv)))
    if tasks:
        await asyncio.gather(*tasks)
    return tally


async def instance_states(sim: T.SimInfo) -> dict[str, list[dict]]:
    """``GET /sim/state`` of every instance, per role (the counters behind ``/metrics``:
    ``vllm:prefix_cache_queries/hits_total``, ``sim:encoder_cache_queries/hits_total``)."""
    out: dict[str, list[dict]] = {}
    timeouts = TransportTimeouts(connect=5.0, headers=10.0, idle=10.0)
    for role, urls in (("encode", sim.encode), ("prefill", sim.prefill), ("decode", sim.decode)):
        out[role] = []
        for u in urls:
            pool = ConnectionPool(u)
            try:
                resp = await pool.request("GET", "/sim/state", timeouts=timeouts)
                try:
                    data = await resp.read()
                finally:
                    resp.close()
            finally:
                await pool.close()
            out[role].append(msgspec.json.decode(data))
    return out


# -- the scenario ----------------------------------------------------------------------------------------
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
    from epd_proxy.bench.compare import ForeignMeter, Lab, lab_settings
    from epd_proxy.bench.procs import self_cpu_seconds

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


async def run_cluster(args) -> dict:
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
        single = _cells(out, "chat", cand.name).get(str(rate))
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
