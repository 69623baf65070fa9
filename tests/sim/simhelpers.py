"""Helpers for the simulator's own tests (imported as ``simhelpers``): real loopback sockets,
the project's HTTP client."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec

from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts
from epd_proxy.sim import SimConfig

JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass
class Reply:
    status: int
    headers: dict
    data: bytes

    @property
    def json(self):
        return msgspec.json.decode(self.data)

    @property
    def events(self) -> list:
        return sse_events(self.data)


def sse_events(data: bytes) -> list:
    """``data:`` payloads of an SSE body: dicts, and the string "[DONE]"."""
    out = []
    for block in data.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        payload = block[6:]
        out.append("[DONE]" if payload == b"[DONE]" else msgspec.json.decode(payload))
    return out


def named_events(data: bytes) -> list[tuple[str, dict]]:
    """(name, payload) of each event of an SSE body of named events (``event:`` then ``data:``)."""
    out = []
    for block in data.split(b"\n\n"):
        if not block:
            continue
        head, _, payload = block.partition(b"\n")
        assert head.startswith(b"event: ") and payload.startswith(b"data: "), block
        out.append((head[7:].decode(), msgspec.json.decode(payload[6:])))
    return out


def nixl_prefill_params() -> dict:
    """The ``kv_transfer_params`` a proxy sends a NIXL prefill (docs/protocol.md §2.3)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def stream_text(events: list, choice: int = 0) -> str:
    parts = []
    for ev in events:
        if not isinstance(ev, dict) or "choices" not in ev:
            continue
        for ch in ev["choices"]:
            if ch["index"] != choice:
                continue
            if "delta" in ch:
                parts.append(ch["delta"].get("content") or "")
            else:
                parts.append(ch.get("text") or "")
    return "".join(parts)


class Http:
    """One keep-alive pool per base URL; closed at the end of the test."""

    def __init__(self) -> None:
        self.pools: dict[str, ConnectionPool] = {}

    def pool(self, url: str) -> ConnectionPool:
        p = self.pools.get(url)
        if p is None:
            p = self.pools[url] = ConnectionPool(url)
        return p

    async def request(self, method: str, url: str, path: str, body=None, *, headers=None,
                      timeouts: TransportTimeouts | None = None, raw: bytes | None = None) -> Reply:
        hdrs = list(headers or [])
        data = raw if raw is not None else (msgspec.json.encode(body) if body is not None else b"")
        if body is not None and not any(h[0] == b"content-type" for h in hdrs):
            hdrs += JSON_HEADERS
        resp = await self.pool(url).request(method, path, body=data, headers=hdrs, timeouts=timeouts)
        try:
            out = await resp.read()
        finally:
            resp.close()
        return Reply(resp.status, resp.headers, out)

    async def post(self, url: str, path: str, body, **kw) -> Reply:
        return await self.request("POST", url, path, body, **kw)

    async def chat(self, url: str, body: dict, *, rid: str | None = None, fault: str | None = None,
                   headers=None, **kw) -> Reply:
        hdrs = list(headers or [])
        if rid is not None:
            hdrs.append((b"x-request-id", rid.encode()))
        if fault is not None:
            hdrs.append((b"x-sim-fault", fault.encode()))
        return await self.post(url, "/v1/chat/completions", body, headers=hdrs, **kw)

    async def completion(self, url: str, body: dict, *, rid: str | None = None, **kw) -> Reply:
        hdrs = [(b"x-request-id", rid.encode())] if rid else []
        return await self.post(url, "/v1/completions", body, headers=hdrs, **kw)

    async def get(self, url: str, path: str, **kw) -> Reply:
        return await self.request("GET", url, path, **kw)

    async def close(self) -> None:
        for p in self.pools.values():
            await p.close()


def fast_config(**kw) -> SimConfig:
    """Tiny latencies so a test takes milliseconds."""
    base = dict(ttft_ms=1.0, ttft_per_token_ms=0.0, itl_ms=0.5, encode_ms_per_item=0.5, kv_load_ms=0.1,
                kv_abort_timeout=5.0, push_registration_timeout=2.0, kv_side_channel_timeout=2.0)
    base.update(kw)
    return SimConfig(**base)


def chat_body(text: str = "tell me about the simulator", **kw) -> dict:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": text}]}
    body.update(kw)
    return body


def prefill_body(body: dict, transfer_id: str | None = None) -> dict:
    """What a correct proxy sends to P (docs/protocol.md §2.3, §2.4)."""
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(k, None)
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
          "remote_block_ids": None, "remote_host": None, "remote_port": None}
    if transfer_id is not None:
        kv["transfer_id"] = transfer_id
    out["kv_transfer_params"] = kv
    return out


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples in a Prometheus text page."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == name or key.startswith(name + "{"):
            total += float(value)
            found = True
    assert found, f"metric {name} not exported"
    return total


class Pieces:
    """A relay sink that keeps each body piece with its arrival time."""

    def __init__(self) -> None:
        self.pieces: list[tuple[float, bytes]] = []
        self.done = asyncio.get_running_loop().create_future()

    def on_data(self, data: bytes) -> None:
        self.pieces.append((time.monotonic(), data))

    def on_end(self) -> None:
        self.done.set_result(None)

    def on_error(self, exc: Exception) -> None:
        self.done.set_exception(exc)

    @property
    def data(self) -> bytes:
        return b"".join(p for _, p in self.pieces)


async def stream_pieces(url: str, body: dict, fault: str | None = None) -> tuple[Pieces, Exception | None]:
    pool = ConnectionPool(url)
    try:
        headers = list(JSON_HEADERS) + ([(b"x-sim-fault", fault.encode())] if fault else [])
        resp = await pool.request("POST", "/v1/chat/completions", body=msgspec.json.encode(body), headers=headers)
        sink = Pieces()
        resp.relay(sink)
        try:
            await sink.done
            err = None
        except Exception as exc:  # noqa: BLE001
            err = exc
        return sink, err
    finally:
        await pool.close()


def push_decode_params(ident: dict, transfer_id: str, rid: str = "req-1") -> dict:
    """What a push proxy sends D: P's identity, no block ids (docs/protocol.md §2.4)."""
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": ident["engine_id"],
            "remote_host": ident["kv_host"], "remote_port": ident["kv_port"], "tp_size": ident["tp"],
            "pp_size": ident["pp"], "remote_request_id": rid, "transfer_id": transfer_id}


# vLLM's only words about a generation failure (KV or EC load, injected error): the 500 body
# (JSONResponse, compact) and the in-band event (json.dumps, with its spacing).
GENERIC_500 = b'{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}'
GENERIC_EVENT = (b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
                 b'"param": null, "code": 500}}\n\n')


def failure(reply: Reply, instance) -> str:
    """Check that ``reply`` is vLLM's generation failure (a 500, or a stream ending in the
    in-band error and ``[DONE]``); return the simulator's reason, from the instance's record."""
    if reply.status == 500:
        assert reply.data == GENERIC_500, reply.data
    else:
        assert reply.status == 200, reply.status
        assert reply.data.endswith(GENERIC_EVENT + b"data: [DONE]\n\n"), reply.data
    rec = instance.generation_records()[-1]
    assert rec.error, rec
    return rec.error
