"""Multi-turn KV reuse between decode and prefill, as vLLM 0.32's bidirectional NIXL transfer
(``kv_connector_extra_config.bidirectional_kv_xfer``, ``SimConfig.bidirectional``) does it.

Decode side (:meth:`KvReuse.keep`): every request a decode finishes that came with
``kv_transfer_params`` (its pull from a prefill) pins its blocks (the prompt and the answer)
for ``bidirectional_kv_ttl`` seconds, streams and answers nobody continues included; a plain
request (no parameters) pins nothing, as in vLLM 0.32 (``request_finished``: ``if not params:
return False, None``). Pinned blocks count against the instance's KV capacity, so a decode
full of them makes new requests wait (vLLM hangs there too). Its answer names them in
``kv_transfer_params`` (``do_remote_decode: true``, ``remote_num_tokens``,
``remote_blocks_expiry_time`` on its monotonic clock).

Prefill side (:meth:`KvReuse.read`): a prefill given those parameters reads from that
decode only what lies beyond its own prefix cache, and only when that is at least
``kv_recompute_threshold`` tokens; either way the decode frees the blocks (single use).
vLLM checks nothing more, so neither does the answer: parameters used twice (the blocks are
gone) or naming another prompt give HTTP 200 with a wrong answer. The simulator knows, and
counts it (``sim:wrong_answers_total``). Blocks within ``kv_expiry_margin`` of their expiry,
or a decode whose engine id changed (it restarted), give HTTP 500
(``kv_load_failure_policy=fail``).

The side channel is the decode's HTTP port: ``POST /sim/kv/read`` ``{remote_engine_id,
remote_request_id, remote_block_ids, num_tokens, prefix_digest, read_tokens, consumer}`` -> 200
``{num_tokens, match}`` (the blocks freed; ``match``: the reader's prompt starts with the
first ``num_tokens`` kept tokens: its ``remote_num_tokens``, which a proxy may lower to read
less, naming then only the first blocks, those that hold them), 404 ``{"reason": "engine"}``
for another engine id, 404 ``{"reason": "unknown"}`` when nothing is kept under that id (used,
expired, never kept).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Callable

from epd_proxy.http.transport import UpstreamError
from epd_proxy.sim.kv_channel import KvSideChannel, flat_ints
from epd_proxy.sim.prefix_cache import PrefixCache

_LOAD_FAILED = "KV load failed (kv_load_failure_policy=fail): "


def ids_digest(ids: list[int]) -> str:
    """What identifies a run of token ids (the kept KV's content)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


@dataclass(slots=True)
class KeptKV:
    """A finished request's blocks a decode keeps for the next turn's prefill."""

    request_id: str
    block_ids: list[int]
    ids: list[int]  # the tokens kept: prompt and answer as the next turn's prompt spells them
    expiry: float  # time.monotonic()
    hashes: list[int]  # their full blocks, pinned in the decode's prefix cache meanwhile
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class ReadResult:
    """What a prefill got from decode: tokens read (0 when it recomputes), whether what it
    read is another prompt's KV (a wrong answer follows), or why the request fails."""

    tokens: int = 0
    wrong: bool = False
    failure: str | None = None
    start: int = 0  # where the read begins: the reader's own cached prefix


class KvReuse:
    """Both ends of bidirectional transfer for one instance: the blocks it keeps as a decode
    and its reads as a prefill (over its :class:`KvSideChannel`'s connections)."""

    def __init__(self, channel: KvSideChannel) -> None:
        self.channel = channel
        self.inst = channel.inst
        self.config = channel.config
        self.stats = channel.stats
        self.kept_blocks = 0
        self.epoch = 0  # bumped by a crash: vLLM draws a new engine id at each start
        self.on_free: Callable[[], None] | None = None  # the engine admits what now fits
        self.cache: PrefixCache | None = None  # the instance's, where kept blocks stay findable
        self._kept: dict[str, KeptKV] = {}
        self._next_block = 1

    @property
    def engine_id(self) -> str:
        eid = self.inst.engine_id
        return eid if not self.epoch else f"{eid}-r{self.epoch}"

    @property
    def kept_requests(self) -> int:
        return len(self._kept)

    def kept(self) -> list[KeptKV]:
        return list(self._kept.values())

    def drop(self) -> None:
        """Lose everything kept (the instance crashed or stopped); the next life is another
        engine."""
        for k in self._kept.values():
            if k.timer is not None:
                k.timer.cancel()
            if self.cache is not None:
                self.cache.unpin(k.hashes)
        self._kept.clear()
        self.kept_blocks = 0
        self.epoch += 1

    # -- decode: keeping a finished request's blocks -----------------------------------------
    def keep(self, request_id: str, ids: list[int], hashes: list[int] | None = None) -> dict:
        """Pin the blocks of ``ids`` (prompt and answer as the next turn's prompt spells them)
        and return the ``kv_transfer_params`` vLLM's decode answers with (``remote_num_tokens``:
        ``len(ids)``); ``hashes``: the full blocks' hashes, pinned in the prefix cache until the
        blocks are freed (a local prefill on this decode finds them)."""
        cfg = self.config
        inst = self.inst
        nblocks = max(1, -(-len(ids) // cfg.block_size))
        first = self._next_block
        self._next_block = (first + nblocks) % 2_000_000_000 or 1
        ttl = cfg.bidirectional_kv_ttl
        old = self._kept.pop(request_id, None)
        if old is not None:
            self._free(old)
        kept = KeptKV(request_id, list(range(first, first + nblocks)), list(ids), time.monotonic() + ttl,
                      list(hashes or ()))
        if self.cache is not None:
            self.cache.pin(kept.hashes)
        kept.timer = asyncio.get_running_loop().call_later(ttl, self._expire, kept)
        self._kept[request_id] = kept
        self.kept_blocks += nblocks
        return {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [kept.block_ids],
                "remote_engine_id": self.engine_id, "remote_request_id": request_id,
                "remote_host": inst.kv_host, "remote_port": inst.kv_port, "tp_size": cfg.tp_size,
                "dcp_size": 1, "pp_size": cfg.pp_size, "remote_num_tokens": len(ids),
                "remote_blocks_expiry_time": kept.expiry, "transfer_mode": "pull"}

    def _free(self, kept: KeptKV) -> None:
        self.kept_blocks -= len(kept.block_ids)
        if self.cache is not None:
            self.cache.unpin(kept.hashes)
        if kept.timer is not None:
            kept.timer.cancel()
            kept.timer = None
        if self.on_free is not None:
            self.on_free()

    def _expire(self, kept: KeptKV) -> None:
        if self._kept.get(kept.request_id) is not kept:
            return
        kept.timer = None
        del self._kept[kept.request_id]
        self._free(kept)
        self.stats.kv_kept_expired_blocks += len(kept.block_ids)
        self.channel.log.append({"t": time.monotonic(), "op": "kept-expire", "request_id": kept.request_id,
                                 "blocks": len(kept.block_ids)})

    def serve_read(self, data: dict) -> tuple[int, dict]:
        """``POST /sim/kv/read``: a prefill reads (or only releases) kept blocks; freed
        either way."""
        rid = data.get("remote_request_id")
        eid = data.get("remote_engine_id")
        ev = {"t": time.monotonic(), "op": "serve-read", "request_id": rid, "consumer": data.get("consumer"),
              "tokens": data.get("read_tokens")}
        self.channel.log.append(ev)
        if eid != self.engine_id:
            ev["error"] = "engine id mismatch"
            return 404, {"reason": "engine", "error": f"engine id mismatch: the request names {eid!r}, "
                                                      f"this decode is {self.engine_id!r}"}
        kept = self._kept.get(rid) if isinstance(rid, str) else None
        named = flat_ints(data.get("remote_block_ids"))
        if kept is None or not named or named != kept.block_ids[:len(named)]:
            # vLLM's decode only logs "Potentially invalid KV blocks for unrecognized request".
            ev["error"] = "unknown"
            self.stats.kv_reuse_unknown += 1
            return 404, {"reason": "unknown", "error": f"no blocks kept for {rid!r} (used, expired or never kept)"}
        del self._kept[kept.request_id]
        self._free(kept)
        tokens = data.get("read_tokens")
        if isinstance(tokens, int) and tokens > 0:
            self.stats.kv_reuse_reads += 1
            self.stats.kv_reuse_read_tokens += tokens
        else:
            self.stats.kv_reuse_releases += 1
        ev["ok"] = True
        # The reader's prompt must start with the first ``num_tokens`` tokens it was told are kept,
        # and the blocks named must be those that hold them: vLLM pairs the last blocks named
        # with the ones it reads, so naming more (or fewer) reads the wrong KV.
        n = data.get("num_tokens")
        match = (isinstance(n, int) and 0 < n <= len(kept.ids)
                 and len(named) == -(-n // self.config.block_size)
                 and data.get("prefix_digest") == ids_digest(kept.ids[:n]))
        return 200, {"num_tokens": len(kept.ids), "match": match}

    # -- prefill: reading the previous turn from decode ---------------------------------------
    async def read(self, kv: dict, ids: list[int], cached: int) -> ReadResult:
        """Read what ``kv`` (decode's parameters) holds beyond this prefill's ``cached``
        prefix of the prompt ``ids``; the decode's blocks are freed either way."""
        cfg = self.config
        expiry = kv.get("remote_blocks_expiry_time")
        if isinstance(expiry, (int, float)) and time.monotonic() > expiry - cfg.kv_expiry_margin:
            return ReadResult(failure=_LOAD_FAILED + f"the decode's blocks expire at {expiry:.2f} (within "
                                                     f"{cfg.kv_expiry_margin:g} s): not read")
        n = kv.get("remote_num_tokens")
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0
        covered = min(n, len(ids)) - 1
        want = covered - cached
        read = want if want >= cfg.kv_recompute_threshold else 0
        payload = {"remote_engine_id": kv.get("remote_engine_id"), "remote_request_id": kv.get("remote_request_id"),
                   "remote_block_ids": kv.get("remote_block_ids"), "read_tokens": read, "num_tokens": n,
                   "prefix_digest": ids_digest(ids[:n]) if 0 < n <= len(ids) else None,
                   "consumer": self.inst.engine_id}
        base = f"http://{kv.get('remote_host')}:{kv.get('remote_port')}"
        try:
            status, data = await self.channel._side_request(base, "/sim/kv/read", payload,
                                                            cfg.kv_side_channel_timeout)
        except (UpstreamError, ValueError) as exc:
            if not read:
                return ReadResult()  # the release is lost; decode's blocks wait for their expiry
            return ReadResult(failure=_LOAD_FAILED + f"cannot reach the decode at {base}: {exc}")
        if status == 404 and data.get("reason") == "engine":
            return ReadResult(failure=_LOAD_FAILED + str(data.get("error")))
        if not read:
            return ReadResult()
        if status != 200 or not data.get("match"):
            # vLLM reads the blocks it is told to, whatever they hold now.
            return ReadResult(tokens=read, wrong=True)
        return ReadResult(tokens=read)
