"""The encode stage: a request's media items sent to the encoders, the body rewritten
for the consumer."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import msgspec

from epd_proxy.encode.ec_match import consumer_ec_params, match_encoder_output, rewrite_media
from epd_proxy.encode.encoder_plan import (
    SubRequest,
    encoder_body,
    encoder_request_id,
    new_transfer_id,
    plan_sub_requests,
)
from epd_proxy.encode.multimodal import MediaItem
from epd_proxy.http.transport import TransportTimeouts
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.request.context import RequestContext
from epd_proxy.request.upstream import UpstreamStage
from epd_proxy.wire.blobs import encode_json
from epd_proxy.wire.errors import ProxyError
from epd_proxy.wire.ids import hex_id

# The stages' log lines keep the logger name they have always had (log filters use it).
log = logging.getLogger("epd_proxy.stages")


class _EncoderReply(msgspec.Struct):
    ec_transfer_params: object = None


class EncoderFanout(UpstreamStage):
    """Sends a request's media items to the encoders and rewrites the body for the consumer.

    Each item's encoder is the pool's policy's choice (``--encode-policy``:
    affinity by the item's uuid, or the persistent round-robin cursor, ...),
    images on the same encoder are batched, and every sub-request runs
    concurrently; the first failure cancels the others.
    """

    def __init__(self, pool: InstancePool, *, max_batch: int, rewrite: bool, timeout: float,
                 connect_timeout: float, observe_sub_request: Callable[[float], None] | None = None) -> None:
        super().__init__(pool, TransportTimeouts(connect=connect_timeout, headers=timeout, idle=timeout))
        self.max_batch = max_batch
        self.rewrite = rewrite
        self.observe_sub_request = observe_sub_request  # metrics: each sub-request's duration

    async def run(self, ctx: RequestContext, body: dict, items: list[MediaItem], consumer_zmq: str | None) -> dict:
        subs = plan_sub_requests(items, self.pool.assign(items, ctx.excluded, ctx.model_for("encode")), self.max_batch)
        # Fresh transfer ids per item occurrence and per attempt (never reused on retry).
        tids = [[new_transfer_id() for _ in sub.items] for sub in subs]
        t0 = time.perf_counter()
        if len(subs) == 1:  # the common case: no task to schedule, one loop turn saved
            outcomes = [await self._one(ctx, body, subs[0].encoder, subs[0], tids[0], consumer_zmq)]
        else:
            try:
                async with asyncio.TaskGroup() as tg:
                    tasks = [tg.create_task(self._one(ctx, body, sub.encoder, sub, t, consumer_zmq))
                             for sub, t in zip(subs, tids)]
            except* ProxyError as group:
                raise _first(group) from None
            outcomes = [task.result() for task in tasks]
        ctx.timing("encode", time.perf_counter() - t0)
        results = [None] * len(items)
        handles: dict = {}
        for sub, (sub_results, sub_handles) in zip(subs, outcomes):
            for item, res in zip(sub.items, sub_results):
                results[item.index] = res
            handles.update(sub_handles)
        out = rewrite_media(body, items, results) if self.rewrite else dict(body)
        ec = consumer_ec_params(items, results, handles, rewrite=self.rewrite)
        if ec is not None:
            out["ec_transfer_params"] = ec
        else:
            out.pop("ec_transfer_params", None)
        return out

    async def _one(self, ctx: RequestContext, body: dict, inst: Instance, sub: SubRequest, tids: list[str],
                   consumer_zmq: str | None):
        payload = encode_json(
            encoder_body(body, sub, rewrite=self.rewrite, transfer_ids=tids, consumer_zmq=consumer_zmq))
        rid = encoder_request_id(ctx.request_id, sub.items[0].index, hex_id(24))
        t0 = time.perf_counter()
        data = await self.exchange(ctx, inst, "/v1/chat/completions", payload, ctx.upstream_headers(rid))
        if self.observe_sub_request is not None:
            self.observe_sub_request(time.perf_counter() - t0)
        try:
            ec_params = msgspec.json.decode(data, type=_EncoderReply).ec_transfer_params
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("encoder %s answered without readable ec_transfer_params; the consumer will "
                        "encode locally", inst.url)
            ec_params = None
        return match_encoder_output(sub, tids, ec_params)


def _first(group: BaseExceptionGroup) -> ProxyError:
    """The most telling error of a fan-out: a client error over a server one."""
    errors = [e for e in _flatten(group) if isinstance(e, ProxyError)]
    errors.sort(key=lambda e: (e.retryable, e.status >= 500))
    return errors[0]


def _flatten(group: BaseExceptionGroup):
    for e in group.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _flatten(e)
        else:
            yield e
