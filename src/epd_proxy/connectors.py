"""KV connectors: how the prefill and decode legs of one attempt are coordinated.

Each connector is a small strategy with one method, ``open``, that runs the
legs its protocol needs and returns the opened (not yet committed) decode leg.
Adding a connector means adding a class here, not an ``if`` in the pipeline.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from .context import RequestContext
from .errors import ProxyError
from .pool import Instance
from .stage_bodies import decode_body, nixl_prefill_request_params, prefill_body
from .stages import DecodeLeg, DecodeStage, PrefillStage


@dataclass(slots=True)
class LegPlan:
    """What one attempt will send where."""

    body: dict  # the consumer body: the client's, with media rewritten to embeddings
    prefill: Instance | None
    decode: Instance
    decode_headers: list | None = None  # e.g. X-data-parallel-rank for an EC consumer replica


class KVConnector:
    name = "base"

    def __init__(self, prefill: PrefillStage | None, decode: DecodeStage) -> None:
        self.prefill = prefill
        self.decode = decode

    @classmethod
    def check_instances(cls, prefill: list) -> None:
        """Raise ValueError when the configured instances lack what this connector needs."""

    async def open(self, ctx: RequestContext, plan: LegPlan) -> DecodeLeg:
        raise NotImplementedError


class DecodeOnly(KVConnector):
    """No prefill pool (E+PD, or a plain pool of instances): decode does it all."""

    name = "none"

    async def open(self, ctx: RequestContext, plan: LegPlan) -> DecodeLeg:
        return await self.decode.open(ctx, plan.decode, plan.body, plan.decode_headers)


class NixlPull(KVConnector):
    """NIXL pull (§3.3): prefill first; its ``kv_transfer_params`` go to decode
    verbatim, and decode READs the blocks from the prefill instance."""

    name = "nixl"

    async def open(self, ctx: RequestContext, plan: LegPlan) -> DecodeLeg:
        kv = await self.prefill.run(ctx, plan.prefill, prefill_body(plan.body, nixl_prefill_request_params()))
        if kv is None:
            # Without them decode would silently prefill the whole prompt itself.
            raise ProxyError(502, f"prefill instance {plan.prefill.url} returned no kv_transfer_params; "
                                  "is it running with a NIXL kv-transfer-config?", retryable=True)
        return await self.decode.open(ctx, plan.decode, decode_body(plan.body, kv=kv), plan.decode_headers)


class NixlPush(KVConnector):
    """NixlPushConnector (§3.4): prefill WRITEs the KV into decode, so both legs
    start at once and decode is told the prefill's identity up front.

    The legs race until decode's first event: a prefill failure before then
    cancels decode (closing its connection so vLLM aborts it) and becomes the
    answer. After that the prefill leg rides along as ``companion``: the relay
    turns its failure into an in-band error, and if decode finishes first the
    prefill is drained in the background, bounded by the prefill timeout.
    """

    name = "nixl-push"

    @classmethod
    def check_instances(cls, prefill: list) -> None:
        for spec in prefill:
            if not spec.engine_id or spec.kv_port is None:
                raise ValueError(
                    f"--kv-connector nixl-push needs each prefill's identity, e.g. "
                    f"'{spec.url};engine_id=prefill-0;kv_host={spec.host};kv_port=5600;tp=1;pp=1' "
                    f"(engine_id pinned in the prefill's kv-transfer-config, kv_host/kv_port its "
                    f"VLLM_NIXL_SIDE_CHANNEL_HOST/PORT)")

    @staticmethod
    def decode_params(spec, request_id: str, transfer_id: str) -> dict:
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": spec.engine_id,
            "remote_host": spec.kv_host or spec.host,
            "remote_port": spec.kv_port,
            "tp_size": spec.tp,
            "pp_size": spec.pp,
            "remote_request_id": request_id,
            "transfer_id": transfer_id,
        }

    async def open(self, ctx: RequestContext, plan: LegPlan) -> DecodeLeg:
        # One transfer id pairs the two legs; a retry gets a new one.
        transfer_id = f"xfer-{uuid.uuid4()}"
        p_body = prefill_body(plan.body, nixl_prefill_request_params(transfer_id))
        d_body = decode_body(plan.body, kv=self.decode_params(plan.prefill.spec, ctx.request_id, transfer_id))
        loop = asyncio.get_running_loop()
        prefill = loop.create_task(self.prefill.run(ctx, plan.prefill, p_body))
        decode = loop.create_task(self.decode.open(ctx, plan.decode, d_body, plan.decode_headers))
        try:
            while not decode.done():
                await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
                if prefill.done() and not decode.done() and prefill.exception() is not None:
                    await _cancel(decode)
                    raise prefill.exception()
            leg = decode.result()  # raises decode's failure
        except BaseException:
            await _cancel(decode)
            await _cancel(prefill)
            raise
        leg.companion = prefill
        return leg


async def _cancel(task: asyncio.Task) -> None:
    if not task.done():
        task.cancel()
    try:
        await task
    except BaseException:
        pass
    # (a cancelled or failed leg has already closed its connection in its own finally)


CONNECTORS: dict[str, type[KVConnector]] = {"nixl": NixlPull, "nixl-push": NixlPush}
