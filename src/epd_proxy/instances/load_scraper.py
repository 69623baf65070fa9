"""The loop per pool that keeps each instance's :class:`LoadSignals` fresh from its
``/metrics`` (``load_signals.py`` says what is read and why a failed scrape is no health
signal)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.instances.load_signals import (
    QUIET_STRETCH,
    parse_adapters,
    parse_block_size,
    parse_kv_blocks,
    parse_load,
    parse_waiting_for_capacity,
    wedged,
)

if TYPE_CHECKING:  # pragma: no cover
    from epd_proxy.instances.instance import Instance
    from epd_proxy.instances.pool import InstancePool

log = logging.getLogger("epd_proxy.load_signals")


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
                status, _, data = await inst.connections.fetch("GET", "/metrics", timeouts=self.timeouts,
                                                               queue=False)
        except (UpstreamError, TimeoutError, OSError) as exc:
            self._failed(inst, str(exc) or type(exc).__name__)
            return
        load = parse_load(data) if status == 200 else None
        if load is None:
            self._failed(inst, f"HTTP {status}" if status != 200 else "no vLLM queue gauges")
            return
        self.scrapes += 1
        inst.signals.update(*load, own_inflight=max(own_before, inst.inflight), now=loop.time(),
                            for_capacity=parse_waiting_for_capacity(data))
        inst.signals.adapters = parse_adapters(data)
        inst.signals.kv_blocks = parse_kv_blocks(data)
        inst.signals.block_size = parse_block_size(data)
        if self.pool.role == "decode":
            # A decode whose queue stands still is out of routing at once (health.py, BY_WEDGED).
            self.pool.outliers.standing(inst, wedged(inst.signals, inst.signals.scraped_at or 0.0))

    def _failed(self, inst: Instance, why: str) -> None:
        self.failures += 1
        if inst.signals.scraped_at is not None:
            log.info("%s instance %s: load signals unknown (metrics scrape: %s)", self.pool.role, inst.url, why)
        inst.signals.forget()
