"""The limits' counters in Redis (or Valkey), shared by every process and replica.

One script call per request decides and counts atomically (Envoy's rate-limit service
does the same with INCRBY and EXPIRE per counter): it reads every counter the request
touches, and only if all have room (``limits.fits``, written again in Lua) adds to each
and gives a new window's counter its expiry. Settling an answer's tokens is a second
script call, off the request's path. All of one key's counters share a hash tag, so the
script runs on one Redis Cluster slot.

Every call is bounded by the store's timeout; a failure raises ``StoreUnavailable`` and
the limiter fails open or closed as configured.
"""

from __future__ import annotations

import asyncio
from typing import Any

from epd_proxy.tenants.counters import StoreUnavailable
from epd_proxy.tenants.limits import Hit

# KEYS: the counters; ARGV: amount, limit, ttl per counter. Returns {ok, value...}.
TAKE = """
local n = #KEYS
local values = {}
local ok = 1
for i = 1, n do
  local cur = tonumber(redis.call('GET', KEYS[i]) or '0')
  values[i] = cur
  local amount, limit = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1])
  if not (cur < limit and (cur == 0 or cur + amount <= limit)) then ok = 0 end
end
if ok == 1 then
  for i = 1, n do
    local amount = tonumber(ARGV[3 * i - 2])
    if amount ~= 0 then
      values[i] = redis.call('INCRBY', KEYS[i], amount)
      if redis.call('TTL', KEYS[i]) < 0 then redis.call('EXPIRE', KEYS[i], ARGV[3 * i]) end
    end
  end
end
table.insert(values, 1, ok)
return values
"""

# KEYS: the counters; ARGV: amount, ttl per counter.
ADD = """
for i = 1, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[2 * i - 1])
  if redis.call('TTL', KEYS[i]) < 0 then redis.call('EXPIRE', KEYS[i], ARGV[2 * i]) end
end
return 1
"""


def redis_client(url: str, timeout: float, password: str | None = None) -> Any:
    """A ``redis.asyncio`` client for ``url``, every call bounded by ``timeout`` seconds."""
    import redis.asyncio as redis

    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                health_check_interval=0, retry_on_timeout=False, password=password)


class RedisCounters:
    """The :class:`~epd_proxy.tenants.counters.Counters` of a ``redis.asyncio.Redis`` client."""

    def __init__(self, client: Any, timeout: float = 0.25) -> None:
        self.client = client
        self.timeout = timeout
        self._take = client.register_script(TAKE)
        self._add = client.register_script(ADD)

    async def _call(self, script, keys: list[str], args: list) -> Any:
        from redis.exceptions import RedisError

        try:
            async with asyncio.timeout(self.timeout):
                return await script(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None

    async def take(self, hits: list[Hit]) -> tuple[bool, list[int]]:
        if not hits:
            return True, []
        args: list = []
        for h in hits:
            args += [h.amount, h.limit, h.ttl]
        out = await self._call(self._take, [h.key for h in hits], args)
        return bool(out[0]), [int(v) for v in out[1:]]

    async def add(self, adds: list[tuple[Hit, int]]) -> None:
        if not adds:
            return
        args: list = []
        for hit, amount in adds:
            args += [amount, hit.ttl]
        await self._call(self._add, [hit.key for hit, _ in adds], args)

    async def read(self, hits: list[Hit]) -> list[int]:
        if not hits:
            return []
        from redis.exceptions import RedisError

        try:
            async with asyncio.timeout(self.timeout):
                values = await self.client.mget([h.key for h in hits])
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
        return [int(v) if v is not None else 0 for v in values]

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except Exception:  # closing a client whose server is gone
            pass
