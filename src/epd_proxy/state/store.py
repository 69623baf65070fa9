"""The state store's interface: what the proxy's shared state needs of a store, and no more.

Derived from its uses: a conversation's kept parameters are ``put`` with a TTL and ``take``-n
at most once (a mark remembers the take, so a second use is told from an unknown history);
the conversation's latest turn is swapped (``put`` returning the old value); a prompt API's
held lengths are a set (``add``, ``members``); held tokens per decode are counters
(``incr``, ``get_many``); a Responses id's owner is ``put`` and ``get``; an adapter load in
flight on an instance is a ``claim`` (set only if not set), ``take``-n when it is done. Values are bytes;
keys are bytes the proxy derives (digests, never a client's text). Every method may raise
:class:`StoreError` (or the client's own errors): ``guard.GuardedStore`` turns any failure
into "not known", so a lost store costs reuse, never an answer.
"""

from __future__ import annotations

from typing import Protocol


class StoreError(Exception):
    """The store did not answer as asked (down, slow past the budget, refused)."""


class StateStore(Protocol):
    """An asynchronous key-value store with TTLs (in-process, the ``--workers`` parent, or
    Redis/Valkey)."""

    kind: str  # "memory", "parent", "redis": what /status shows

    async def get(self, key: bytes) -> bytes | None: ...

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]: ...

    async def put(self, key: bytes, value: bytes, ttl: float, old: bool = False) -> bytes | None:
        """Set ``key`` for ``ttl`` seconds; with ``old``, return the value it replaced."""

    async def take(self, key: bytes, mark: bytes | None = None, mark_ttl: float = 0.0
                   ) -> tuple[bytes | None, bool]:
        """Remove and return ``key``'s value, atomically: of concurrent callers one gets it.
        With ``mark``: a taken value leaves ``mark`` set for ``mark_ttl``, and a miss says
        whether ``mark`` is set (an earlier take)."""

    async def incr(self, key: bytes, delta: int, ttl: float) -> int: ...

    async def claim(self, key: bytes, value: bytes, ttl: float) -> bool:
        """Set ``key`` for ``ttl`` only if it is not set; whether this call set it."""

    async def add(self, key: bytes, member: int, ttl: float) -> None: ...

    async def members(self, key: bytes) -> list[int]: ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...
