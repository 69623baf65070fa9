"""What each simulated instance saw: request records, counters, and the writer that records answers."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from epd_proxy.sim.responses import JSON, SSE


@dataclass(slots=True)
class SimRecord:
    """One request an instance received (side-channel traffic between simulated
    instances, ``/sim/...``, is not recorded here; see ``SimInstance.side_channel_log``).

    Times are ``time.monotonic()``: ``t_received`` when the request was fully
    read, ``t_headers`` when the status line went out (None if it never did),
    ``t_end`` when the response ended, was reset or the client went away.
    """

    path: str
    method: str
    headers: dict[str, str]
    body: bytes
    json: Any
    t_received: float
    t_headers: float | None = None
    t_end: float | None = None
    status: int | None = None
    aborted: bool = False  # the client closed the connection before the end
    bytes_sent: int = 0  # response body bytes
    fault: str | None = None  # the faults applied, as written ("decode:reset-after=3")
    instance: str = ""
    request_id: str | None = None  # the X-Request-Id header
    error: str | None = None  # why the simulator failed the request (generation error / reset)
    stream: bool = False
    kv: dict | None = field(default=None)  # kv_transfer_params in the response, if any
    # Each piece of the response body as written (stream events, the two pieces of a split
    # event): kept for every failed request (error status, in-band error, reset, abort) and,
    # with SimConfig.record_responses, for successful ones too; else None.
    response_chunks: list | None = None

    @property
    def done(self) -> bool:
        return self.t_end is not None

    def answered(self, status: int) -> None:
        """The status line went out now."""
        self.t_headers = time.monotonic()
        self.status = status

    def ended(self, bytes_sent: int) -> None:
        """The response ended now (or was reset, or the client went away)."""
        self.t_end = time.monotonic()
        self.bytes_sent = bytes_sent

    @property
    def response_body(self) -> bytes | None:
        """The response body as sent (for a success, needs ``SimConfig.record_responses``)."""
        return None if self.response_chunks is None else b"".join(self.response_chunks)


class Stats:
    """Counters for one instance; also exported on ``/metrics``."""

    __slots__ = ("requests", "success", "prompt_tokens", "generation_tokens", "local_prefills",
                 "local_encodes", "ec_hits", "encoded_items", "ec_failures", "kv_pulls",
                 "kv_pull_failures", "kv_pushes", "kv_push_failures", "kv_blocks_expired",
                 "kv_requests_expired", "kv_blocks_served", "external_cached_tokens", "aborted",
                 "faults", "errors", "external_queried_tokens", "local_prompt_tokens", "kv_transfers",
                 "kv_bytes_transferred", "kv_bytes_buckets", "encode_ms", "encoded_tokens",
                 "kv_kept_expired_blocks", "kv_reuse_reads", "kv_reuse_read_tokens", "kv_reuse_releases",
                 "kv_reuse_unknown", "wrong_answers", "kv_reuse_failures")

    # vLLM's buckets for vllm:nixl_bytes_transferred (2 KiB to 8 GiB).
    KV_BYTES_BUCKETS: tuple[int, ...] = tuple(2 ** (10 + i) for i in range(1, 25, 2))

    def __init__(self) -> None:
        self.requests = 0  # generation requests received
        # vllm:request_success_total; a client disconnect counts in none (as with vLLM).
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.local_prefills = 0  # prompts computed here (not loaded from a prefill)
        self.local_encodes = 0  # raw media items a consumer encoded itself
        self.ec_hits = 0  # media items found in the EC store
        self.encoded_items = 0  # items an encoder encoded
        self.encode_ms = 0.0  # encoder: time spent encoding items missing from its cache
        self.encoded_tokens = 0  # encoder: placeholder tokens of those items
        self.ec_failures = 0  # *_embeds references that could not be satisfied
        self.kv_pulls = 0  # decode: successful KV loads (pull or push)
        self.kv_pull_failures = 0  # decode: failed KV loads
        self.kv_pushes = 0  # prefill: blocks handed to a decoder (pulled or pushed)
        self.kv_push_failures = 0  # prefill: side-channel requests refused
        self.kv_blocks_expired = 0  # prefill: blocks freed by the abort timeout
        self.kv_requests_expired = 0
        self.kv_blocks_served = 0
        self.external_cached_tokens = 0  # decode: prompt tokens that came over KV transfer
        self.external_queried_tokens = 0  # decode: prompt tokens looked up over KV transfer
        self.local_prompt_tokens = 0  # prompt tokens computed here (vllm:prompt_tokens_by_source local_compute)
        self.kv_transfers = 0  # decode: KV loads (vllm:nixl_bytes_transferred_count)
        self.kv_bytes_transferred = 0  # decode: their bytes (vllm:nixl_bytes_transferred_sum)
        self.kv_bytes_buckets = [0] * len(self.KV_BYTES_BUCKETS)  # per bucket, not cumulative
        self.aborted = 0  # requests whose client went away (sim:aborted_requests_total only)
        self.faults = 0  # requests with an injected fault
        self.errors = 0  # requests failed by the simulator (generation errors)
        # Bidirectional transfer (kv_reuse.py). Decode: blocks kept after a request that expired,
        # reads of kept blocks served (and their tokens), releases without a read, reads of
        # blocks no longer kept. Prefill: answers computed over another prompt's KV (vLLM gives
        # them silently), reads that failed the request.
        self.kv_kept_expired_blocks = 0
        self.kv_reuse_reads = 0
        self.kv_reuse_read_tokens = 0
        self.kv_reuse_releases = 0
        self.kv_reuse_unknown = 0
        self.wrong_answers = 0
        self.kv_reuse_failures = 0

    def as_dict(self) -> dict:
        out = {}
        for k in self.__slots__:
            v = getattr(self, k)
            out[k] = dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v
        return out

    def add_kv_transfer(self, nbytes: int) -> None:
        self.kv_transfers += 1
        self.kv_bytes_transferred += nbytes
        for i, le in enumerate(self.KV_BYTES_BUCKETS):
            if nbytes <= le:
                self.kv_bytes_buckets[i] += 1
                return


class TeeWriter:
    """A ResponseWriter that also keeps what it writes in the request's record."""

    __slots__ = ("_w", "_parts")

    def __init__(self, writer, rec: SimRecord) -> None:
        self._w = writer
        self._parts: list[bytes] = []
        rec.response_chunks = self._parts

    @property
    def started(self) -> bool:
        return self._w.started

    @property
    def finished(self) -> bool:
        return self._w.finished

    @property
    def bytes_sent(self) -> int:
        return self._w.bytes_sent

    @property
    def disconnected(self) -> bool:
        return self._w.disconnected

    def send(self, status, body=b"", content_type=JSON, headers=None) -> None:
        if body:
            self._parts.append(body)
        self._w.send(status, body, content_type=content_type, headers=headers)

    def start(self, status, content_type=SSE, headers=None) -> None:
        self._w.start(status, content_type=content_type, headers=headers)

    def write(self, data: bytes) -> None:
        if data and not self._w.disconnected:
            self._parts.append(data)
        self._w.write(data)

    def end(self, data: bytes = b"") -> None:
        if data and not self._w.disconnected and not self._w.finished:
            self._parts.append(data)
        self._w.end(data)

    def abort(self) -> None:
        self._w.abort()

    async def drain(self) -> None:
        await self._w.drain()
