"""The KV side channel between simulated instances: a prefill holds the KV it computed
for a decoder, and a decoder loads it over HTTP.

A prefill's KV "lives" in the prefill instance's memory. It advertises its own HTTP
host and port as ``remote_host`` / ``remote_port`` in ``kv_transfer_params`` (that is
its NIXL side channel), and the decode talks to it over HTTP on paths under
``/sim/kv/``, so the hand-off works across processes:

* ``POST /sim/kv/pull`` ``{remote_request_id, remote_block_ids, remote_engine_id,
  prompt_hash, consumer}`` (NIXL pull) -> 200 ``{num_tokens, block_ids}`` and the
  blocks are freed; 404 when the engine id is wrong or nothing is held for that
  request (never produced, already pulled, expired); 409 when the block ids or the
  prompt differ.
* ``POST /sim/kv/push/register`` ``{transfer_id, remote_engine_id, remote_request_id,
  prompt_hash, timeout, consumer}`` (NIXL push and Mooncake; for Mooncake it goes to
  ``remote_bootstrap_addr``) -> the request waits until the prefill with that
  ``transfer_id`` has finished and "pushes" (200 ``{num_tokens}``), or answers 408
  after ``timeout`` seconds. A prefill that finishes first keeps the push offer (held
  blocks) until a registration arrives or ``kv_abort_timeout`` expires.

Every hand-off step is appended to :attr:`KvSideChannel.log` (the instance's
``side_channel_log``): a trace of this simulator's transfers, not vLLM's KV cache
events.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import msgspec

from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.sim.config import SimConfig
from epd_proxy.sim.records import Stats
from epd_proxy.sim.responses import JSON

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_LOAD_FAILED = "KV load failed (kv_load_failure_policy=fail): "
# What kv_transfer_params must name for a decode to find the KV, per connector.
_NEEDED = {
    "nixl": ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port"),
    "nixl-push": ("remote_engine_id", "remote_host", "remote_port", "tp_size", "transfer_id"),
    "mooncake": ("remote_bootstrap_addr", "remote_engine_id", "transfer_id"),
}


def flat_ints(value: Any) -> list:
    """Block ids as one flat list (``[[1, 2], [3]]`` and ``[1, 2, 3]`` compare equal)."""
    if not isinstance(value, list):
        return [value]
    out: list = []
    for v in value:
        if isinstance(v, list):
            out.extend(flat_ints(v))
        else:
            out.append(v)
    return out


@dataclass(slots=True)
class HeldKV:
    """KV blocks a prefill keeps for a decoder."""

    request_id: str
    block_ids: list[int]
    prompt_hash: str
    num_tokens: int
    transfer_id: str | None
    t_created: float
    timer: asyncio.TimerHandle | None = None
    wrong: bool = False  # computed over another prompt's KV (bidirectional misuse): a wrong answer


class KvOwner(Protocol):
    """What the side channel reads of the instance it belongs to (``SimInstance``): its
    identity and advertised addresses, its config and counters. Named here, not in
    ``host.py``, which imports this module to type the instance's ``kv``."""

    name: str
    engine_id: str
    config: SimConfig
    stats: Stats

    @property
    def kv_host(self) -> str: ...

    @property
    def kv_port(self) -> int: ...

    @property
    def bootstrap_addr(self) -> str | None: ...


class KvSideChannel:
    """Both ends of one instance's KV hand-off: what it holds as a producer (held blocks,
    push offers, decoders waiting for a push) and its connections as a consumer."""

    def __init__(self, inst: KvOwner) -> None:
        # The instance gives the identity (engine id, advertised address) and the counters.
        self.inst = inst
        self.config = inst.config
        self.stats = inst.stats
        self.log: deque[dict] = deque(maxlen=10_000)
        self.held_blocks = 0
        self._next_block = 1
        self._held: dict[str, HeldKV] = {}
        self._push_offers: dict[str, HeldKV] = {}
        self._push_waiters: dict[str, tuple[asyncio.Future, str | None]] = {}
        self._pools: dict[str, ConnectionPool] = {}
        self.on_free: Callable[[], None] | None = None  # held blocks freed: the engine admits what fits

    @property
    def held_requests(self) -> int:
        return len(self._held) + len(self._push_offers)

    def held(self) -> list[HeldKV]:
        return list(self._held.values()) + list(self._push_offers.values())

    def push_waiters(self) -> list[str]:
        return list(self._push_waiters)

    def drop(self) -> None:
        """Lose everything held (the instance crashed or stopped)."""
        for held in self.held():
            if held.timer is not None:
                held.timer.cancel()
        self._held.clear()
        self._push_offers.clear()
        self.held_blocks = 0
        for fut, _ in list(self._push_waiters.values()):
            if not fut.done():
                fut.cancel()
        self._push_waiters.clear()

    async def close_pools(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            await p.close()

    # -- producer (prefill) --------------------------------------------------------------
    def produce(self, internal_id: str, prompt_tokens: int, prompt_hash: str, transfer_id: str | None,
                cached_tokens: int = 0, wrong: bool = False) -> dict:
        """The prompt's KV now exists: hold it (pull), offer or push it (push, Mooncake);
        returns the ``kv_transfer_params`` vLLM 0.32 answers with (``cached_tokens``: the
        prompt tokens this prefill found in its prefix cache)."""
        inst = self.inst
        cfg = self.config
        loop = asyncio.get_running_loop()
        ntok = prompt_tokens
        nblocks = max(1, -(-ntok // cfg.block_size))
        first = self._next_block
        self._next_block = (first + nblocks) % 2_000_000_000 or 1
        held = HeldKV(internal_id, list(range(first, first + nblocks)), prompt_hash, ntok,
                      transfer_id, time.monotonic(), wrong=wrong)
        conn = cfg.kv_connector
        if conn == "nixl":
            self._hold(self._held, internal_id, held, loop)
            return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [held.block_ids],
                    "remote_engine_id": inst.engine_id, "remote_request_id": internal_id,
                    "remote_host": inst.kv_host, "remote_port": inst.kv_port, "tp_size": cfg.tp_size,
                    "dcp_size": 1, "pp_size": cfg.pp_size, "remote_num_tokens": ntok,
                    "remote_blocks_expiry_time": None, "transfer_mode": "pull",
                    "remote_prefill_cached_tokens": cached_tokens}
        tid = transfer_id
        assert tid is not None  # push connectors: generation checked the request's transfer_id
        waiter = self._push_waiters.pop(tid, None)
        if waiter is not None and not waiter[0].done():
            self._deliver_push(held, waiter)
        else:
            if tid in self._push_offers:
                self._release(self._push_offers, tid)
            self._hold(self._push_offers, tid, held, loop)
        if conn == "nixl-push":
            return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": inst.engine_id,
                    "remote_request_id": internal_id, "remote_host": inst.kv_host,
                    "remote_port": inst.kv_port, "tp_size": cfg.tp_size, "dcp_size": 1, "pp_size": cfg.pp_size,
                    "remote_num_tokens": ntok, "transfer_mode": "push", "transfer_id": tid,
                    "remote_prefill_cached_tokens": cached_tokens}
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": inst.engine_id,
                "remote_bootstrap_addr": inst.bootstrap_addr, "remote_request_id": internal_id,
                "remote_num_tokens": ntok, "transfer_id": tid}

    def _hold(self, table: dict, key: str, held: HeldKV, loop) -> None:
        table[key] = held
        self.held_blocks += len(held.block_ids)
        held.timer = loop.call_later(self.config.kv_abort_timeout, self._expire, table, key, held)

    def _release(self, table: dict, key: str) -> HeldKV | None:
        held = table.pop(key, None)
        if held is not None:
            self.held_blocks -= len(held.block_ids)
            if held.timer is not None:
                held.timer.cancel()
                held.timer = None
            if self.on_free is not None:
                self.on_free()
        return held

    def _expire(self, table: dict, key: str, held: HeldKV) -> None:
        if table.get(key) is not held:
            return
        held.timer = None
        self._release(table, key)
        self.stats.kv_blocks_expired += len(held.block_ids)
        self.stats.kv_requests_expired += 1
        self.log.append({"t": time.monotonic(), "op": "expire", "request_id": held.request_id,
                         "transfer_id": held.transfer_id, "blocks": len(held.block_ids)})

    def _deliver_push(self, held: HeldKV, waiter: tuple[asyncio.Future, str | None]) -> None:
        fut, prompt_hash = waiter
        if prompt_hash != held.prompt_hash:
            self.stats.kv_push_failures += 1
            fut.set_result((409, {"error": self._prompt_mismatch(held)}))
            return
        self.stats.kv_pushes += 1
        self.stats.kv_blocks_served += len(held.block_ids)
        self.log.append({"t": time.monotonic(), "op": "push", "request_id": held.request_id,
                         "transfer_id": held.transfer_id, "blocks": len(held.block_ids)})
        fut.set_result((200, {"num_tokens": held.num_tokens, "block_ids": held.block_ids, "wrong": held.wrong}))

    def _prompt_mismatch(self, held: HeldKV) -> str:
        return (f"prompt mismatch: the decode's prompt differs from the prompt {self.inst.name} prefilled for "
                f"{held.request_id} (prefill and decode must receive identical prompt content)")

    def _engine_mismatch(self, eid: Any) -> dict:
        return {"error": f"engine id mismatch: the request names {eid!r}, this prefill is "
                         f"{self.inst.engine_id!r}"}

    # -- producer: serving the side channel ------------------------------------------------
    def serve_pull(self, data: dict) -> tuple[int, dict]:
        """``POST /sim/kv/pull``: hand the held blocks to the decoder that names them."""
        rid = data.get("remote_request_id")
        eid = data.get("remote_engine_id")
        ev = {"t": time.monotonic(), "op": "serve-pull", "request_id": rid, "consumer": data.get("consumer")}
        self.log.append(ev)
        if eid != self.inst.engine_id:
            self.stats.kv_push_failures += 1
            ev["error"] = "engine id mismatch"
            return 404, self._engine_mismatch(eid)
        held = self._held.get(rid) if isinstance(rid, str) else None
        if held is None:
            self.stats.kv_push_failures += 1
            ev["error"] = "not held"
            return 404, {"error": f"no KV blocks held for request {rid!r} on {self.inst.engine_id} "
                                  "(never produced, already transferred, or expired after kv_abort_timeout)"}
        want = flat_ints(data.get("remote_block_ids"))
        if want != held.block_ids:
            self.stats.kv_push_failures += 1
            ev["error"] = "block ids"
            return 409, {"error": f"block ids {want} do not match the blocks held for {rid!r}"}
        self._release(self._held, rid)  # type: ignore[arg-type]  # held: rid is a str
        if data.get("prompt_hash") != held.prompt_hash:
            self.stats.kv_push_failures += 1
            ev["error"] = "prompt mismatch"
            return 409, {"error": self._prompt_mismatch(held)}
        self.stats.kv_pushes += 1
        self.stats.kv_blocks_served += len(held.block_ids)
        ev["ok"] = True
        return 200, {"num_tokens": held.num_tokens, "block_ids": held.block_ids, "wrong": held.wrong}

    async def serve_register(self, data: dict) -> tuple[int, dict]:
        """``POST /sim/kv/push/register``: a long poll until the prefill with that
        ``transfer_id`` pushes (at once when its offer is already held)."""
        tid = data.get("transfer_id")
        eid = data.get("remote_engine_id")
        self.log.append({"t": time.monotonic(), "op": "register", "transfer_id": tid,
                         "consumer": data.get("consumer")})
        if eid != self.inst.engine_id:
            self.stats.kv_push_failures += 1
            return 404, self._engine_mismatch(eid)
        if not isinstance(tid, str) or not tid:
            return 400, {"error": "transfer_id is required"}
        offer = self._release(self._push_offers, tid)
        if offer is not None:
            fut = asyncio.get_running_loop().create_future()
            self._deliver_push(offer, (fut, data.get("prompt_hash")))
            return fut.result()
        if tid in self._push_waiters:
            return 409, {"error": f"transfer_id {tid!r} is already registered by another decoder"}
        timeout = float(data.get("timeout") or self.config.push_registration_timeout)
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, data.get("prompt_hash"))
        self._push_waiters[tid] = entry
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self.stats.kv_push_failures += 1
            return 408, {"error": f"no prefill with transfer_id {tid!r} finished on {self.inst.engine_id} "
                                  f"within {timeout:g} s (push_registration_timeout)"}
        finally:
            if self._push_waiters.get(tid) is entry:
                del self._push_waiters[tid]

    # -- consumer (decode) -----------------------------------------------------------------
    async def _side_request(self, base_url: str, path: str, payload: dict, timeout: float) -> tuple[int, dict]:
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = ConnectionPool(base_url)
        resp = await pool.request("POST", path, body=_encode(payload),
                                  headers=[(b"content-type", JSON)],
                                  timeouts=TransportTimeouts(connect=min(timeout, 2.0), headers=timeout, idle=timeout))
        try:
            data = await resp.read()
        finally:
            resp.close()
        try:
            obj = _decode(data) if data else {}
        except msgspec.DecodeError:
            obj = {"error": data[:200].decode("utf-8", "replace")}
        return resp.status, obj if isinstance(obj, dict) else {"error": str(obj)}

    async def load(self, kv: dict, prompt_hash: str) -> tuple[bool, Any]:
        """Fetch the prompt's KV from the prefill named in ``kv``; (True, (tokens, blocks,
        wrong)) or (False, why); ``wrong``: the prefill computed it over another prompt's KV."""
        cfg = self.config
        conn = cfg.kv_connector
        payload = {"remote_engine_id": kv.get("remote_engine_id"), "remote_request_id": kv.get("remote_request_id"),
                   "prompt_hash": prompt_hash, "consumer": self.inst.engine_id}
        missing = [k for k in _NEEDED[conn] if kv.get(k) in (None, "", [])]
        if missing:
            return False, _LOAD_FAILED + f"kv_transfer_params lacks {', '.join(missing)} for the {conn} connector"
        if conn == "mooncake":
            base = str(kv["remote_bootstrap_addr"]).rstrip("/")
            if "://" not in base:
                base = "http://" + base
        else:
            base = f"http://{kv['remote_host']}:{kv['remote_port']}"
        try:
            if conn == "nixl":
                payload["remote_block_ids"] = kv["remote_block_ids"]
                status, data = await self._side_request(base, "/sim/kv/pull", payload, cfg.kv_side_channel_timeout)
            else:
                timeout = cfg.push_registration_timeout
                payload["transfer_id"] = kv["transfer_id"]
                payload["timeout"] = timeout
                status, data = await self._side_request(base, "/sim/kv/push/register", payload, timeout + 1.0)
        except UpstreamError as exc:
            msg = _LOAD_FAILED + f"cannot reach the prefill's side channel at {base}: {exc}"
            self.log.append({"t": time.monotonic(), "op": "load", "ok": False, "error": msg})
            return False, msg
        except ValueError as exc:
            return False, _LOAD_FAILED + f"bad side-channel address {base!r}: {exc}"
        if status == 200:
            self.log.append({"t": time.monotonic(), "op": "load", "ok": True, "peer": base,
                             "tokens": data.get("num_tokens")})
            blocks = data.get("block_ids")
            return True, (int(data.get("num_tokens") or 0), len(blocks) if isinstance(blocks, list) else 0,
                          data.get("wrong") is True)
        msg = _LOAD_FAILED + f"{base} answered {status}: {data.get('error')}"
        self.log.append({"t": time.monotonic(), "op": "load", "ok": False, "error": msg})
        return False, msg
