"""Active health checking: each instance's ``GET /health`` probe loop, and its ``/v1/models``
read after every probe that answered (Envoy's health checker, beside the host set that
``pool.py`` keeps and the outlier detection of ``outliers.py``).

A probe's verdict goes to the outlier detector (:class:`Verdicts`: ``probe_answered``,
``probe_failed``), where the health state machine (``health.py``) decides; what an instance
serves goes to the role's ``ServedModels`` (``served_models.py``: ``learned``). Failing, ejected
and never-yet-healthy instances are probed at the fast interval.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol, Sequence

from epd_proxy.http import Headers
from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.instances.health import HEALTHY, TIMEOUT
from epd_proxy.instances.instance import Instance

# The pool's logger: operators filter on it (docs/architecture.md, "Modules").
log = logging.getLogger("epd_proxy.pool")

# Failing, ejected and never-yet-healthy instances are probed this often (at most).
FAST_PROBE_INTERVAL = 1.0


class HostSet(Protocol):
    """The instances probed (``pool.InstancePool``)."""

    @property
    def role(self) -> str: ...
    @property
    def instances(self) -> Sequence[Instance]: ...


class Verdicts(Protocol):
    """What a probe's verdict is told to (``outliers.OutlierDetector``)."""

    def probe_answered(self, inst: Instance) -> None: ...
    def probe_failed(self, inst: Instance, kind: str, reason: str) -> None: ...
    def record_local_error(self) -> None: ...


class Learner(Protocol):
    """What an instance's ``/v1/models`` answer is told to (``served_models.ServedModels``)."""

    def learned(self, inst: Instance, body: bytes) -> None: ...


class HealthChecks:
    """The probe loops of one role's instances."""

    def __init__(self, hosts: HostSet, verdicts: Verdicts, served: Learner, headers: Headers) -> None:
        self.hosts = hosts
        self.verdicts = verdicts
        self.served = served
        self._headers = headers  # a /v1/models read's (--upstream-api-key)
        self.tasks: dict[Instance, asyncio.Task] = {}
        self._probing: tuple[float, float] | None = None  # (interval, timeout) once started

    def start(self, interval: float, timeout: float) -> None:
        """Probe every instance, and every one added later."""
        if interval > 0 and self._probing is None:
            self._probing = (interval, timeout)
            for inst in self.hosts.instances:
                self._start(inst, interval, timeout)

    def added(self, inst: Instance) -> None:
        """A new instance: probed too, if probing is on."""
        if self._probing is not None:
            self._start(inst, *self._probing)

    def removed(self, inst: Instance) -> None:
        task = self.tasks.pop(inst, None)
        if task is not None:
            task.cancel()

    def _start(self, inst: Instance, interval: float, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self.tasks[inst] = loop.create_task(self._loop(inst, interval, timeout))

    async def _loop(self, inst: Instance, interval: float, timeout: float) -> None:
        """One instance's probes: at ``interval`` while it is steady, at the fast
        interval while it is failing, out, or has never answered yet."""
        fast = min(interval, FAST_PROBE_INTERVAL)
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.probe(inst, timeout)
            except Exception:  # never let the prober die
                log.exception("health probe loop error (%s %s)", self.hosts.role, inst.url)
            h = inst.health
            steady = h.state is HEALTHY and h.failures == 0 and h.seen_healthy
            # Periods run from each probe's start: a probe that timed out has waited already.
            await asyncio.sleep(max(0.0, started + (interval if steady else fast) - loop.time()))

    async def probe(self, inst: Instance, timeout: float) -> None:
        """One health probe of ``inst``, its verdict told to the outlier detector."""
        verdicts = self.verdicts
        t = TransportTimeouts(connect=timeout, headers=timeout, idle=timeout)
        try:
            async with asyncio.timeout(timeout):
                # A probe never queues behind the connection cap: a busy instance is not a dead one.
                status, _, _ = await inst.connections.fetch("GET", "/health", timeouts=t, queue=False)
        except UpstreamError as exc:
            if exc.kind == "local":
                verdicts.record_local_error()
                return
            verdicts.probe_failed(inst, TIMEOUT if exc.kind == TIMEOUT else "connection", f"health probe: {exc}")
            return
        except TimeoutError:
            verdicts.probe_failed(inst, TIMEOUT, f"health probe: no answer within {timeout:g} s")
            return
        except OSError as exc:
            verdicts.probe_failed(inst, "connection", f"health probe: {exc}")
            return
        if status == 200:
            verdicts.probe_answered(inst)
            await self.learn_models(inst, timeout)
        else:
            verdicts.probe_failed(inst, "probe_status", f"health probe: HTTP {status}")

    async def learn_models(self, inst: Instance, timeout: float) -> None:
        """Read what ``inst`` serves from its ``/v1/models`` (after each probe that answered;
        call it after an adapter load or unload too). An answer that is not a model list
        leaves what was known: it is no health signal."""
        t = TransportTimeouts(connect=timeout, headers=timeout, idle=timeout)
        try:
            async with asyncio.timeout(timeout):
                status, _, data = await inst.connections.fetch("GET", "/v1/models", headers=self._headers,
                                                               timeouts=t, queue=False)
            if status != 200:
                raise ValueError(f"HTTP {status}")
            self.served.learned(inst, data)
        except (UpstreamError, TimeoutError, OSError, ValueError) as exc:
            log.debug("%s instance %s: /v1/models not read: %s", self.hosts.role, inst.url, exc)

    async def close(self) -> None:
        tasks, self.tasks = list(self.tasks.values()), {}
        self._probing = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
