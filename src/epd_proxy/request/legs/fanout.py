"""The encode stage: a request's media items sent to the encoders, the body rewritten
for the consumer."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Callable

import msgspec

from epd_proxy.encode.ec_match import ItemResult, consumer_ec_params, match_encoder_output, rewrite_media
from epd_proxy.encode.encoder_plan import (
    SubRequest,
    encoder_body,
    encoder_request_id,
    new_transfer_id,
    plan_sub_requests,
    sub_request_timeout,
)
from epd_proxy.encode.item_faults import EncodeFailures
from epd_proxy.encode.multimodal import MediaItem
from epd_proxy.http.transport import TransportTimeouts
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.observe.metrics import Collector
from epd_proxy.placement.media import place_items
from epd_proxy.request.admission import overloaded
from epd_proxy.request.context import RequestContext
from epd_proxy.request.legs.upstream import HeldFailure, UpstreamStage
from epd_proxy.wire.blobs import encode_json
from epd_proxy.wire.errors import ProxyError
from epd_proxy.wire.ids import hex_id

# The stages' log lines keep the logger name they have always had (log filters use it).
log = logging.getLogger("epd_proxy.stages")


class _EncoderReply(msgspec.Struct):
    ec_transfer_params: object = None


class EncoderFanout(UpstreamStage):
    """Sends a request's media items to the encoders and rewrites the body for the consumer.

    Each item's encoder is the pool's policy's choice (``--encode-policy``: placement level
    by work with repeats on their home, or the persistent round-robin cursor, ...), among
    the encoders with room (``--encoder-max-outstanding`` items in flight from this
    process); images on the same encoder are batched and every sub-request runs
    concurrently. An item is failed over, not the request: a sub-request that fails for its
    encoder (no connection, a 5xx, a timeout) has its items placed again over the encoders
    that have not failed this request, while the others' results are kept. A client error
    (4xx) or an unreadable answer fails the request at once. Items no encoder can take
    (every one failed them, or none had room before the encode timeout) fail the request,
    or with ``--encoder-fallback local`` go raw to the consumer, which encodes them itself.
    An item two encoders time out on (or fail with vLLM's 500) is taken as the cause
    (item_faults.py): the request fails at once (or the item goes raw to the consumer), and
    neither encoder's health hears of it.

    Messages and Responses requests (``ctx.api``): their items are the chat parts vLLM makes
    of their image blocks, sent without a proxy ``uuid``, and the consumer keeps the API's
    own parts, so both key the image by its content (never rewritten to ``*_embeds``: these
    APIs have no such part).
    """

    holds_signals = True  # a timeout or a 500 may be the item's: EncodeFailures decides

    def __init__(self, pool: InstancePool, *, max_batch: int, rewrite: bool, timeout: float,
                 connect_timeout: float, max_outstanding: int = 0, fallback: str = "none",
                 observe_sub_request: Callable[[float], None] | None = None) -> None:
        super().__init__(pool, TransportTimeouts(connect=connect_timeout, headers=timeout, idle=timeout))
        self.max_batch = max_batch
        self.rewrite = rewrite
        # One image's sub-request (others scale it: sub_request_timeout); also how long an item
        # may wait for an encoder with room.
        self.timeout = timeout
        self._scaled: dict[float, TransportTimeouts] = {}  # the transport's, per scaled timeout
        self.max_outstanding = max_outstanding
        self.fallback_local = fallback == "local"
        self.observe_sub_request = observe_sub_request  # metrics: each sub-request's duration
        # Counters for /metrics (encoder_collector), by encoder URL: items in flight, items
        # moved off an encoder that failed them; and items sent raw to the consumer.
        self.outstanding: dict[str, int] = {}
        self.failovers: dict[str, int] = {}
        self.fallbacks = 0
        self.item_failures: dict[str, int] = {}  # items two encoders failed alike, by reason
        self._room: list[asyncio.Future] = []  # requests waiting for an encoder with room

    async def run(self, ctx: RequestContext, body: dict, items: list[MediaItem], consumer_zmq: str | None,
                  placed: tuple[list[MediaItem], list[Instance]] | None = None) -> dict:
        """The body the consumer gets; ``placed``: the placement's items and their encoders
        (placement/media.py), the first round's (None: placed here)."""
        t0 = time.perf_counter()
        results: list[ItemResult | None] = [None] * len(items)
        handles: dict = {}
        failed = EncodeFailures()  # encoders that failed an item of this run, and how
        todo = items
        error: ProxyError | None = None  # the last failure an item was moved off
        try:
            subs = self._place(ctx, todo, failed.encoders) if placed is None else \
                plan_sub_requests(placed[0], placed[1], self.max_batch)
            if subs is not None and len(subs) == 1 and len(subs[0].items) == len(items):
                # The common case: one sub-request, awaited here (no task, one loop turn saved).
                sub = subs[0]
                try:
                    self._reserve(sub)
                    try:
                        self._keep(sub, await self._one(ctx, body, sub, consumer_zmq), results, handles)
                    finally:
                        self._release(sub)
                    todo = []
                except ProxyError as err:
                    if not _encoder_failed(err):
                        raise
                    err.__traceback__ = None  # kept past this frame: no cycle through it
                    todo = self._failed_over(ctx, sub, failed, err)
                    subs, error = None, err
            if todo:
                await self._fan_out(ctx, body, todo, subs, failed, error, consumer_zmq, results, handles)
        finally:
            for held in failed.blamed():
                held.settle(self.pool, blame=True)
        ctx.timing("encode", time.perf_counter() - t0)
        rewrite = self.rewrite and ctx.api is None
        out = rewrite_media(body, items, results) if rewrite else dict(body)
        ec = consumer_ec_params(items, results, handles, rewrite=rewrite)
        if ec is not None:
            out["ec_transfer_params"] = ec
        else:
            out.pop("ec_transfer_params", None)
        return out

    async def _fan_out(self, ctx: RequestContext, body: dict, todo: list[MediaItem], subs: list[SubRequest] | None,
                       failed: EncodeFailures, error: ProxyError | None, consumer_zmq: str | None, results: list,
                       handles: dict) -> None:
        """Every item encoded (or given up to the fallback): sub-requests run concurrently,
        a failed one's items placed again, items without room wait for it until the timeout."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.timeout
        running: dict[asyncio.Task, SubRequest] = {}
        try:
            while True:
                if not subs and todo:
                    subs = self._place(ctx, todo, failed.encoders)
                    if subs is None:  # no encoder left that has not failed these items
                        todo = self._give_up(todo, error)
                if subs:
                    placed = {id(i) for sub in subs for i in sub.items}
                    todo = [i for i in todo if id(i) not in placed]
                    for sub in subs:
                        self._reserve(sub)
                        task = asyncio.ensure_future(self._one(ctx, body, sub, consumer_zmq))
                        task.add_done_callback(functools.partial(self._released, sub))
                        running[task] = sub
                    subs = None
                    if todo:
                        continue  # the rest on encoders that still have room
                if not todo and not running:
                    return
                waiter = None
                timeout = None
                if todo:  # none of the encoders left has room
                    timeout = until - loop.time()
                    if timeout <= 0:
                        todo = self._saturated(todo)
                        continue
                    waiter = loop.create_future()
                    self._room.append(waiter)
                try:
                    done, _ = await asyncio.wait([*running, waiter] if waiter is not None else running,
                                                 timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if waiter is not None and not waiter.done():
                        waiter.cancel()
                        self._room.remove(waiter)
                for fut in done:
                    sub = running.pop(fut, None)  # type: ignore[call-overload]
                    if sub is None:
                        continue  # the waiter: room somewhere
                    err = fut.exception()
                    if err is None:
                        self._keep(sub, fut.result(), results, handles)
                    elif isinstance(err, ProxyError) and _encoder_failed(err):
                        err.__traceback__ = None
                        error = err
                        todo = sorted(todo + self._failed_over(ctx, sub, failed, err), key=_index)
                    else:
                        raise _first([e for t in done if not t.cancelled() and (e := t.exception()) is not None])
                done = None  # type: ignore[assignment]
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    def _place(self, ctx: RequestContext, todo: list[MediaItem], failed: set[Instance]) -> list[SubRequest] | None:
        """Sub-requests for the items that fit now (placement/media.py); [] when no encoder has
        room; None when no encoder is left that has not failed this run (or the role has none)."""
        try:
            placed = place_items(self.pool, todo, exclude=ctx.excluded, failed=failed, timed_out=ctx.timed_out,
                                 outstanding=self.outstanding, bound=self.max_outstanding,
                                 model=ctx.model_for("encode"))
        except ProxyError:
            if not self.fallback_local:
                raise
            return None
        if placed is None:
            return None
        return plan_sub_requests(placed[0], placed[1], self.max_batch)

    def _failed_over(self, ctx: RequestContext, sub: SubRequest, failed: EncodeFailures,
                     err: ProxyError) -> list[MediaItem]:
        """A sub-request failed for its encoder: its items are to be placed again elsewhere,
        but for those another encoder failed alike (item_faults.py): the request's fault."""
        inst = sub.encoder
        items = sub.items
        bad = failed.failed(inst, [i.index for i in items], err if isinstance(err, HeldFailure) else None)
        if bad:
            items = self._item_fault(ctx, items, bad, err)
            if not items:
                return items
        self.failovers[inst.url] = self.failovers.get(inst.url, 0) + len(items)
        log.info("encoder %s failed %d item(s); placing them on another encoder", inst.url, len(items))
        return items

    def _item_fault(self, ctx: RequestContext, items: list[MediaItem], bad: list[int],
                    err: ProxyError) -> list[MediaItem]:
        """Two encoders failed these items alike: the items are the likely cause. No encoder is
        blamed; the request fails at once (not retried: any encoder would fail it again), or with
        the fallback the items go raw to the consumer. Returns the sub-request's other items."""
        timed_out = err.status == 504
        reason = "item_timeout" if timed_out else "item_error"
        self.item_failures[reason] = self.item_failures.get(reason, 0) + len(bad)
        what = "timed out on" if timed_out else "failed with an engine error on"
        named = ", ".join(map(str, bad))
        log.warning("request %s: two %s instances %s media item(s) %s: taken as the items' fault, not the "
                    "instances'", ctx.request_id, self.role, what, named)
        if not self.fallback_local:
            items_named = f"media item {named}" if len(bad) == 1 else f"media items {named}"
            fault = ProxyError(err.status, f"two {self.role} instances {what} {items_named} of the request (by "
                                           f"position); the item is the likely cause", retryable=False)
            fault.outcome = reason
            raise fault
        gone = set(bad)
        self._fall_back([i for i in items if i.index in gone], f"two encode instances {what} them")
        return [i for i in items if i.index not in gone]

    def _give_up(self, todo: list[MediaItem], error: ProxyError | None) -> list[MediaItem]:
        """Every encoder failed these items (or there is none): the fallback, or the failure."""
        if self.fallback_local:
            self._fall_back(todo, "no encode instance could take them")
            return []
        raise error or ProxyError(503, f"no {self.role} instance available", retryable=True)

    def _saturated(self, todo: list[MediaItem]) -> list[MediaItem]:
        """No encoder had room within the encode timeout: the fallback, or 429."""
        if self.fallback_local:
            self._fall_back(todo, f"every encode instance had {self.max_outstanding} items in flight "
                                  f"for {self.timeout:g} s")
            return []
        raise overloaded(f"every {self.role} instance is")

    def _fall_back(self, todo: list[MediaItem], why: str) -> None:
        self.fallbacks += len(todo)
        log.warning("%d media item(s) sent raw to the consumer (--encoder-fallback local): %s", len(todo), why)

    def _reserve(self, sub: SubRequest) -> None:
        url = sub.encoder.url
        self.outstanding[url] = self.outstanding.get(url, 0) + len(sub.items)

    def _released(self, sub: SubRequest, _task: asyncio.Future) -> None:
        self._release(sub)

    def _release(self, sub: SubRequest) -> None:
        url = sub.encoder.url
        self.outstanding[url] -= len(sub.items)
        if self._room:
            waiters, self._room = self._room, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    def _timeouts(self, items: list[MediaItem]) -> TransportTimeouts:
        """The transport's timeouts for a sub-request of ``items`` (one image's: the stage's)."""
        seconds = sub_request_timeout(items, self.timeout)
        if seconds == self.timeout:
            return self.timeouts
        found = self._scaled.get(seconds)
        if found is None:
            found = self._scaled[seconds] = TransportTimeouts(self.timeouts.connect, seconds, seconds)
        return found

    @staticmethod
    def _keep(sub: SubRequest, outcome: tuple, results: list, handles: dict) -> None:
        sub_results, sub_handles = outcome
        for item, res in zip(sub.items, sub_results):
            results[item.index] = res
        handles.update(sub_handles)

    async def _one(self, ctx: RequestContext, body: dict, sub: SubRequest, consumer_zmq: str | None):
        inst: Instance = sub.encoder
        # Fresh transfer ids per item occurrence and per sub-request (never reused on a retry).
        tids = [new_transfer_id() for _ in sub.items]
        payload = encode_json(
            encoder_body(body, sub, rewrite=self.rewrite and ctx.api is None, transfer_ids=tids,
                         consumer_zmq=consumer_zmq))
        rid = encoder_request_id(ctx.request_id, sub.items[0].index, hex_id(24))
        t0 = time.perf_counter()
        data = await self.exchange(ctx, inst, "/v1/chat/completions", payload, ctx.upstream_headers(rid),
                                   self._timeouts(sub.items))
        if self.observe_sub_request is not None:
            self.observe_sub_request(time.perf_counter() - t0)
        try:
            ec_params = msgspec.json.decode(data, type=_EncoderReply).ec_transfer_params
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("encoder %s answered without readable ec_transfer_params; the consumer will "
                        "encode locally", inst.url)
            ec_params = None
        return match_encoder_output(sub, tids, ec_params)


def encoder_collector(fanout: EncoderFanout) -> Collector:
    """Per encoder: the placement's counts (``cache-aware``: items, estimated work, affinity
    hits), the items in flight and failed over; and the items sent raw to the consumer."""
    def collect(f: dict[str, list]) -> None:
        # Every encoder of the pool has its series from the start, at 0 (and one that left
        # keeps its counts).
        urls = dict.fromkeys(i.url for i in fanout.pool.instances)
        placement = getattr(fanout.pool.policy, "encoders", None)
        if placement is not None or getattr(fanout.pool.policy, "name", "") == "cache-aware":
            items, work, hits = (placement.items, placement.work, placement.hits) if placement else ({}, {}, {})
            f["epd_proxy_encoder_items"] += [[u, items.get(u, 0)] for u in {**urls, **items}]
            f["epd_proxy_encoder_work_tokens"] += [[u, work.get(u, 0.0)] for u in {**urls, **work}]
            f["epd_proxy_encoder_affinity_hits"] += [[u, hits.get(u, 0)] for u in {**urls, **hits}]
        out, failovers = fanout.outstanding, fanout.failovers
        f["epd_proxy_encoder_outstanding"] += [[u, out.get(u, 0)] for u in {**urls, **out}]
        f["epd_proxy_encoder_failovers"] += [[u, failovers.get(u, 0)] for u in {**urls, **failovers}]
        f["epd_proxy_encoder_fallbacks"].append([fanout.fallbacks])
        faults = fanout.item_failures
        f["epd_proxy_encode_item_failures"] += [[r, faults.get(r, 0)] for r in {**_ITEM_REASONS, **faults}]
    return collect


# Why an item failed the request (or fell back): every series from the start, at 0.
_ITEM_REASONS = dict.fromkeys(("item_timeout", "item_error"))


def _encoder_failed(err: ProxyError) -> bool:
    """A failure of the encoder, not of the item: its items may go to another encoder. A
    timeout counts even when it is not retryable (no other encoder left for a retry of the
    request): the fallback may still take its items."""
    return err.retryable or err.status == 504


def _index(item: MediaItem) -> int:
    return item.index


def _first(errors: list[BaseException]) -> BaseException:
    """The most telling of the failures that ended a fan-out: a client error over a server one."""
    proxy = [e for e in errors if isinstance(e, ProxyError)]
    if not proxy:
        return errors[0]
    proxy.sort(key=lambda e: (e.retryable, e.status >= 500))
    return proxy[0]
