"""The instances of one role, their health, and how one is chosen.

Health has two inputs: a background ``GET /health`` probe per instance, and
what requests observe (a connection failure counts like a failed probe).
``fail_threshold`` consecutive failures take an instance out of rotation;
one success brings it back. Instances start healthy, so the proxy serves from
its first second and a late-starting instance joins as soon as it answers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable, Protocol

from .config import InstanceSpec
from .errors import ProxyError
from .http.client import ConnectionPool, Timeouts, UpstreamError

log = logging.getLogger("epd_proxy.pool")


class Instance:
    """One upstream vLLM instance: its connection pool and what we know of its state."""

    __slots__ = ("spec", "url", "role", "http", "inflight", "healthy", "failures", "last_error",
                 "requests", "errors")

    def __init__(self, spec: InstanceSpec, http: ConnectionPool) -> None:
        self.spec = spec
        self.url = spec.url
        self.role = spec.role
        self.http = http
        self.inflight = 0
        self.healthy = True
        self.failures = 0  # consecutive
        self.last_error: str | None = None
        self.requests = 0
        self.errors = 0

    def __repr__(self) -> str:
        return f"<Instance {self.role} {self.url} inflight={self.inflight} healthy={self.healthy}>"


class RoutingPolicy(Protocol):
    """Picks one of the candidates (never empty)."""

    def choose(self, candidates: list[Instance]) -> Instance: ...


class RoundRobin:
    """Strict rotation; the cursor persists across requests."""

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, candidates: list[Instance]) -> Instance:
        inst = candidates[self._cursor % len(candidates)]
        self._cursor += 1
        return inst


class LeastLoaded:
    """Fewest requests in flight from this proxy; ties rotate, so an idle
    cluster still spreads requests evenly instead of piling on the first."""

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, candidates: list[Instance]) -> Instance:
        n = len(candidates)
        start = self._cursor % n
        best = candidates[start]
        for i in range(1, n):
            c = candidates[(start + i) % n]
            if c.inflight < best.inflight:
                best = c
        self._cursor += 1
        return best


POLICIES = {"round-robin": RoundRobin, "least-loaded": LeastLoaded}


class InstancePool:
    """All instances of one role."""

    def __init__(self, role: str, specs: Iterable[InstanceSpec], *, policy: str = "least-loaded",
                 keep_alive: float = 5.0, default_headers=None, fail_threshold: int = 3) -> None:
        self.role = role
        # Retire pooled sockets at half the server's keep-alive, before it closes them.
        idle = keep_alive / 2 if keep_alive > 0 else 0.0
        self.instances = [Instance(s, ConnectionPool(s.url, idle_timeout=idle, default_headers=default_headers))
                          for s in specs]
        self.policy: RoutingPolicy = POLICIES[policy]()
        self.fail_threshold = max(1, fail_threshold)
        self._probe_task: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self.instances)

    def __bool__(self) -> bool:
        return bool(self.instances)

    def choose(self, exclude: Iterable[Instance] = ()) -> Instance:
        """A healthy instance, preferring ones not in ``exclude`` (those that
        already failed this request); 503 when none is healthy."""
        healthy = [i for i in self.instances if i.healthy]
        if not healthy:
            raise ProxyError(503, f"no healthy {self.role} instance available", retryable=False)
        exclude = set(exclude)
        preferred = [i for i in healthy if i not in exclude] if exclude else healthy
        return self.policy.choose(preferred or healthy)

    def find(self, url: str) -> Instance | None:
        for inst in self.instances:
            if inst.url == url:
                return inst
        return None

    # -- health ---------------------------------------------------------------------
    def record_success(self, inst: Instance) -> None:
        inst.failures = 0
        if not inst.healthy:
            log.info("%s instance %s is back", self.role, inst.url)
            inst.healthy = True

    def record_failure(self, inst: Instance, reason: str) -> None:
        inst.failures += 1
        inst.errors += 1
        inst.last_error = reason
        if inst.healthy and inst.failures >= self.fail_threshold:
            inst.healthy = False
            log.warning("%s instance %s taken out of rotation after %d failures: %s",
                        self.role, inst.url, inst.failures, reason)

    async def probe_once(self, timeout: float) -> None:
        await asyncio.gather(*(self._probe(i, timeout) for i in self.instances))

    async def _probe(self, inst: Instance, timeout: float) -> None:
        t = Timeouts(connect=timeout, headers=timeout, idle=timeout)
        try:
            async with asyncio.timeout(timeout):
                resp = await inst.http.request("GET", "/health", timeouts=t)
                try:
                    await resp.read()
                finally:
                    resp.close()
        except (UpstreamError, TimeoutError, OSError) as exc:
            self.record_failure(inst, f"health probe: {exc}")
            return
        if resp.status == 200:
            self.record_success(inst)
        else:
            self.record_failure(inst, f"health probe: HTTP {resp.status}")

    def start_probing(self, interval: float, timeout: float) -> None:
        if interval > 0 and self.instances and self._probe_task is None:
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop(interval, timeout))

    async def _probe_loop(self, interval: float, timeout: float) -> None:
        while True:
            try:
                await self.probe_once(timeout)
            except Exception:  # never let the prober die
                log.exception("health probe loop error (%s)", self.role)
            await asyncio.sleep(interval)

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            try:
                await self._probe_task
            except (asyncio.CancelledError, Exception):
                pass
            self._probe_task = None
        for inst in self.instances:
            await inst.http.close()

    def snapshot(self) -> list[dict]:
        return [{"url": i.url, "healthy": i.healthy, "inflight": i.inflight, "requests": i.requests,
                 "errors": i.errors, "last_error": i.last_error} for i in self.instances]
