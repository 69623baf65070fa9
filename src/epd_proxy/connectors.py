"""KV connectors: how the prefill and decode legs of one attempt are coordinated.

Each connector is a small strategy with one method, ``open``, that runs the
legs its protocol needs and returns the opened (not yet committed) decode leg.
Adding a connector means adding a class here, not an ``if`` in the pipeline.
"""

from __future__ import annotations

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


CONNECTORS: dict[str, type[KVConnector]] = {"nixl": NixlPull}
