"""Shared test helpers: a proxy in front of a simulated cluster, and a small client."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.config import StageTimeouts
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimCluster, SimConfig

JSON = [(b"content-type", b"application/json")]


@contextlib.asynccontextmanager
async def stack(encode=0, prefill=1, decode=1, pd=0, sim: SimConfig | None = None, **proxy_kwargs):
    """A simulated cluster and a proxy in front of it; yields (cluster, proxy, client)."""
    sim = sim or SimConfig(itl_ms=0, ttft_ms=0.5)
    # Like probes, the background /metrics scrape is off unless a test asks for it: the
    # simulator records every request, and tests count records.
    proxy_kwargs.setdefault("scrape_interval", 0)
    async with SimCluster(encode=encode, prefill=prefill, decode=decode, pd=pd, config=sim) as cluster:
        base = ProxyConfig(probe_interval=0, **proxy_kwargs)
        async with await start_proxy(config_for_cluster(cluster, base)) as proxy:
            client = Client(proxy.url)
            try:
                yield cluster, proxy, client
            finally:
                await client.close()


class Reply:
    def __init__(self, status: int, headers: dict, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return msgspec.json.decode(self.body)

    @property
    def events(self) -> list[bytes]:
        return [e for e in self.body.split(b"\n\n") if e]

    def text(self) -> str:
        """The generated text, from a chat/completion body or its SSE events."""
        if self.headers.get(b"content-type", b"").startswith(b"text/event-stream"):
            out = []
            for event in self.events:
                data = event[len(b"data: "):]
                if data == b"[DONE]":
                    continue
                obj = msgspec.json.decode(data)
                for choice in obj.get("choices") or []:
                    if "delta" in choice:
                        out.append(choice["delta"].get("content") or "")
                    else:
                        out.append(choice.get("text") or "")
            return "".join(out)
        obj = self.json()
        choice = obj["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]


class Client:
    def __init__(self, url: str) -> None:
        self.pool = ConnectionPool(url)

    async def request(self, method: str, path: str, body: bytes = b"", headers=None,
                      timeout: float = 10.0) -> Reply:
        t = TransportTimeouts(connect=timeout, headers=timeout, idle=timeout)
        resp = await self.pool.request(method, path, body=body, headers=headers, timeouts=t)
        try:
            data = await resp.read()
        finally:
            resp.close()
        return Reply(resp.status, resp.headers, data)

    async def post(self, path: str, body, headers=None, **kw) -> Reply:
        raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
        return await self.request("POST", path, raw, JSON + list(headers or []), **kw)

    async def chat(self, body, headers=None, **kw) -> Reply:
        return await self.post("/v1/chat/completions", body, headers, **kw)

    async def close(self) -> None:
        await self.pool.close()


def chat_body(text="Hello there, how are you?", *, stream=False, max_tokens=8, images=(), **extra) -> dict:
    content = [{"type": "text", "text": text}] + [
        {"type": "image_url", "image_url": {"url": url}} for url in images]
    body = {"model": "sim-model", "messages": [{"role": "user", "content": content if images else text}],
            "max_tokens": max_tokens, "stream": stream}
    body.update(extra)
    return body


async def wait_for(predicate, timeout: float = 5.0, interval: float = 0.01) -> None:
    """Poll until ``predicate()`` is true (state that settles asynchronously, e.g. an abort
    reaching the simulator); fails the test on timeout."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)


async def probe_round(pool, timeout: float) -> None:
    """One health probe of every instance of ``pool`` at once, as its probe loops would send
    them: a test moves instances in or out of rotation without waiting for an interval."""
    await asyncio.gather(*(pool.checks.probe(inst, timeout) for inst in pool.instances))


__all__ = ["stack", "Client", "Reply", "chat_body", "wait_for", "probe_round", "StageTimeouts"]
