"""The store on Redis or Valkey (the same protocol), through ``redis.asyncio`` with the
``hiredis`` parser. A single server (or a primary with replicas behind Sentinel's address):
a take with a mark is one Lua script over two keys, which Redis Cluster would need in one slot.

``redis://host:port/db`` or ``rediss://`` (TLS); the password from the operator's
configuration only (``--state-store-password-file`` or ``$EPD_PROXY_STATE_STORE_PASSWORD``),
never from the URL a client could see in ``/status`` (the URL is shown without it)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

# GETDEL, and the mark set in the same step (Redis 6.2 and later; Valkey).
_TAKE = """
local v = redis.call('GETDEL', KEYS[1])
if v then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
  return {1, v}
end
return {0, redis.call('EXISTS', KEYS[2])}
"""


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def safe_url(url: str) -> str:
    """``url`` without any user or password (what ``/status`` and the logs show)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class RedisStore:
    """The store's interface on one Redis/Valkey server; every call bounded by ``timeout``
    (connect included: a dead server is found out within the budget)."""

    kind = "redis"

    def __init__(self, url: str, password: str | None, timeout: float) -> None:
        import redis.asyncio as aioredis  # only a proxy configured with a store loads it

        self.url = safe_url(url)
        self.client: Any = aioredis.Redis.from_url(url, password=password or None, socket_timeout=timeout,
                                              socket_connect_timeout=timeout, retry_on_timeout=False,
                                              health_check_interval=0, decode_responses=False)
        self._take = self.client.register_script(_TAKE)

    async def get(self, key: bytes) -> bytes | None:
        return await self.client.get(key)

    async def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return await self.client.mget(keys)

    async def put(self, key: bytes, value: bytes, ttl: float, old: bool = False) -> bytes | None:
        result = await self.client.set(key, value, px=_ms(ttl), get=old)
        return result if old else None

    async def take(self, key: bytes, mark: bytes | None = None, mark_ttl: float = 0.0
                   ) -> tuple[bytes | None, bool]:
        if mark is None:
            return await self.client.getdel(key), False
        found, value = await self._take(keys=[key, mark], args=[_ms(mark_ttl)])
        return (value, False) if found == 1 else (None, bool(value))

    async def incr(self, key: bytes, delta: int, ttl: float) -> int:
        from redis.exceptions import ResponseError

        try:
            async with self.client.pipeline(transaction=True) as pipe:
                n, _ = await pipe.incrby(key, delta).pexpire(key, _ms(ttl)).execute()
        except ResponseError as exc:
            if "not an integer" not in str(exc):
                raise
            # A counter someone overwrote (the store is untrusted input): counted anew from here.
            await self.client.set(key, delta, px=_ms(ttl))
            return delta
        return int(n)

    async def claim(self, key: bytes, value: bytes, ttl: float) -> bool:
        return bool(await self.client.set(key, value, px=_ms(ttl), nx=True))

    async def add(self, key: bytes, member: int, ttl: float) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            await pipe.sadd(key, member).pexpire(key, _ms(ttl)).execute()

    async def members(self, key: bytes) -> list[int]:
        # Members that are not integers are someone else's writing: not members (read_back.py).
        return sorted(int(m) for m in await self.client.smembers(key) if m.lstrip(b"-").isdigit() and len(m) < 20)

    async def ping(self) -> None:
        await self.client.ping()

    async def close(self) -> None:
        await self.client.aclose()
