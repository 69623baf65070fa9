"""The cluster scenario's load: clients in front of the proxies (or none: the oracle) and the
open-loop driver that plays the conversations through them."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter

import msgspec

from epd_proxy.bench import targets as T
from epd_proxy.bench.clients import send_stages
from epd_proxy.bench.conversations import ChatSpec, Conversation, turn_body
from epd_proxy.bench.exchange import Outcome, send
from epd_proxy.bench.stats import summarize
from epd_proxy.bench.workloads import CHAT_PATH, Prepared, simulator_expected
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts

perf = time.perf_counter


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


class DirectClient(OracleClient):
    """A second client population that reaches the instances directly (no proxy): it runs
    E→P→D itself, each of its conversations pinned, by its index, to one instance per role, as
    a client with its own session affinity does. Its blocks and evictions are in the instances'
    caches, and only their KV events tell a proxy of them."""


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
        self.retried = 0  # failed turns the client sent again
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
                "retried": self.retried,
                "max_live_conversations": self.max_live,
                # every request counts (no warm-up window: the caches start cold for every policy alike)
                "outside_window": {"ok": 0, "errors": 0, "verify_errors": 0},
                "span_s": span, "req_s": n / span if n and span > 0 else math.nan,
                "ttft_ms": summarize(self.ttft, 1000.0), "e2e_ms": summarize(self.e2e, 1000.0)}


async def drive(spec: ChatSpec, convs: list[Conversation], images: list[str], rate: float, client, *,
                seed: int = 0, verify: bool = True, timeouts: TransportTimeouts | None = None,
                tally: Tally | None = None, on_start=None, retries: int = 0) -> Tally:
    """Open loop: conversations start as Poisson arrivals (``rate / turns`` per second, so
    requests arrive at about ``rate`` per second once turns overlap); each sends its turns
    one after another, every prompt carrying the answers received so far, after each
    turn's think time. ``on_start(i)`` is called as conversation ``i`` starts. A failed turn
    (not a wrong answer) is sent again up to ``retries`` times, after 0.5 s, then 1 s, …
    (the OpenAI SDK's default is 2 retries from 0.5 s); every attempt counts as a request."""
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
            for attempt in range(retries):
                if o.ok or o.verify_error:
                    break
                await asyncio.sleep(0.5 * 2 ** attempt)
                tally.retried += 1
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


async def sim_post(url: str, path: str, body: dict) -> None:
    """``POST`` a simulator control route (``/sim/fault``, ``/sim/health``); raises unless it answers 200."""
    pool = ConnectionPool(url)
    timeouts = TransportTimeouts(connect=5.0, headers=10.0, idle=10.0)
    try:
        resp = await pool.request("POST", path, body=msgspec.json.encode(body), headers=[_HEADERS],
                                  timeouts=timeouts)
        try:
            await resp.read()
        finally:
            resp.close()
        if resp.status != 200:
            raise RuntimeError(f"{url}{path} answered {resp.status}")
    finally:
        await pool.close()


_KV_METRICS = (b"epd_proxy_routing_exact_total", b"epd_proxy_kv_lookups_total", b"epd_proxy_kv_events_restarts_total",
               b"epd_proxy_kv_events_lost_total", b"epd_proxy_kv_events_gaps_total",
               b"epd_proxy_not_disaggregated_total")


def kv_metric_lines(text: bytes) -> dict[str, float]:
    """The KV events' and exact routing's counters in a ``/metrics`` page, summed by series
    (name and labels, the ``worker`` label dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(_KV_METRICS):
            continue
        series, _, value = line.rpartition(b" ")
        name, _, labels = series.partition(b"{")
        kept = ",".join(x for x in labels.rstrip(b"}").decode().split(",") if x and not x.startswith("worker="))
        key = name.decode() + (f"{{{kept}}}" if kept else "")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


async def proxy_kv_metrics(urls: list[str]) -> dict[str, float]:
    """:func:`kv_metric_lines` summed over the proxies at ``urls`` (one that does not answer counts nothing)."""
    out: dict[str, float] = {}
    timeouts = TransportTimeouts(connect=5.0, headers=10.0, idle=10.0)
    for u in urls:
        pool = ConnectionPool(u)
        try:
            resp = await pool.request("GET", "/metrics", timeouts=timeouts)
            try:
                data = await resp.read()
            finally:
                resp.close()
        except Exception:  # the figures are a diagnosis, not the measurement
            continue
        finally:
            await pool.close()
        for k, v in kv_metric_lines(data).items():
            out[k] = out.get(k, 0.0) + v
    return out


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
