"""Each instance's own load, read from its ``/metrics`` in the background.

The proxy's in-flight counts see only its own requests; with several proxy
replicas (or ``--workers``) each sees a share. vLLM exports the whole queue
(``vllm:num_requests_running`` + ``vllm:num_requests_waiting``) and the KV
cache's fill (``vllm:kv_cache_usage_perc``), so a loop per pool scrapes them
every ``--scrape-interval`` and keeps, per instance, the part of that queue
which is not this proxy's (:class:`LoadSignals`). Routing reads those numbers;
no request ever waits on a scrape.

A failed scrape is **not** a health signal: ``/metrics`` may be disabled,
filtered by a sidecar or slow for reasons unrelated to serving, and the health
probe already asks the instance whether it serves. It only makes the
instance's signals unknown (``forget``): routing then counts this proxy's
in-flight requests alone for it, never old numbers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from .http.client import TransportTimeouts, UpstreamError

if TYPE_CHECKING:  # pragma: no cover
    from .pool import Instance, InstancePool

log = logging.getLogger("epd_proxy.load_signals")

_RUNNING = b"vllm:num_requests_running"
_WAITING = b"vllm:num_requests_waiting"
_KV_USAGE = b"vllm:kv_cache_usage_perc"


class LoadSignals:
    """What an instance's ``/metrics`` said last, as this proxy can use it.

    ``others``: requests on the instance that are not this proxy's (its running +
    waiting at the scrape, minus this proxy's in-flight during it; 0 when unknown or stale).
    ``kv_usage``: ``vllm:kv_cache_usage_perc`` (0..1).
    """

    __slots__ = ("others", "kv_usage", "waiting", "load", "scraped_at")

    def __init__(self) -> None:
        self.others = 0.0
        self.kv_usage = 0.0
        self.waiting = 0.0
        self.load = 0.0  # what the load-aware score adds to the in-flight count (routing.py)
        self.scraped_at: float | None = None

    def update(self, running: float, waiting: float, kv_usage: float, own_inflight: int, now: float) -> None:
        self.others = max(0.0, running + waiting - own_inflight)
        self.waiting = waiting
        self.kv_usage = kv_usage
        self.load = self.others + kv_penalty(kv_usage)
        self.scraped_at = now

    def forget(self) -> None:
        """No fresh scrape: route on this proxy's own counts only."""
        self.others = 0.0
        self.kv_usage = 0.0
        self.waiting = 0.0
        self.load = 0.0
        self.scraped_at = None


# The KV cache weighs in only as it nears full: from KV_FULL_FROM to full it counts as up to
# KV_USAGE_WEIGHT queued requests (a decode near its limit would preempt the next long
# stream). Below that, usage says little about the next request, and weighing it would send
# every tie between idle instances to whichever looked emptiest at the last scrape, for a
# whole scrape interval.
KV_FULL_FROM = 0.75
KV_USAGE_WEIGHT = 8.0


def kv_penalty(kv_usage: float) -> float:
    return KV_USAGE_WEIGHT * (kv_usage - KV_FULL_FROM) / (1.0 - KV_FULL_FROM) if kv_usage > KV_FULL_FROM else 0.0


def gauge_samples(text: bytes, name: bytes) -> list[float]:
    """The samples of a gauge in Prometheus text, one per label set (one per engine with
    data parallelism); NaN samples are left out."""
    out: list[float] = []
    pos = 0
    n = len(name)
    size = len(text)
    while True:
        pos = text.find(name, pos)
        if pos < 0:
            return out
        end = pos + n
        # A sample line starts with the exact name: not a comment, not a longer name.
        if (pos == 0 or text[pos - 1] == 10) and end < size and text[end] in b"{ ":
            eol = text.find(b"\n", end)
            line = text[end:eol if eol >= 0 else size]
            if line[:1] == b"{":
                line = line[line.rfind(b"}") + 1:]
            try:
                value = float(line.split()[0])
            except (ValueError, IndexError):
                value = float("nan")
            if value == value:
                out.append(value)
        pos = end


def parse_load(text: bytes) -> tuple[float, float, float] | None:
    """(running, waiting, kv_usage) from vLLM's ``/metrics``: queues summed over engines, KV
    usage their mean; None without the queue gauges."""
    running = gauge_samples(text, _RUNNING)
    waiting = gauge_samples(text, _WAITING)
    if not running and not waiting:
        return None
    kv = gauge_samples(text, _KV_USAGE)
    return sum(running), sum(waiting), (sum(kv) / len(kv)) if kv else 0.0


# While every instance shows only this proxy's own requests and no KV cache near full, a scrape
# adds nothing to what routing already knows: the wait doubles after each such round, up to
# QUIET_STRETCH x the interval, and drops back to the interval at the first round that shows
# anything else. (Envoy's health checks stretch the same way for a cluster without traffic,
# ``no_traffic_interval``.) A single proxy in front of its own cluster then pays a quarter of
# the scrapes; replicas that see each other's load keep the full rate.
QUIET_STRETCH = 4


class LoadScraper:
    """The background loop of one pool: every ``interval`` seconds (up to ``QUIET_STRETCH``
    times that while the cluster shows nothing but this proxy's load), each instance's
    ``/metrics`` (concurrently, each bounded by ``timeout``)."""

    def __init__(self, pool: InstancePool, interval: float, timeout: float) -> None:
        self.pool = pool
        self.interval = interval
        self.wait = interval  # the current wait between rounds
        self.timeouts = TransportTimeouts(connect=timeout, headers=timeout, idle=timeout)
        self.timeout = timeout
        self.scrapes = 0
        self.failures = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.interval > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._scrape(i) for i in list(self.pool.instances)))

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.scrape_once()
                self.wait = (min(self.wait * 2, self.interval * QUIET_STRETCH) if self.quiet()
                             else self.interval)
            except Exception:  # never let the loop die
                log.exception("load scrape loop error (%s)", self.pool.role)
                self.wait = self.interval
            await asyncio.sleep(max(0.0, started + self.wait - loop.time()))

    def quiet(self) -> bool:
        """Whether the last round showed nothing routing would weigh: no instance with others'
        requests or a KV cache in the penalty range (``LoadSignals.load`` 0 everywhere)."""
        return not any(inst.signals.load for inst in self.pool.instances)

    async def _scrape(self, inst: Instance) -> None:
        loop = asyncio.get_running_loop()
        # The instance counts its requests at some moment between sending and answering;
        # this proxy's own share then was at least its in-flight count at either end. The
        # larger of the two keeps requests that ended meanwhile from showing up as "others"
        # (which would steer new requests away from the instance until the next scrape).
        own_before = inst.inflight
        try:
            async with asyncio.timeout(self.timeout):
                # Past the connection cap, like a probe: the load is read when it is highest.
                resp = await inst.connections.request("GET", "/metrics", timeouts=self.timeouts, queue=False)
                try:
                    data = await resp.read()
                finally:
                    resp.close()
        except (UpstreamError, TimeoutError, OSError) as exc:
            self._failed(inst, str(exc) or type(exc).__name__)
            return
        load = parse_load(data) if resp.status == 200 else None
        if load is None:
            self._failed(inst, f"HTTP {resp.status}" if resp.status != 200 else "no vLLM queue gauges")
            return
        self.scrapes += 1
        inst.signals.update(*load, own_inflight=max(own_before, inst.inflight), now=loop.time())

    def _failed(self, inst: Instance, why: str) -> None:
        self.failures += 1
        if inst.signals.scraped_at is not None:
            log.info("%s instance %s: load signals unknown (metrics scrape: %s)", self.pool.role, inst.url, why)
        inst.signals.forget()
