"""The store as the request path sees it: every call within a budget, every failure an
answer of "not known" (the plain path: same answers, no reuse), counted and shown, and a
circuit breaker, so that a dead store costs nothing per request.

After a failure the store is not called for :data:`PROBE_INTERVAL` (one second); then a
background ``PING`` within the budget, every second until one succeeds, closes the breaker.
No request ever waits on a store that has just failed."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, TypeVar

from epd_proxy.state.store import StateStore

log = logging.getLogger("epd_proxy.state")

PROBE_INTERVAL = 1.0
T = TypeVar("T")


class GuardedStore:
    """``store`` with a budget per call (``timeout`` seconds), keys under ``prefix``, the
    error counts by operation and the breaker."""

    def __init__(self, store: StateStore, prefix: str, timeout: float, url: str = "", owns: bool = True) -> None:
        self.store = store
        self.owns = owns  # closing this guard closes the store (False: another guard's store, own breaker)
        self.prefix = prefix.encode()
        self.timeout = timeout
        self.url = url
        self.kind = store.kind
        self.up = True
        self.down_since: float | None = None  # wall clock, for /status
        self.errors: dict[str, int] = {}
        # Entries read back that failed the reader's checks, by entry: the store is untrusted input.
        self.invalids: dict[str, int] = {}
        self.calls = 0
        self.closed = False  # the proxy is stopping: background writes still due are dropped
        self._probe: asyncio.Task | None = None

    def key(self, kind: bytes, digest: bytes) -> bytes:
        """The store key for a digest the proxy derived (never a client's text)."""
        return self.prefix + kind + b":" + digest.hex().encode()

    async def _call(self, op: str, call: Callable[[], Awaitable[T]], default: T) -> T:
        if not self.up or self.closed:
            return default
        self.calls += 1
        try:
            async with asyncio.timeout(self.timeout):
                return await call()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the store is "not known"
            self._failed(op, exc)
            return default

    def _failed(self, op: str, exc: BaseException) -> None:
        if self.closed:
            return
        self.errors[op] = self.errors.get(op, 0) + 1
        if self.up:
            self.up = False
            self.down_since = time.time()
            log.warning("state store %s failed (%s: %s): going on without it, probing every %.0f s",
                        self.url or self.kind, op, type(exc).__name__ if not str(exc) else exc, PROBE_INTERVAL)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        while not self.up:
            await asyncio.sleep(PROBE_INTERVAL)
            try:
                async with asyncio.timeout(self.timeout):
                    await self.store.ping()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                self.errors["ping"] = self.errors.get("ping", 0) + 1
                continue
            self.up = True
            log.warning("state store %s answers again (down %.1f s)", self.url or self.kind,
                        time.time() - (self.down_since or time.time()))
            self.down_since = None

    async def get(self, key: bytes) -> bytes | None:
        return await self._call("get", lambda: self.store.get(key), None)

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return await self._call("get_many", lambda: self.store.get_many(keys), [None] * len(keys))

    async def put(self, key: bytes, value: bytes, ttl: float, old: bool = False) -> tuple[bool, bytes | None]:
        """Whether it was stored, and (with ``old``) the value it replaced."""
        async def call() -> tuple[bool, bytes | None]:
            return True, await self.store.put(key, value, ttl, old)
        return await self._call("put", call, (False, None))

    async def take(self, key: bytes, mark: bytes | None = None, mark_ttl: float = 0.0
                   ) -> tuple[bytes | None, bool]:
        return await self._call("take", lambda: self.store.take(key, mark, mark_ttl), (None, False))

    async def incr(self, key: bytes, delta: int, ttl: float) -> int | None:
        return await self._call("incr", lambda: self.store.incr(key, delta, ttl), None)

    async def claim(self, key: bytes, value: bytes, ttl: float) -> bool:
        """Whether this call set ``key``; True when the store cannot say (each goes on by itself)."""
        return await self._call("claim", lambda: self.store.claim(key, value, ttl), True)

    async def add(self, key: bytes, member: int, ttl: float) -> None:
        await self._call("add", lambda: self.store.add(key, member, ttl), None)

    async def members(self, key: bytes) -> list[int]:
        return await self._call("members", lambda: self.store.members(key), [])

    def invalid(self, entry: str) -> None:
        """An entry read back failed its reader's checks (it is a miss): counted for /metrics."""
        self.invalids[entry] = self.invalids.get(entry, 0) + 1

    def status(self) -> dict:
        """What ``/status`` shows of the store."""
        return {"kind": self.kind, "url": self.url or None, "up": self.up, "down_since": self.down_since,
                "timeout": self.timeout, "errors": dict(self.errors)}

    async def close(self) -> None:
        self.closed = True
        if self._probe is not None:
            self._probe.cancel()
            try:
                await self._probe
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self.owns:
            await self.store.close()


def state_collector(store: GuardedStore | None) -> Callable[[dict[str, list]], None]:
    """What the store tells ``/metrics`` (``epd_proxy_state_store_*``)."""
    def collect(f: dict[str, list]) -> None:
        if store is None:
            return
        f["epd_proxy_state_store_errors"] += [[op, n] for op, n in store.errors.items()]
        f["epd_proxy_state_store_up"] += [[store.kind, 1 if store.up else 0]]
        f["epd_proxy_state_store_invalid"] += [[e, n] for e, n in store.invalids.items()]
    return collect
