"""The event plane's shell: one subscriber per event stream, following the roster.

Each stream (one engine of one instance: ``streams.py``) gets a ZMQ SUB socket on its
publisher and a DEALER on its replay socket. What arrives goes through the stream's
``SequenceTracker`` into the ``BlockIndex``:

* on connect, everything the engine still buffers is replayed (from 0);
* a gap is replayed before the message after it is applied; a replay that cannot reach
  back far enough clears the instance (a missed removal would leave a block it no longer
  holds);
* a sequence that goes backwards is an engine restart: the instance is cleared and its
  new events replayed from 0;
* every ``HEARTBEAT`` seconds the replay socket is asked for everything from the last
  message applied: the answer proves the stream alive (``connected``), brings any message
  the live socket dropped at the end of a burst (no later message would reveal that gap),
  and tells a restart the live socket has not shown yet (the last message is no longer
  the engine's, or no longer there);
* after the replay socket stopped answering, the first live message is applied only once
  the replay socket has said the engine is the same: a new engine whose first messages the
  live socket missed may already number past the old one's.

A stream whose replay socket does not answer within ``REPLAY_TIMEOUT`` is not
connected; an instance counts as *live* while all its streams are connected. Routing
uses the index only over live instances (``live``): an instance whose events stopped
falls back to approximate routing, visibly (``/metrics``, ``/status``), and comes back by
itself when its replay socket answers again. Without a replay endpoint, a stream is
connected once a message arrived, and a gap clears the instance.

Every proxy process (replica, ``--workers`` worker) subscribes itself and keeps its own
index: the same events give every replica the same index, without talking to another.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from typing import Callable, Iterable

import zmq
import zmq.asyncio

from epd_proxy.config import InstanceSpec
from epd_proxy.kvcache import events
from epd_proxy.kvcache.index import BlockIndex
from epd_proxy.kvcache.sequence import DUPLICATE, GAP, RESTART, SequenceTracker
from epd_proxy.kvcache.streams import Stream, streams_of

log = logging.getLogger("epd_proxy.kv_events")

# Seconds between the replay socket's liveness checks (each also fetches what was missed).
HEARTBEAT = 2.0
# A replay not finished within this long: the stream is not connected.
REPLAY_TIMEOUT = 2.0
# Messages one replay may bring (vLLM keeps 10,000 steps by default).
REPLAY_MAX = 20_000


class StreamReader:
    """One event stream into the index: its sockets, its sequence, its counts."""

    def __init__(self, stream: Stream, index: BlockIndex, ctx: zmq.asyncio.Context,
                 clock: Callable[[], float] = time.monotonic, heartbeat: float = HEARTBEAT,
                 replay_timeout: float = REPLAY_TIMEOUT) -> None:
        self.stream = stream
        self.index = index
        self._ctx = ctx
        self._clock = clock
        self.heartbeat = heartbeat
        self.replay_timeout = replay_timeout
        self.tracker = SequenceTracker()
        self.connected = False
        self.received = 0  # batches applied (live and replayed)
        self.gaps = 0  # live messages after a gap
        self.replays = 0  # replay requests answered
        self.restarts = 0  # engine restarts seen
        self.lost = 0  # gaps no replay could fill (the instance cleared)
        self.errors = 0  # messages that were not vLLM's event batches
        self.live_received = 0  # batches that came through the live socket
        self.fetched = 0  # batches the heartbeat brought that the live socket had not
        self.last_event: float | None = None  # wall clock of the last batch applied
        # The replay socket stopped answering: the engine may have been replaced meanwhile, so
        # the next live message waits for the replay socket to say it is the same (``_live``),
        # tried at most once per heartbeat.
        self._unverified = False
        self._verify_after = 0.0
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    # -- life --------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.stream.name}")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.connected = False

    async def _run(self) -> None:
        """Read until closed; an unforeseen error is logged, shown as not connected, and the
        stream read again from new sockets a moment later (its sequence kept)."""
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV events of %s: reader failed; starting again", self.stream.name)
                self.connected = False
                await asyncio.sleep(self.heartbeat)

    async def _session(self) -> None:
        s = self.stream
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(s.endpoint)
        try:
            next_beat = 0.0
            while True:
                now = self._clock()
                if s.replay is not None and now >= next_beat:
                    await self._check()
                    next_beat = self._clock() + self.heartbeat
                timeout = max(0.0, next_beat - self._clock()) if s.replay is not None else self.heartbeat
                if await sub.poll(timeout=int(timeout * 1000) + 1):
                    frames = await sub.recv_multipart()
                    try:
                        await self._live(frames)
                    except events.WireError as exc:
                        self.errors += 1
                        log.warning("KV events of %s: %s", s.name, exc)
        finally:
            sub.close(linger=0)
            self._drop_dealer()

    # -- live messages -------------------------------------------------------------------
    async def _live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            raise events.WireError(f"{len(frames)} frames, not [topic, seq, payload]")
        seq = events.sequence(frames[1])
        tracker = self.tracker
        if self._unverified and self.stream.replay is not None and self._clock() >= self._verify_after:
            # A new engine whose first messages were not seen live (a subscriber reconnects late)
            # may already number past the old one's: only its replay tells it apart.
            self._verify_after = self._clock() + self.heartbeat
            await self._check()
        kind = tracker.classify(seq, self._clock())
        if kind == DUPLICATE:
            return
        if kind == RESTART:
            self._restarted(f"sequence went back from {tracker.expected} to {seq}")
            kind = GAP if seq > 0 else kind
        if kind == GAP:
            self.gaps += 1
            if self.stream.replay is not None:
                await self._replay(tracker.expected or 0)
            if tracker.expected is not None and seq < tracker.expected:
                return  # the replay brought it
            if tracker.expected is not None and seq > tracker.expected:
                self._lost(tracker.expected, seq)
        if self.stream.replay is None:
            self.connected = True
        self._apply(seq, frames[2])
        self.live_received += 1

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = events.decode_batch(payload)
        events.apply(self.index, self.stream.name, batch)
        self.tracker.applied(seq, zlib.crc32(payload))
        self.received += 1
        self.last_event = time.time()

    def _restarted(self, why: str) -> None:
        self.restarts += 1
        self.index.clear(self.stream.name)
        self.tracker.reset()
        log.info("KV events of %s: the engine restarted (%s); its blocks are cleared", self.stream.name, why)

    def _lost(self, expected: int, got: int) -> None:
        self.lost += 1
        self.index.clear(self.stream.name)
        log.warning("KV events of %s: messages %d..%d are lost (no replay reaches them); its blocks are cleared",
                    self.stream.name, expected, got - 1)

    # -- replay --------------------------------------------------------------------------
    async def _check(self) -> None:
        """The heartbeat: replay from the last message applied (or from 0)."""
        tracker = self.tracker
        if tracker.expected is None or tracker.expected == 0:
            await self._replay(0)
            return
        last = tracker.expected - 1
        frames = await self._request(last)
        if frames is None:
            return
        if not frames or frames[0][0] != last or zlib.crc32(frames[0][1]) != tracker.last_digest:
            self._restarted(f"its replay no longer has message {last} as applied")
            await self._replay(0)
            return
        if len(frames) > 1:
            self.fetched += len(frames) - 1
            if not self.live_received and self.fetched >= 3 and self.fetched - len(frames) + 1 < 3:
                log.warning("KV events of %s: nothing arrives on %s, only through the replay socket (every %g s): "
                            "does the instance bind it? vLLM binds only a wildcard endpoint (tcp://*:PORT) and "
                            "connects to any other", self.stream.name, self.stream.endpoint, self.heartbeat)
        self._replayed(frames[1:])

    async def _replay(self, start: int) -> None:
        frames = await self._request(start)
        if frames is not None:
            self._replayed(frames)

    def _replayed(self, frames: list[tuple[int, bytes]]) -> None:
        tracker = self.tracker
        for seq, payload in frames:
            expected = tracker.expected
            if expected is not None and seq < expected:
                continue
            if expected is not None and seq > expected:
                self._lost(expected, seq)
            try:
                self._apply(seq, payload)
            except events.WireError as exc:
                self.errors += 1
                log.warning("KV events of %s (replay): %s", self.stream.name, exc)
        if frames:
            tracker.replayed(frames[0][0], frames[-1][0], self._clock())

    async def _request(self, start: int) -> list[tuple[int, bytes]] | None:
        """The replay socket's ``(seq, payload)`` from ``start`` on; None (and not
        connected) if it did not answer in time."""
        s = self.stream
        assert s.replay is not None
        dealer = self._dealer
        if dealer is None:
            dealer = self._dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(s.replay)
        out: list[tuple[int, bytes]] = []
        try:
            async with asyncio.timeout(self.replay_timeout):
                await dealer.send_multipart(events.replay_request(start))
                while len(out) <= REPLAY_MAX:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4:
                        raise events.WireError(f"replay answer of {len(frames)} frames, not 4")
                    seq = events.sequence(frames[2])
                    if seq == events.END_SEQ:
                        break
                    out.append((seq, frames[3]))
        except (TimeoutError, events.WireError) as exc:
            if self.connected:
                log.warning("KV events of %s: the replay socket %s did not answer (%s); routing on its blocks "
                            "stops until it does", s.name, s.replay, exc or "timeout")
            self.connected = False
            self._unverified = True
            self._drop_dealer()  # a late answer must not be read as the next one's
            return None
        if not self.connected:
            log.info("KV events of %s: connected (%s)", s.name, s.endpoint)
        self.connected = True
        self._unverified = False
        self.replays += 1
        return out

    def _drop_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def status(self) -> dict:
        return {"endpoint": self.stream.endpoint, "replay": self.stream.replay, "connected": self.connected,
                "blocks": self.index.blocks_of(self.stream.name), "received": self.received,
                "expected_seq": self.tracker.expected, "gaps": self.gaps, "replays": self.replays,
                "restarts": self.restarts, "lost": self.lost, "errors": self.errors,
                "live_received": self.live_received, "fetched": self.fetched,
                "last_event": None if self.last_event is None else round(self.last_event, 3)}


class EventFeed:
    """Every instance's event streams into one index, following the roster."""

    def __init__(self, index: BlockIndex, default_port: int | None = None, *,
                 heartbeat: float = HEARTBEAT, replay_timeout: float = REPLAY_TIMEOUT) -> None:
        self.index = index
        self.default_port = default_port
        self.heartbeat = heartbeat
        self.replay_timeout = replay_timeout
        self.readers: dict[str, list[StreamReader]] = {}  # by instance URL
        self._ctx: zmq.asyncio.Context | None = None
        self._started = False
        self._pending: list[InstanceSpec] = []
        self._closing: set[asyncio.Task] = set()  # readers of instances that left, closing

    def follow(self, spec: InstanceSpec) -> None:
        """Subscribe to an instance's streams (again, if they changed)."""
        streams = streams_of(spec, self.default_port)
        have = self.readers.get(spec.url)
        if have is not None and [r.stream for r in have] == streams:
            return
        self.forget(spec.url)
        if not streams:
            return
        if not self._started:
            self._pending.append(spec)
            return
        if self._ctx is None:  # its I/O thread only once there is something to read
            self._ctx = zmq.asyncio.Context()
        readers = self.readers[spec.url] = [StreamReader(s, self.index, self._ctx, heartbeat=self.heartbeat,
                                                         replay_timeout=self.replay_timeout) for s in streams]
        for reader in readers:
            reader.start()

    def forget(self, url: str) -> None:
        """The instance left: its streams closed, its blocks dropped."""
        self._pending = [s for s in self._pending if s.url != url]
        readers = self.readers.pop(url, None)
        if not readers:
            return
        for reader in readers:
            self.index.drop(reader.stream.name)
            task = asyncio.get_running_loop().create_task(reader.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def changed(self, change) -> None:
        """A roster change (``instances.membership.Change``)."""
        if change.event in ("registered", "updated"):
            self.follow(change.spec)
        elif change.event in ("removed", "forgotten"):
            self.forget(change.spec.url)

    def start(self, specs: Iterable[InstanceSpec] = ()) -> None:
        if self._started:
            return
        self._started = True
        pending, self._pending = self._pending, []
        for spec in [*pending, *specs]:
            self.follow(spec)

    async def close(self) -> None:
        readers = [r for rs in self.readers.values() for r in rs]
        self.readers = {}
        await asyncio.gather(*(r.close() for r in readers), *self._closing)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # every socket closed, then the context: never blocks
            self._ctx = None
        self._started = False

    def live(self) -> frozenset[str]:
        """The instances whose every stream is connected: the index speaks for them."""
        return frozenset(url for url, readers in self.readers.items() if all(r.connected for r in readers))

    @property
    def active(self) -> bool:
        return bool(self.readers)

    def status(self) -> dict:
        """For ``/status``: per instance, its streams."""
        return {"index": {"blocks": len(self.index), "distinct_blocks": self.index.keys,
                          "max_blocks": self.index.max_blocks, "evicted": self.index.evicted},
                "instances": {url: [r.status() for r in readers] for url, readers in self.readers.items()}}

    def collect(self, f: dict[str, list], worker: str = "0") -> None:
        """``/metrics`` rows (``observe/metrics.py``'s collector)."""
        for url, readers in self.readers.items():
            for r in readers:
                rank = str(r.stream.rank)
                f["epd_proxy_kv_events_received"].append([url, rank, r.received])
                f["epd_proxy_kv_events_gaps"].append([url, rank, r.gaps])
                f["epd_proxy_kv_events_replays"].append([url, rank, r.replays])
                f["epd_proxy_kv_events_restarts"].append([url, rank, r.restarts])
                f["epd_proxy_kv_events_lost"].append([url, rank, r.lost])
                f["epd_proxy_kv_events_connected"].append([url, rank, worker, 1 if r.connected else 0])
                f["epd_proxy_kv_index_instance_blocks"].append([url, rank, self.index.blocks_of(r.stream.name)])
        f["epd_proxy_kv_index_blocks"].append([len(self.index)])
        f["epd_proxy_kv_index_evictions"].append([self.index.evicted])
