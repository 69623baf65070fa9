"""KV connectors: how the prefill and decode legs of one attempt are coordinated.

Each connector is a small strategy with one method, ``open``, that runs the
legs its protocol needs and returns the opened (not yet committed) decode leg.
Adding a connector means adding a class here, not an ``if`` in the pipeline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Callable

import msgspec

from epd_proxy.config import ProxyConfig, gather
from epd_proxy.http import Headers
from epd_proxy.http.client import ConnectionPool
from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.instances.instance import Instance
from epd_proxy.placement.decision import Placement
from epd_proxy.request.context import RequestContext
from epd_proxy.request.legs.hedged import PrefillHedging
from epd_proxy.request.legs.stage_bodies import decode_body, nixl_prefill_request_params, prefill_body, prompt_once
from epd_proxy.request.legs.stages import DecodeLeg, DecodeStage, PrefillStage
from epd_proxy.wire.errors import ProxyError
from epd_proxy.wire.ids import hex_id, uuid4_str

log = logging.getLogger("epd_proxy.connectors")


class LegPlan(msgspec.Struct, eq=False):
    """What one attempt sends where: the body, and the placement it carries out
    (placement/decision.py): its prefill, its decode and the decode's headers (X-data-parallel-rank
    for an EC consumer replica); ``again`` makes its decode anew without the ones that failed
    (the KV hand-over), when the caller allows it. Made by :func:`leg_plan` (a ``msgspec.Struct``:
    no ``__init__`` frame on every attempt)."""

    body: dict  # the consumer body: the client's, with media rewritten to embeddings
    placement: Placement
    again: Callable[[RequestContext, Placement], Instance | None] | None
    prefill: Instance | None
    decode: Instance
    decode_headers: Headers | None


def leg_plan(body: dict, placement: Placement,
             again: Callable[[RequestContext, Placement], Instance | None] | None = None) -> LegPlan:
    """The plan carrying out ``placement`` with ``body``."""
    rank = placement.rank
    return LegPlan(body, placement, again, placement.prefill, placement.decode,
                   None if rank is None else [(b"x-data-parallel-rank", str(rank).encode())])


class KVConnector:
    name = "base"

    def __init__(self, prefill: PrefillStage | None, decode: DecodeStage) -> None:
        self.prefill = prefill
        self.decode = decode

    @classmethod
    def check_instances(cls, prefill: list) -> None:
        """Raise ValueError when the configured instances lack what this connector needs."""

    async def start(self) -> None:
        """Learn what the connector needs from the instances before serving (optional)."""

    def forget(self, url: str) -> None:
        """The instance at ``url`` joined or left the roster: drop what was learnt about it
        (a restarted instance on the same address is a new engine)."""

    async def open(self, ctx: RequestContext, plan: LegPlan) -> DecodeLeg:
        raise NotImplementedError


class DecodeOnly(KVConnector):
    """No prefill pool (E+PD, or a plain pool of instances): decode does it all."""

    name = "none"

    async def open(self, ctx: RequestContext, plan: LegPlan) -> DecodeLeg:
        return await self.decode.open(ctx, plan.decode, plan.body, plan.decode_headers)


class NixlPull(KVConnector):
    """NIXL pull (docs/protocol.md §3.3): prefill first; its ``kv_transfer_params`` go to decode
    verbatim, and decode READs the blocks from the prefill instance.

    The prefill then holds the blocks until a decode has read them, or until vLLM's lease on
    them runs out; nothing else frees them (§3.3, "A failed hand-off"). So a decode that
    refused the connection (it never saw the parameters) is replaced at once by another one
    that can take them, and a decode failure that leaves them unread is counted on the
    prefill (``epd_proxy_kv_stranded_total``).
    """

    name = "nixl"
    prefill: PrefillStage  # the pipeline uses a connector with a prefill leg only with a prefill pool
    # A prefill that has not answered within its hedge delay gets a second attempt (hedged.py);
    # None: --no-hedging. Not with a previous turn's parameters (read once, from one decode).
    hedging: PrefillHedging | None = None

    async def open(self, ctx: RequestContext, plan: LegPlan) -> DecodeLeg:
        assert plan.prefill is not None
        body = plan.body
        if ctx.kv_reuse is None:  # the common case, without a coroutine of its own
            if ctx.api is None:  # chat, completions: the prompt encoded once for both legs
                body = prompt_once(body)
            p_body = prefill_body(body, nixl_prefill_request_params(), ctx.api)
            hedging = self.hedging
            if hedging is None or len(plan.placement.prefill_among) < 2:  # no other prefill to hedge on
                kv = await self.prefill.run(ctx, plan.prefill, p_body)
            else:
                hedging.enter(ctx, plan.placement, p_body)
                try:
                    kv = await self.prefill.run(ctx, plan.prefill, p_body)
                except BaseException as failure:
                    kv, plan.prefill = await hedging.instead(ctx, failure)  # the hedge's, or raised again
                else:
                    hedging.leave(ctx)
        else:
            kv = await self._prefill(ctx, plan.prefill, plan.body)
        if kv is None:
            # Without them decode would silently prefill the whole prompt itself.
            log.warning("request %s: prefill instance %s returned no kv_transfer_params", ctx.request_id,
                        plan.prefill.url)
            raise ProxyError(502, "prefill instance returned no kv_transfer_params; is it running with a "
                                  "NIXL kv-transfer-config?", retryable=True)
        body = decode_body(body, kv=kv)
        decode = plan.decode
        try:
            while True:
                try:
                    return await self.decode.open(ctx, decode, body, plan.decode_headers)
                except ProxyError as err:
                    other = self._hand_over(ctx, plan, err)
                    if other is None:
                        raise
                    log.info("request %s: decode instance %s refused the connection; its KV goes to %s",
                             ctx.request_id, decode.url, other.url)
                    decode = other
        except BaseException:
            plan.prefill.stranded += 1
            raise

    async def _prefill(self, ctx: RequestContext, prefill: Instance, body: dict) -> msgspec.Raw | None:
        """The prefill leg; with the previous turn's parameters (multiturn.py) when the request
        has them. A prefill that fails with them (decode's blocks expired, or decode restarted:
        vLLM answers 500) runs once more without them on the same instance: the read never
        fails the request."""
        reuse = ctx.kv_reuse
        if reuse is None:
            return await self.prefill.run(ctx, prefill, prefill_body(body, nixl_prefill_request_params(), ctx.api))
        ctx.kv_reuse = None  # used once, whatever happens
        try:
            return await self.prefill.run(ctx, prefill, prefill_body(body, dict(reuse.params), ctx.api))
        except ProxyError as err:
            if err.unsent:
                ctx.kv_reuse = reuse  # never reached a prefill: still good for the next attempt's
                raise
            if err.status < 500 or prefill in ctx.timed_out:
                raise
            reuse.failed(ctx)
            ctx.excluded.discard(prefill)  # the parameters failed, not the instance
            log.info("request %s: prefill %s failed reading the previous turn's KV (%s); computing it",
                     ctx.request_id, prefill.url, err.message)
        return await self.prefill.run(ctx, prefill, prefill_body(body, nixl_prefill_request_params(), ctx.api))

    @staticmethod
    def _hand_over(ctx: RequestContext, plan: LegPlan, err: ProxyError) -> Instance | None:
        """Another decode for parameters the failed one never received: the placement's decode
        made again (placement/decision.again); None when it cannot be."""
        if not err.unsent or plan.again is None:
            return None
        return plan.again(ctx, plan.placement)


class NixlPush(KVConnector):
    """NixlPushConnector (docs/protocol.md §3.4): prefill WRITEs the KV into decode, so both legs
    start at once and decode is told the prefill's identity up front.

    The legs race until decode's first event: a prefill failure before then
    cancels decode (closing its connection so vLLM aborts it) and becomes the
    answer. After that the prefill leg rides along as ``companion``: the relay
    turns its failure into an in-band error, and if decode finishes first the
    prefill is left to finish in the background, bounded by the prefill timeout.
    """

    name = "nixl-push"
    prefill: PrefillStage  # as in NixlPull

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

    async def legs(self, ctx: RequestContext, plan: LegPlan, leg_id: str, transfer_id: str
                   ) -> tuple[dict, dict, Headers | None]:
        """The prefill's and decode's ``kv_transfer_params``, and extra prefill headers."""
        assert plan.prefill is not None
        return (nixl_prefill_request_params(transfer_id),
                self.decode_params(plan.prefill.spec, leg_id, transfer_id), None)

    async def open(self, ctx: RequestContext, plan: LegPlan) -> DecodeLeg:
        # vLLM's push connector pairs the legs by their X-Request-Id (this build reads
        # no transfer_id), so each attempt gets its own id on both legs: a client that
        # reuses an id, or a retry, must never meet a prefill left from another one.
        # One transfer id as well, for connectors that do pair by it.
        leg_id = f"{ctx.request_id}-{hex_id(48)}"
        transfer_id = f"xfer-{uuid4_str()}"
        assert plan.prefill is not None
        p_kv, d_kv, p_headers = await self.legs(ctx, plan, leg_id, transfer_id)
        body = prompt_once(plan.body) if ctx.api is None else plan.body  # chat, completions: encoded once
        p_body = prefill_body(body, p_kv, ctx.api)
        d_body = decode_body(body, kv=d_kv)
        loop = asyncio.get_running_loop()
        prefill = loop.create_task(self.prefill.run(ctx, plan.prefill, p_body, p_headers, request_id=leg_id))
        decode = loop.create_task(self.decode.open(ctx, plan.decode, d_body, plan.decode_headers,
                                                   request_id=leg_id))
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if prefill.done() and not decode.done():
                failure = prefill.exception()
                if failure is not None:
                    raise failure
                t = time.perf_counter()
                await asyncio.wait((decode,))  # prefill is done: only decode's answer is left
                ctx.timing("kv_handoff", time.perf_counter() - t)
            leg = decode.result()  # raises decode's failure
        except BaseException:
            await _cancel(decode)
            await _cancel(prefill)
            raise
        leg.companion = prefill
        return leg


async def _cancel(task: asyncio.Task) -> None:
    """Cancel a leg and wait until it has closed its connection. Our own
    cancellation (the client left) still propagates."""
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))
    if not task.cancelled():
        task.exception()  # retrieved: the caller reports the failure that matters


class Mooncake(NixlPush):
    """MooncakeConnector (docs/protocol.md §3.5): like push, both legs at once, but decode finds the
    prefill through its bootstrap server and the engine id of the DP rank serving it.

    Engine ids come from ``GET <bootstrap>/query`` (``{"0": {"engine_id": ...}}``),
    asked at start-up and again whenever a prefill's are still unknown. A prefill
    that has not answered yet fails only the requests routed to it (retryable,
    so they move to another prefill), unlike the reference proxy, where one
    missing prefill blocks everything.
    """

    name = "mooncake"

    def __init__(self, prefill: PrefillStage | None, decode: DecodeStage) -> None:
        super().__init__(prefill, decode)
        self._engines: dict[str, list[str]] = {}  # prefill URL -> engine id per DP rank
        self._rank_cursor: dict[str, int] = {}

    @classmethod
    def check_instances(cls, prefill: list) -> None:
        for spec in prefill:
            if spec.bootstrap_port is None:
                raise ValueError(f"--kv-connector mooncake needs each prefill's bootstrap port, e.g. "
                                 f"'{spec.url};bootstrap_port=8998' (VLLM_MOONCAKE_BOOTSTRAP_PORT)")

    @staticmethod
    def bootstrap_addr(spec) -> str:
        return f"http://{spec.kv_host or spec.host}:{spec.bootstrap_port}"

    async def start(self) -> None:
        await asyncio.gather(*(self._query(inst) for inst in self.prefill.pool.instances),
                             return_exceptions=True)

    def forget(self, url: str) -> None:
        self._engines.pop(url, None)
        self._rank_cursor.pop(url, None)

    async def _query(self, inst: Instance) -> list[str]:
        known = self._engines.get(inst.url)
        if known:
            return known
        url = self.bootstrap_addr(inst.spec)
        connections = ConnectionPool(url, idle_timeout=0)
        try:
            t = TransportTimeouts(connect=2.0, headers=5.0, idle=5.0)
            status, _, data = await connections.fetch("GET", "/query", timeouts=t)
            ranks = msgspec.json.decode(data) if status == 200 else None
            engines = [ranks[k]["engine_id"] for k in sorted(ranks, key=int)] if isinstance(ranks, dict) else []
        except (UpstreamError, msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            log.warning("prefill %s: its Mooncake bootstrap server %s did not answer /query: %s", inst.url,
                        url, exc)
            raise ProxyError(503, "prefill instance's Mooncake bootstrap server did not answer", retryable=True
                             ) from None
        finally:
            await connections.close()
        if not engines:
            log.warning("prefill %s: its Mooncake bootstrap server %s reported no engine ids", inst.url, url)
            raise ProxyError(503, "prefill instance's Mooncake bootstrap server reported no engine ids",
                             retryable=True)
        self._engines[inst.url] = engines
        return engines

    async def legs(self, ctx: RequestContext, plan: LegPlan, leg_id: str, transfer_id: str
                   ) -> tuple[dict, dict, Headers | None]:
        assert plan.prefill is not None
        try:
            engines = await self._query(plan.prefill)
        except ProxyError:
            ctx.failed(plan.prefill)
            raise
        # Rotate over the prefill's DP ranks, so every rank gets work.
        n = self._rank_cursor.get(plan.prefill.url, 0)
        self._rank_cursor[plan.prefill.url] = n + 1
        rank = n % len(engines)
        p_kv = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
        d_kv = {"do_remote_decode": False, "do_remote_prefill": True,
                "remote_bootstrap_addr": self.bootstrap_addr(plan.prefill.spec),
                "remote_engine_id": engines[rank], "transfer_id": transfer_id}
        return p_kv, d_kv, [(b"x-data-parallel-rank", str(rank).encode())]


CONNECTORS: dict[str, type[KVConnector]] = {"nixl": NixlPull, "nixl-push": NixlPush, "mooncake": Mooncake}


def check_connector_config(config: ProxyConfig) -> None:
    """Raise ValueError when ``--kv-connector`` names no connector here, or a configured
    prefill instance lacks what that connector needs (part of ``app.validate_config``;
    a registered prefill is checked by the same ``check_instances``)."""
    connector = CONNECTORS.get(config.kv_connector)
    if connector is None:
        raise ValueError(f"unknown --kv-connector {config.kv_connector!r} (known: {', '.join(CONNECTORS)})")
    gather(partial(connector.check_instances, [spec]) for spec in config.prefill)  # each one named
