"""vLLM's KV cache events (``--kv-events-config``, publisher ``zmq``), published by a
simulated instance as vLLM 0.32 publishes them.

A PUB socket sends one message per batch of events: ``[topic, sequence (8 bytes,
big-endian), msgpack([timestamp, [event, ...], data_parallel_rank])]``, each event a map
tagged by ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``), ``BlockRemoved``
(``block_hashes``, ``medium``), ``AllBlocksCleared``. A ROUTER socket answers a replay
request ``[b"", start (8 bytes)]`` with every buffered message from ``start`` on, framed
``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``. The last ``buffer_steps``
messages are kept for replay.

The prefix cache (``prefix_cache.py``) tells what it stored and evicted; a crash ends
the publisher, and a restart starts a new one on the same ports, its sequence from 0,
as a restarted vLLM does. Block hashes are the prefix cache's, as unsigned 64-bit ints.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger("epd_proxy.sim.kv_events")

_M64 = (1 << 64) - 1
_END = (-1).to_bytes(8, "big", signed=True)
_encoder = msgspec.msgpack.Encoder()


def _unsigned(h: int) -> int:
    return h & _M64


class KvEventPublisher:
    """One instance's event and replay sockets (ports 0: chosen at the first start, kept
    across restarts)."""

    def __init__(self, host: str, *, topic: str = "kv", buffer_steps: int = 10_000, port: int = 0,
                 replay_port: int = 0, block_size: int = 16) -> None:
        self.host = host
        self.topic = topic.encode()
        self.buffer_steps = buffer_steps
        self.port = port
        self.replay_port = replay_port
        self.block_size = block_size
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self.published = 0  # batches published since the last start
        self.replays = 0  # replay requests answered
        self.paused = False  # tests: published batches are buffered but not sent live (a lost message)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    def start(self) -> None:
        """Bind (again); the sequence starts at 0."""
        if self._pub is not None:
            return
        self._ctx = ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        if self.port:
            pub.bind(self.endpoint)
        else:
            self.port = pub.bind_to_random_port(f"tcp://{self.host}")
        if self.replay_port:
            router.bind(self.replay_endpoint)
        else:
            self.replay_port = router.bind_to_random_port(f"tcp://{self.host}")
        self._pub, self._router = pub, router
        self._buffer.clear()
        self._seq = 0
        self.published = 0
        self._task = asyncio.get_running_loop().create_task(self._serve_replays())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # -- events ---------------------------------------------------------------------------
    def stored(self, token_ids: list[int], hashes: list[int], new: list[int], evicted: list[int],
               lora_name: str | None = None) -> None:
        """The prefix cache stored ``new`` of a prompt's blocks (``hashes``, over
        ``token_ids``) and evicted ``evicted``: one batch, as one engine step's."""
        events: list[dict] = []
        if evicted:
            events.append({"type": "BlockRemoved", "block_hashes": [_unsigned(h) for h in evicted], "medium": "GPU"})
        if new:
            fresh = set(new)
            bs = self.block_size
            run: list[int] = []
            chain: list[int | None] = [*hashes, None]  # a sentinel ends the last run
            for i, h in enumerate(chain):
                if h is not None and h in fresh:
                    run.append(i)
                    continue
                if run:
                    first = run[0]
                    events.append({"type": "BlockStored",
                                   "block_hashes": [_unsigned(hashes[j]) for j in run],
                                   "parent_block_hash": _unsigned(hashes[first - 1]) if first else None,
                                   "token_ids": token_ids[first * bs:(run[-1] + 1) * bs],
                                   "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": lora_name})
                    run = []
        if events:
            self.publish(events)

    def cleared(self) -> None:
        """The prefix cache was reset (vLLM's ``/reset_prefix_cache``)."""
        self.publish([{"type": "AllBlocksCleared"}])

    def publish(self, events: list[dict]) -> None:
        if self._pub is None:
            return
        seq = self._seq
        self._seq += 1
        payload = _encoder.encode([time.time(), events, 0])
        self._buffer.append((seq, payload))
        self.published += 1
        if not self.paused:
            try:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            except zmq.Again:  # a PUB socket drops what its subscribers cannot take; so does vLLM's
                pass

    async def _serve_replays(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request: %d frames", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await router.send_multipart([client, b"", b"", _END, b""])
            self.replays += 1
