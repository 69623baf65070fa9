"""The gateway board: every proxy process publishes a short summary of itself to the shared
state store, and reads everyone's for the console (``gateway_view.py`` says what is in one).

A timer publishes every :data:`INTERVAL` seconds; nothing runs on the request path (the
numbers are the metrics' counters, read by the timer). A summary is kept :data:`KEEP` seconds,
so a replica that stops publishing stays visible, marked, for that long; its id is also added
to the set of the current minute (kept three minutes), which is how readers find every
summary without listing the store's keys. Every store call goes through a ``GuardedStore`` of
the board's own (its budget and breaker, over the request path's store client): a store that
fails costs the summary (counted in ``failures`` and shown), never a request, and the board's
failures never open the request path's breaker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time

import msgspec

from epd_proxy.api.console_view import instance_view
from epd_proxy.api.gateway_view import gateway, instance_states, totals, traffic
from epd_proxy.instances.instance import now as instance_now
from epd_proxy.instances.membership import Membership
from epd_proxy.observe.metrics import ProxyMetrics
from epd_proxy.observe.version import VERSION
from epd_proxy.state.guard import GuardedStore

log = logging.getLogger("epd_proxy.console")

INTERVAL = 5.0  # seconds between a process's summaries
KEEP = 60.0  # seconds a summary stays readable after its last publish
BUCKET = 60  # seconds per set of publishers' ids
BUCKET_KEEP = 3 * BUCKET
READ_EVERY = 1.0  # a console polling faster reads the store at most this often


def _id_bytes(n: int) -> bytes:
    return n.to_bytes(8, "big")


class GatewayBoard:
    """This process's summaries out, everyone's in. ``worker``: this process's index with
    ``--workers`` (None: the proxy is one process), of ``workers``."""

    def __init__(self, store: GuardedStore, metrics: ProxyMetrics, membership: Membership, *,
                 worker: int | None = None, workers: int = 1, interval: float = INTERVAL) -> None:
        self.store = store
        self.metrics = metrics
        self.membership = membership
        self.interval = interval
        self.id = secrets.randbits(48)  # a JSON number every browser reads exactly
        self.identity = {"host": socket.gethostname(), "listen": "", "pid": os.getpid(),
                         "proxy_pid": os.getppid() if worker is not None else os.getpid(), "worker": worker,
                         "workers": workers, "version": VERSION, "started": round(time.time(), 3)}
        self.failures = {"publish": 0, "read": 0}
        self.published = 0
        self._totals: dict | None = None
        self._at = time.monotonic()
        self._task: asyncio.Task | None = None
        self.read_every = READ_EVERY
        self._read_at = -READ_EVERY
        self._view: dict | None = None

    def start(self, listen: str) -> None:
        self.identity["listen"] = listen
        self._task = asyncio.get_running_loop().create_task(self._run())

    def _summary(self, stopping: bool = False, advance: bool = True) -> dict:
        """This process now; ``advance``: the rates' next interval starts here (a publish)."""
        m = self.metrics
        now_totals = totals(m.requests, m.stream_errors, [b.counts for b in m.ttft.values()], m.itl.counts,
                            m.completion_tokens())
        at = time.monotonic()
        moved = traffic(now_totals, self._totals, at - self._at, m.inflight, m.itl.bounds)
        if advance:
            self._totals, self._at = now_totals, at
        now, wall = instance_now(), time.time()
        views = [instance_view(inst, now, wall) for inst in self.membership.instances()]
        return {"id": self.id, "identity": self.identity, "published": round(wall, 3), "interval": self.interval,
                "stopping": stopping, "traffic": moved, "instances": instance_states(views)}

    def _key(self) -> bytes:
        return self.store.key(b"gateway", _id_bytes(self.id))

    def _bucket(self, wall: float) -> bytes:
        return self.store.key(b"gateway-ids", _id_bytes(int(wall // BUCKET)))

    async def publish(self, stopping: bool = False) -> bool:
        """One summary out; whether the store took it."""
        summary = self._summary(stopping)
        stored, _ = await self.store.put(self._key(), msgspec.json.encode(summary), KEEP)
        if stored:
            await self.store.add(self._bucket(summary["published"]), self.id, BUCKET_KEEP)
            self.published += 1
        else:
            self.failures["publish"] += 1
        return stored

    async def _run(self) -> None:
        while True:
            try:
                await self.publish()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a summary is never worth the timer
                self.failures["publish"] += 1
                log.exception("gateway summary not published")
            await asyncio.sleep(self.interval)

    async def view(self) -> dict:
        """Every replica's summary as the console shows it (``gateway_view.gateway``)."""
        if self._view is not None and time.monotonic() - self._read_at < self.read_every:
            return self._view
        store = self.store
        wall = time.time()
        ids: set[int] = set()
        ok = store.up
        for bucket in (self._bucket(wall), self._bucket(wall - BUCKET)):
            ids.update(await store.members(bucket))
        ids.add(self.id)
        order = sorted(ids)
        found = await store.get_many([store.key(b"gateway", _id_bytes(i)) for i in order])
        ok = ok and store.up
        summaries = []
        for raw in found:
            if raw is None:
                continue
            try:
                summaries.append(msgspec.json.decode(raw))
            except msgspec.DecodeError:
                continue
        if not ok:
            self.failures["read"] += 1
        if not ok or not any(s["id"] == self.id for s in summaries):
            summaries = [s for s in summaries if s["id"] != self.id]
            summaries.append(self._summary(advance=False))  # this process, as it knows itself now
        shown = {"kind": store.kind, "up": store.up, "down_since": store.down_since}  # not its address
        doc = gateway(summaries, time.time(), self.id, shown, self.failures)
        doc["store_answered"] = ok
        self._view, self._read_at = doc, time.monotonic()
        return doc

    async def close(self) -> None:
        """Stop publishing; a last summary says so (its readers show it shut down, not lost)."""
        if self._task is None:
            await self.store.close()
            return
        self._task.cancel()
        try:
            await self._task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001
            pass
        self._task = None
        if self.store.up and not self.store.closed:
            await self.publish(stopping=True)
        await self.store.close()  # its probe, if any (the store itself is the request path's)
