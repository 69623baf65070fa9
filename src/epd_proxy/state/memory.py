"""The in-process store: a dict with deadlines. ``MemoryTable`` is the pure core (the clock
passed in), used by one process (``MemoryStore``) and, with ``--workers``, by the parent
for all its workers (``parent.py``)."""

from __future__ import annotations

import time


class MemoryTable:
    """Keys to values (bytes, ints or sets of ints), each until its deadline; at most
    ``capacity`` keys and ``max_bytes`` of byte values (expired ones swept first, then the
    oldest written)."""

    def __init__(self, capacity: int = 262144, max_bytes: int = 512 << 20) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0  # of the byte values held
        self._data: dict[bytes, tuple[object, float]] = {}

    def _drop(self, key: bytes) -> object:
        value, _ = self._data.pop(key)
        if isinstance(value, bytes):
            self.bytes -= len(value)
        return value

    def __len__(self) -> int:
        return len(self._data)

    def _live(self, key: bytes, now: float) -> object:
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] <= now:
            self._drop(key)
            return None
        return item[0]

    def _set(self, key: bytes, value: object, ttl: float, now: float) -> None:
        data = self._data
        if key in data:
            self._drop(key)  # written last: the last to go
        data[key] = (value, now + ttl)
        if isinstance(value, bytes):
            self.bytes += len(value)
        if len(data) > self.capacity or self.bytes > self.max_bytes:
            for k in [k for k, (_, d) in data.items() if d <= now]:
                self._drop(k)
            while data and (len(data) > self.capacity or self.bytes > self.max_bytes):
                self._drop(next(iter(data)))

    def get(self, key: bytes, now: float) -> bytes | None:
        value = self._live(key, now)
        return value if isinstance(value, bytes) else None

    def get_many(self, keys: list[bytes], now: float) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            v = self._live(k, now)
            out.append(str(v).encode() if isinstance(v, int) else v if isinstance(v, bytes) else None)
        return out

    def put(self, key: bytes, value: bytes, ttl: float, old: bool, now: float) -> bytes | None:
        prev = self.get(key, now) if old else None
        self._set(key, value, ttl, now)
        return prev

    def take(self, key: bytes, mark: bytes | None, mark_ttl: float, now: float) -> tuple[bytes | None, bool]:
        value = self._live(key, now)
        if isinstance(value, bytes):
            self._drop(key)
            if mark is not None:
                self._set(mark, b"1", mark_ttl, now)
            return value, False
        return None, mark is not None and self._live(mark, now) is not None

    def incr(self, key: bytes, delta: int, ttl: float, now: float) -> int:
        value = self._live(key, now)
        n = (value if isinstance(value, int) else 0) + delta
        self._set(key, n, ttl, now)
        return n

    def claim(self, key: bytes, value: bytes, ttl: float, now: float) -> bool:
        if self._live(key, now) is not None:
            return False
        self._set(key, value, ttl, now)
        return True

    def add(self, key: bytes, member: int, ttl: float, now: float) -> None:
        value = self._live(key, now)
        members = value if isinstance(value, set) else set()
        members.add(member)
        self._set(key, members, ttl, now)

    def members(self, key: bytes, now: float) -> list[int]:
        value = self._live(key, now)
        return sorted(value) if isinstance(value, set) else []


class MemoryStore:
    """``MemoryTable`` behind the store's interface, for one process."""

    kind = "memory"

    def __init__(self, capacity: int = 262144) -> None:
        self.table = MemoryTable(capacity)

    async def get(self, key: bytes) -> bytes | None:
        return self.table.get(key, time.monotonic())

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return self.table.get_many(keys, time.monotonic())

    async def put(self, key: bytes, value: bytes, ttl: float, old: bool = False) -> bytes | None:
        return self.table.put(key, value, ttl, old, time.monotonic())

    async def take(self, key: bytes, mark: bytes | None = None, mark_ttl: float = 0.0
                   ) -> tuple[bytes | None, bool]:
        return self.table.take(key, mark, mark_ttl, time.monotonic())

    async def incr(self, key: bytes, delta: int, ttl: float) -> int:
        return self.table.incr(key, delta, ttl, time.monotonic())

    async def claim(self, key: bytes, value: bytes, ttl: float) -> bool:
        return self.table.claim(key, value, ttl, time.monotonic())

    async def add(self, key: bytes, member: int, ttl: float) -> None:
        self.table.add(key, member, ttl, time.monotonic())

    async def members(self, key: bytes) -> list[int]:
        return self.table.members(key, time.monotonic())

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
