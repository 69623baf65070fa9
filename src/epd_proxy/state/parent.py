"""``--workers N`` without an external store: the parent process holds one ``MemoryTable``
for all its workers, asked over the channel each worker already has to it
(``runtime/workers.py``: one ``SOCK_SEQPACKET`` datagram each way per call).

Chosen over shared memory (a hash table with locks and an allocator across processes, for
values of a few KiB: much code for what a datagram does in tens of microseconds) and over the
parent running an embedded server (a second program every deployment would need). The
parent's loop answers a call as it reads it; nothing else runs in the parent per request.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec

from epd_proxy.state.memory import MemoryTable
from epd_proxy.state.store import StoreError

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


class Link(Protocol):
    """The worker's channel to the parent (``runtime.workers.PeerLink``)."""

    async def store_call(self, request: bytes) -> bytes | None: ...


class ParentStore:
    """The store's interface over the channel to the parent (a worker's side)."""

    kind = "parent"

    def __init__(self, link: Link) -> None:
        self.link = link

    async def _call(self, op: str, *args: object) -> object:
        answer = await self.link.store_call(_encode([op, *args]))
        if answer is None:
            raise StoreError("the parent did not answer")
        ok, result = _decode(answer)
        if not ok:
            raise StoreError(str(result))
        return result

    async def get(self, key: bytes) -> bytes | None:
        return await self._call("get", key)  # type: ignore[return-value]

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return await self._call("get_many", keys)  # type: ignore[return-value]

    async def put(self, key: bytes, value: bytes, ttl: float, old: bool = False) -> bytes | None:
        return await self._call("put", key, value, ttl, old)  # type: ignore[return-value]

    async def take(self, key: bytes, mark: bytes | None = None, mark_ttl: float = 0.0
                   ) -> tuple[bytes | None, bool]:
        found: Any = await self._call("take", key, mark, mark_ttl)
        return found[0], bool(found[1])

    async def incr(self, key: bytes, delta: int, ttl: float) -> int:
        return await self._call("incr", key, delta, ttl)  # type: ignore[return-value]

    async def claim(self, key: bytes, value: bytes, ttl: float) -> bool:
        return bool(await self._call("claim", key, value, ttl))

    async def add(self, key: bytes, member: int, ttl: float) -> None:
        await self._call("add", key, member, ttl)

    async def members(self, key: bytes) -> list[int]:
        return await self._call("members", key)  # type: ignore[return-value]

    async def ping(self) -> None:
        await self._call("ping")

    async def close(self) -> None:
        return None


_OPS = frozenset(("get", "get_many", "put", "take", "incr", "claim", "add", "members"))


def answer(table: MemoryTable, request: bytes, now: float | None = None) -> bytes:
    """The parent's side: one call on ``table``, its result encoded (``[ok, result]``)."""
    try:
        op, *args = _decode(request)
        if op == "ping":
            return _encode([True, None])
        if op not in _OPS:
            return _encode([False, f"unknown operation {op!r}"])
        result = getattr(table, op)(*args, time.monotonic() if now is None else now)
        return _encode([True, result])
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        return _encode([False, str(exc)])
