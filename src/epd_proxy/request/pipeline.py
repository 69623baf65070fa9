"""One client request, top to bottom: parse → encode → prefill/decode → commit → relay.

Nothing reaches the client until encode and prefill have succeeded and
decode's first event has been checked (the *commit point*). Before it, any
failure can still be retried (fresh handles, other instances) or answered
with a real status, in the envelope of the request's API; after it, a failure
is an in-band error in the stream's own form (``request/apis.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from epd_proxy.config import ProxyConfig
from epd_proxy.encode.media_policy import MediaPolicy
from epd_proxy.encode.multimodal import MediaItem, own_media
from epd_proxy.http import Headers
from epd_proxy.http.response import Request, ResponseWriter
from epd_proxy.instances.adapters import Adapters
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.instances.roster import needs_role
from epd_proxy.observe.access_log import AccessLog
from epd_proxy.observe.metrics import ProxyMetrics
from epd_proxy.observe.recent import RecentRequests
from epd_proxy.observe.record import RequestRecord
from epd_proxy.observe.server_timing import ServerTiming
from epd_proxy.observe.tokens import usage_of
from epd_proxy.placement.decision import (
    HOLDS_PROMPT,
    Known,
    Placement,
    again,
    another_decode,
    moved_off_wedged,
    place,
    worth_retrying,
)
from epd_proxy.placement.steered import Steering
from epd_proxy.request.admission import ADMIT, SHED, Admission, overloaded
from epd_proxy.request.answer import Answers
from epd_proxy.request.apis import (
    GENERATE,
    GENERATION_APIS,
    MEDIA,
    PREVIOUS_RESPONSE,
    GenerationApi,
    encodable,
    response_id,
    speaks_anthropic,
)
from epd_proxy.request.context import RequestContext
from epd_proxy.request.deadline import Deadlines
from epd_proxy.request.entry_gate import EntryGate
from epd_proxy.request.ingress import CHAT, COMPLETIONS, parse_body, request_id
from epd_proxy.request.legs.connectors import DecodeOnly, KVConnector, leg_plan
from epd_proxy.request.legs.fanout import EncoderFanout
from epd_proxy.request.legs.stage_bodies import stream_options_with_usage
from epd_proxy.request.legs.stages import DecodeLeg
from epd_proxy.request.migration import Migrations
from epd_proxy.request.relay import StreamRelay
from epd_proxy.request.stored_responses import StoredResponses
from epd_proxy.request.turns.reuse import TurnReuse
from epd_proxy.routing.view import RequestView
from epd_proxy.tenants.key_scope import salt
from epd_proxy.tenants.limiter import Tenants, Ticket
from epd_proxy.wire.errors import ProxyError, drop_traceback

if TYPE_CHECKING:
    from epd_proxy.observe.tracing import Tracing
    from epd_proxy.placement.kv_lookup import KvLookup
    from epd_proxy.placement.shared_homes import SharedHomes

log = logging.getLogger("epd_proxy.pipeline")

class Pipeline:
    """Runs requests through the configured pools with one KV connector."""

    def __init__(self, config: ProxyConfig, pools: dict[str, InstancePool], metrics: ProxyMetrics, *,
                 known: Known, fanout: EncoderFanout, connector: KVConnector, decode_only: DecodeOnly,
                 admission: Admission, role_caps: dict[str, Admission], gate: EntryGate, reuse: TurnReuse,
                 answers: Answers, stored: StoredResponses, media_policy: MediaPolicy, deadlines: Deadlines | None,
                 tenants: Tenants, base_headers: Headers, recent: RecentRequests,
                 tracing: Tracing | None = None, adapters: Adapters | None = None, kv: KvLookup | None = None,
                 homes: SharedHomes | None = None) -> None:
        """Every collaborator is built for it (``runtime/build.py``)."""
        self.config = config
        self.metrics = metrics
        # Every role's pool exists, possibly empty (instances register at run time).
        self.encode = pools["encode"] if "encode" in pools else InstancePool("encode", ())
        self.prefill = pools["prefill"] if "prefill" in pools else InstancePool("prefill", ())
        self.decode = pools["decode"]
        self.models = self.decode.served.directory  # the cluster's models (every pool tells the same directory)
        # Loads a LoRA adapter no instance has when a source knows it (None, or without sources: never).
        self.adapters = adapters if adapters is not None and adapters.on_demand else None
        self.known = known  # what the placement knows besides the request (placement/decision.py)
        # The sidecar's (placement/steered.py): the prefill and encoders the gateway's headers name. None: the proxy.
        self.steering: Steering | None = None
        self._debug = log.isEnabledFor(logging.DEBUG)  # each placement's reasons logged (set at start-up)
        # The encode stage runs while encoders are there, or when the topology needs it (its empty
        # pool then answers 503).
        self._need_encode = needs_role(config, "encode")
        self.fanout = fanout
        self.connector = connector
        self.decode_only = decode_only  # no prefill instances (E+PD, PD)
        self.retries = config.decode_retries
        # A committed stream whose decode breaks off goes on elsewhere (migration.py).
        self.migrations = Migrations(config.stream_migration, config.migration_limit, metrics.migrations,
                                     known.decode, decode_only.decode)
        # The request's routing keys are computed only when a policy reads them.
        self._keyed = any(p.policy.uses_view for p in pools.values())
        self._background: set[asyncio.Task] = set()  # strong references to legs outliving a response
        self._base_headers = base_headers  # every upstream call's (--upstream-api-key)
        self._forward = tuple(h.lower().encode() for h in config.forward_headers)
        self._salt_per_key = config.access.cache_salt_per_key  # vLLM's cache_salt from each client key
        self.media_policy = media_policy
        # Read on every chat request: bound here, not looked up in the config each time.
        self._ignore_client_uuids = config.media.ignore_client_uuids
        self.admission = admission
        # Per-stage caps (--max-inflight-per-role): a slow pool cannot gather unbounded waiters.
        self.role_caps = role_caps
        self.first_byte = config.timeouts.first_byte
        self.deadlines = deadlines  # the first-byte timeout's sweep (None: no such timeout)
        # Set by the shutdown (serve.py): ``closing`` refuses new requests with 503,
        # ``stopping`` ends the ones still running (see handle's CancelledError branch).
        self.stopping = False
        self.tracing = tracing  # when OTEL_* turns it on
        # The console's ring of recent requests (recent.py): filled only while someone looks.
        self.recent = recent
        self.stored = stored  # Responses stored on the decode instance that made them (stored_responses.py)
        # Multi-turn KV reuse (turns/reuse.py): decode's parameters kept for each conversation's next turn.
        self.reuse = reuse
        self.turns = reuse.store
        self.answers = answers  # what decode's answer goes through (answer.py)
        self.server_timing = ServerTiming()
        # Per-key limits, classes, model rules and aliases (tenants/limiter.py); off (inactive,
        # no aliases) without the cluster file's tables: two attribute tests per request.
        self.tenants = tenants
        self.gate = gate  # the key's limits and the slot, before the body is read (entry_gate.py)
        self.kv = kv  # the block index from KV events, consulted before the placement (placement/kv_lookup.py)
        self.homes = homes  # where other replicas sent turns, consulted before the placement (shared_homes.py)

    @property
    def access_log(self) -> AccessLog | None:
        return self.gate.access_log

    @access_log.setter
    def access_log(self, log: AccessLog | None) -> None:
        self.gate.access_log = log

    def close_admission(self) -> None:
        """Shutting down: every new request is answered 503 at once (in-flight ones go on)."""
        self.gate.close()

    async def admit(self, req: Request, writer: ResponseWriter, path: str, t0: float,
                    ticket: Ticket | None = None) -> bool:
        """The same slots and queue for a request the pipeline does not run (forward.py):
        True with a slot taken (give it back with :meth:`leave`), else answered 429/503."""
        return not self.gate.gated or await self.gate.admit(req, writer, path, t0, ticket)

    def leave(self) -> None:
        """Give back the slot :meth:`admit` took."""
        self.gate.leave()

    async def enter_tenant(self, req: Request, writer: ResponseWriter, path: str, t0: float,
                           key: str | None) -> Ticket | None:
        """The request's ticket against its key's limits, or None: refused, answered (entry_gate.py)."""
        return await self.gate.enter_tenant(req, writer, path, t0, key)

    # -- the request path -------------------------------------------------------------------
    async def handle(self, req: Request, writer: ResponseWriter, path: str, key: str | None = None,
                     scope: bytes | None = None) -> None:
        """``key``: the name of the client key the request presented (client_auth.py), ``scope``
        its scope (tenants/key_scope.py)."""
        t0 = time.perf_counter()
        ticket = None
        if self.tenants.active:  # the key's limits, before it may take a queue place
            ticket = await self.gate.enter_tenant(req, writer, path, t0, key)
            if ticket is None:
                return
        gate = self.gate
        if gate.gated and not await gate.admit(req, writer, path, t0, ticket):
            return
        rec = RequestRecord(request_id(req), req.method, path, t0, req.peer, req.headers, key, self.metrics.no_model)
        rec.ticket = ticket
        self.metrics.inflight += 1
        try:
            try:
                ctx, body, items = self._prepare(req, rec, scope)
            except ProxyError as err:
                if err.code != "model_not_found":
                    raise
                if self.adapters is None or not self.adapters.loadable(rec.model):
                    raise self._not_found(err, rec) from None
                try:
                    await self.adapters.ensure(rec.model)  # type: ignore[arg-type]  # loadable: a name
                except ProxyError as failed:
                    raise self._not_found(failed, rec) from None
                ctx, body, items = self._prepare(req, rec, scope)  # routed with the adapter where it was loaded
            leg = await self._open(ctx, body, items)
            await self._answer(writer, ctx, body, leg, rec)
        except ProxyError as err:
            self._answer_error(writer, err, rec)
        except asyncio.CancelledError:
            rec.outcome = "shutdown"
            if not (self.stopping and self._end_at_shutdown(writer, rec.request_id, rec.path)):
                rec.outcome = "client_gone"
                self.metrics.disconnects += 1
                raise
        finally:
            self._observe(rec, writer)

    def _prepare(self, req: Request, rec: RequestRecord, scope: bytes | None
                 ) -> tuple[RequestContext, dict, list[MediaItem]]:
        """The body parsed, its media checked and owned, and the request's context."""
        path = rec.path
        body = parse_body(req, path)
        model = body.get("model")
        rec.model = model if type(model) is str else None
        api = GENERATION_APIS.get(path)  # None: chat or completions
        if body.get("stream") is True:
            rec.stream = True
            # Every stream's tokens are counted: decode is asked for its usage event, which
            # the client gets only if it asked for it too (usage/hidden.py).
            options = stream_options_with_usage(body.get("stream_options")) if api is None else None
            if options is not None:
                body["stream_options"] = options
                rec.hide_usage = True
        body, items = self._media(body, scope) if path == CHAT else (body, [])
        ctx = rec.ctx = RequestContext(rec.request_id, path, self._headers_for(req))
        if scope is not None:  # client keys: what it stores and reads back is its key's (tenants/key_scope.py)
            ctx.scope = scope
            if self._salt_per_key and (path == CHAT or path == COMPLETIONS):
                salt(body, scope)
        if "conversation_id" in body:  # vLLM's multi-turn hint: read here, never forwarded
            hint = body.pop("conversation_id")
            ctx.conversation = hint if type(hint) is str else None
        model = asked = body.get("model")
        tenants = self.tenants
        if tenants.aliases is not None:  # an alias (or a name no instance serves) to its served model
            model = tenants.aliases.resolve(model, self.models.current)
            if model is not asked:
                body["model"] = model
                rec.model = model if type(model) is str else None
        ticket = rec.ticket
        if ticket is not None:
            if model is not None:  # 403 before the route: no adapter is loaded for a model the key may not use
                tenants.check_model(ticket, asked, model)
            priority = tenants.engine_priority(ticket, body.get("priority"))  # the key's class, at most lowered
            if priority is not None:
                body["priority"] = priority  # the encoders' requests copy it (encoder_plan.py)
        models = self.models.current.route(model)  # 404 / 400 here, before any upstream work
        if models is not None:
            ctx.models = models
            if model is None:  # the cluster's only model, named for the instances that serve others too
                model = body["model"] = models["decode"]
                rec.model = model if type(model) is str else None
        if model is None and ticket is not None:  # 403: the cluster's only model, if the key may not use it
            bases = self.models.current.bases
            tenants.check_model(ticket, None, bases[0] if len(bases) == 1 else None)
        # A model the cluster serves: its metrics series (one lookup once it has one).
        rec.series = (type(model) is str and self.metrics.models.get(model)) or self.metrics.model(model)
        if api is not None:
            items = self._api_request(ctx, api, body)
        if items:
            rec.items = len(items)
        if self._keyed:
            ctx.view = RequestView(body, items, path == CHAT or (api is not None and api.chat_view))
        if self.tracing is not None:
            ctx.trace = self.tracing.start(req.method, path, rec.request_id, req.headers)
        if self.steering is not None:  # the sidecar: the legs the gateway named (403: an address not allowed)
            ctx.steered = self.steering.read(req.headers, ctx.excluded)
        return ctx, body, items

    def _not_found(self, err: ProxyError, rec: RequestRecord) -> ProxyError:
        """An unknown model's 404 naming only the models the request's key may use (all: ``err``)."""
        ticket = rec.ticket
        ids = None if ticket is None or err.code != "model_not_found" else \
            self.tenants.model_ids(ticket.key, self.models.current)
        return err if ids is None else self.models.current.not_found(str(rec.model), ids)

    async def _continuation(self, ctx: RequestContext, body: dict) -> DecodeLeg:
        """A broken stream's continuation opened like an attempt (placed anew without the decodes
        that failed it), apart from multi-turn reuse: it is not a turn of the conversation; never
        back on a decode that failed it."""
        if not another_decode(ctx, self.known):
            raise ProxyError(503, "no other decode is in rotation")
        return await self._open(ctx, body, [], fresh=True)

    async def _open(self, ctx: RequestContext, body: dict, items: list[MediaItem], fresh: bool = False) -> DecodeLeg:
        """Attempts until decode is open and checked, under the first-byte deadline
        (``--first-byte-timeout``) if there is one; retryable failures get a fresh attempt."""
        deadlines = self.deadlines
        task = None if deadlines is None else deadlines.enter()
        attempt = 0
        moved = 0  # attempts whose decode stood still (placement/decision.py: moved_off_wedged)
        try:
            while True:
                first_leg = len(ctx.legs)
                try:
                    return await self._attempt(ctx, body, items, fresh)
                except ProxyError as err:
                    free = moved < len(self.known.decode) and moved_off_wedged(ctx, self.known, ctx.legs[first_leg:])
                    if not err.retryable or (attempt >= self.retries and not free) or not worth_retrying(
                            ctx, self.known, err.unsent):
                        raise
                    drop_traceback(err)
                    if free:
                        moved += 1
                    else:
                        attempt += 1
                    self.metrics.retries += 1
                    retried = self.metrics.instance_retries
                    for inst in ctx.legs[first_leg:]:  # the instances this attempt failed on
                        if inst in ctx.excluded:
                            key = (inst.role, inst.url)
                            retried[key] = retried.get(key, 0) + 1
                    log.info("request %s: attempt %d failed (%s); retrying", ctx.request_id, attempt, err.message)
        except asyncio.CancelledError:
            if task is None or not deadlines.expired(task):  # type: ignore[union-attr]  # task: deadlines
                raise
            # The cancellation closed every leg on its way out (their finally blocks).
            task.uncancel()
            raise ProxyError(504, f"no response within the first-byte timeout "
                                  f"({self.first_byte:g} s); the request was abandoned") from None
        finally:
            if task is not None:
                deadlines.leave(task)  # type: ignore[union-attr]
                # Kept in this frame, the task would close a reference cycle through the
                # traceback of a later failure (the task holds its exception).
                task = None

    async def _answer(self, writer: ResponseWriter, ctx: RequestContext, body: dict, leg: DecodeLeg,
                      rec: RequestRecord) -> None:
        """The commit: the whole answer sent, or the stream relayed; then the companion leg settled."""
        headers = [(b"x-request-id", rec.request_id.encode())] + \
            self.server_timing.header(ctx.timings, rec.model, ctx.kv_outcome)
        if rec.ticket is not None:
            headers += rec.ticket.headers(self.tenants.clock())  # the rate-limit headers its SDK reads
        since = rec.first_byte = time.perf_counter() - rec.start
        self.metrics.observe_commit(rec.path, since, ctx.upstream, leg.body is None, rec.series)
        ok = False
        try:
            api = ctx.api
            if api is not None and api.stateful and body.get("store") is not False:
                self._remember(leg, ctx.scope)
            if leg.body is not None:
                answers = self.answers
                rec.answer, rec.tokens = answers.whole(ctx, body, leg, api)
                if answers.writes:  # a kept turn: in the shared store before the client can send the next
                    await answers.written()
                writer.send(leg.resp.status, rec.answer, leg.resp.content_type, headers)
                ok = True
                rec.outcome = "ok"
                return
            migrations = self.migrations
            if not migrations.applies(ctx.path, body, rec.items):
                migrations = None  # type: ignore[assignment]
            relay = await self.answers.stream(writer, ctx, body, leg, headers, rec.hide_usage, api, migrations)
            if relay.broken is not None:  # after the commit: continued on another decode (migration.py)
                rec.moves = []
                relay, leg = await migrations.carry_on(writer, ctx, body, leg, relay, rec.hide_usage,
                                                       self._continuation, rec.moves, self._settle, rec.start)
            ok = relay.error is None
            rec.outcome, rec.answer = "ok" if ok else "in_band_error", relay.final_bytes()
            gap = relay.gap()
            if gap is not None:
                rec.gap = gap
                self.metrics.observe_gap(gap, rec.series)
            if relay.error is not None:  # not ok
                self.metrics.stream_errors += 1
                log.warning("request %s: stream ended in-band: %s", rec.request_id, relay.error.message)
        finally:
            if leg.companion is not None:
                self._settle(leg.companion, keep=ok)

    def _answer_error(self, writer: ResponseWriter, err: ProxyError, rec: RequestRecord) -> None:
        """A failure before the commit is the client's status; after it the relay has said it in-band."""
        drop_traceback(err)
        if not writer.started:
            rec.outcome = err.outcome
            headers = [(b"x-request-id", rec.request_id.encode())]
            if err.headers is not None:
                headers += err.headers
            elif err.status in _RETRY_AFTER:
                headers.append((b"retry-after", _RETRY_AFTER[err.status]))
            writer.send(err.status, err.body(speaks_anthropic(rec.path)), err.content_type(), headers)
        if err.status >= 500:
            log.warning("request %s failed: %s", rec.request_id, err.message)

    def _observe(self, rec: RequestRecord, writer: ResponseWriter) -> None:
        """The request is over: its slot and instances released, and the record told to the
        metrics, the trace and the access log."""
        writer.flow = None  # the relay refers to the writer: no cycle left behind
        self.metrics.inflight -= 1
        # 499: the client went away before a status was sent (nginx's convention).
        status = writer.status or 499
        access = self.gate.access_log  # the attribute, not the property: every request reads it
        tokens = rec.tokens or usage_of(rec.answer)  # read once: the usage rewrite's, if it read them
        if tokens[1] is not None:
            self.metrics.observe_tokens(rec.series, tokens)
        ctx = rec.ctx
        if ctx is not None:
            if ctx.kv_outcome is not None:  # the turn's outcome counted; what it took and never ran let go
                self.reuse.ended(ctx)
            if ctx.trace is not None:
                ctx.trace.finish(status, rec.stream, tokens, rec.outcome)
            ctx.release_all()
            self.metrics.observe_stages(ctx.timings)
        if self.admission.limit:
            self.admission.leave()
        if rec.ticket is not None:
            self.tenants.leave(rec.ticket, status, tokens)  # its tokens settled from the usage
        seconds = time.perf_counter() - rec.start
        self.metrics.observe_request(rec.path, status, seconds, rec.stream, rec.series)
        if access is not None:
            access.request(rec, status, tokens, writer.bytes_sent, seconds)
        if self.recent.on:  # a console looked lately (recent.py)
            self.recent.add(rec, status, tokens, writer.bytes_sent, seconds)

    def _end_at_shutdown(self, writer: ResponseWriter, rid: str, path: str) -> bool:
        """The shutdown timeout cancelled this request (not its client): end it properly.
        Before the commit: 503 with the envelope; a committed stream: the in-band error
        event and ``[DONE]``. Returns False when nothing can be said any more."""
        if writer.disconnected or writer.finished:
            return False
        err = ProxyError(503, "the proxy shut down before the response was complete")
        if not writer.started:
            writer.keep_alive = False
            writer.send(503, err.body(speaks_anthropic(path)), b"application/json", [(b"retry-after", b"1")])
        elif isinstance(writer.flow, StreamRelay):
            writer.flow.fail(err)
        else:
            return False
        log.warning("request %s: ended by the shutdown timeout", rid)
        return True

    async def _attempt(self, ctx: RequestContext, body: dict, items: list[MediaItem], fresh: bool = False
                       ) -> DecodeLeg:
        """One attempt: what the placement needs looked up (only where its feature applies), the
        placement made (placement/decision.py), and carried out, every handle built anew from the
        untouched client body."""
        ctx.prefill_report = None
        ctx.ids_asked = False  # this attempt's decode, asked below
        if ctx.api is not None and ctx.whole is not None:
            return await self._whole(ctx, body)
        kv = self.kv if self.kv is not None and self.kv.feed.readers else None  # KV events subscribed
        if kv is not None:
            await kv.prepare(ctx, body, bool(items))
        if self.homes is not None and ctx.view is not None:  # where other replicas sent turns (shared_homes.py)
            await self.homes.recall(ctx.view)
        reuse = self.reuse
        turns = self.turns
        # Chat, completions, generate (turns/reuse.py); generate answers with its token ids anyway.
        reusing = turns is not None and not fresh and (ctx.api is None or ctx.path == GENERATE)
        found = await reuse.lookup(ctx, body, bool(items)) if reusing and turns.active else None  # type: ignore[union-attr]
        encoded = items if items and (self.encode or self._need_encode) else ()
        steered = ctx.steered
        if steered is not None and not steered.encoders:  # the sidecar: no encoder named, none runs
            encoded = ()
        placed = place(ctx, self.known, bool(items), found, False, None, encoded)
        if steered is not None:  # the sidecar: the prefill the gateway named
            placed = self.steering.apply(steered, placed, ctx.excluded)  # type: ignore[union-attr]
        if self._debug:
            log.debug("request %s: placed %s", ctx.request_id, placed.reasons())
        ctx.placement = placed
        if kv is not None:  # the chosen instance's blocks counted as held there (speculative entries)
            if placed.decode_why is HOLDS_PROMPT:
                counts = self.metrics.not_disaggregated
                counts["cached"] = counts.get("cached", 0) + 1
            kv.chosen(placed.prefill or placed.decode, ctx)
        caps = self.role_caps
        if encoded:
            cap = caps.get("encode") if caps else None
            if cap is not None:
                await _take_slot("encode", cap)
            t = time.perf_counter()
            try:
                body = await self.fanout.run(ctx, body, items, placed.consumer_zmq, placed.encoders)
            finally:
                ctx.upstream += time.perf_counter() - t
                if cap is not None:
                    cap.leave()
        if reusing and (turns.active or (placed.prefill is not None  # type: ignore[union-attr]
                                         and reuse.probes(placed.decode))):
            # What the decode is asked for the next turn, and the previous turn used as placed.
            body = await reuse.prepare(ctx, body, placed, found, bool(items))
        p = placed.prefill
        connector = self.connector if p is not None else self.decode_only
        cap = caps.get("prefill") if caps and p is not None else None
        if cap is not None:
            # Held until decode's first event: in push mode the prefill runs that long anyway.
            await _take_slot("prefill", cap)
        t = time.perf_counter()
        try:
            return await connector.open(ctx, leg_plan(body, placed, self._again))
        finally:
            ctx.upstream += time.perf_counter() - t
            if cap is not None:
                cap.leave()

    def _again(self, ctx: RequestContext, placed: Placement) -> Instance | None:
        """The placement's decode made again without the ones that failed (the KV hand-over)."""
        return again(placed, ctx, self.known)

    def _api_request(self, ctx: RequestContext, api: GenerationApi, body: dict) -> list[MediaItem]:
        """Another generation API (apis.py): its media checked, whether it is split, and the
        items the encoders get (docs/protocol.md §2.9)."""
        ctx.api = api
        media = api.media(body)
        if media:
            self.media_policy.check(media)
        reason = api.whole(body)
        if reason is None and media and (self.encode or self._need_encode) and not encodable(media):
            reason = MEDIA  # an item with no URL to send an encoder (an uploaded file's id)
        ctx.whole = reason
        if reason is not None:
            counts = self.metrics.not_disaggregated
            counts[reason] = counts.get(reason, 0) + 1
            log.debug("request %s: served whole by one instance (%s)", ctx.request_id, reason)
            return []
        return media

    async def _whole(self, ctx: RequestContext, body: dict) -> DecodeLeg:
        """A request served whole by one decode (or PD) instance: the one that holds its
        previous response, else the pool's choice."""
        owner = None
        prev = body.get("previous_response_id") if ctx.whole == PREVIOUS_RESPONSE else None
        if isinstance(prev, str):
            owner = await self.stored.locate(ctx, prev)
        placed = ctx.placement = place(ctx, self.known, whole=True, owner=owner)
        t = time.perf_counter()
        try:
            return await self.decode_only.open(ctx, leg_plan(body, placed))
        finally:
            ctx.upstream += time.perf_counter() - t

    def _remember(self, leg: DecodeLeg, scope: bytes | None) -> None:
        """A Responses answer: which decode holds it, for which key (stored_responses.py)."""
        rid = response_id(leg.body, False) if leg.body is not None else response_id(leg.first, True)
        if rid:
            self.stored.owners.remember(rid, leg.inst.url, scope)

    def _settle(self, companion: asyncio.Task, keep: bool) -> None:
        """A leg still running when the response is over: left to finish in the background
        (bounded by its own stage timeout) after success, cancelled otherwise."""
        if companion.done():
            if not companion.cancelled():
                companion.exception()  # retrieved: already reported in-band or irrelevant
            return
        if not keep:
            companion.cancel()
        self._background.add(companion)
        companion.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background leg failed after its response ended: %s", task.exception())

    async def close(self) -> None:
        if self.deadlines is not None:
            await self.deadlines.close()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.migrations.close()
        await self.reuse.close()
        await self.tenants.close()
        if self.steering is not None:
            await self.steering.close()

    # -- helpers ------------------------------------------------------------------------------
    def _media(self, body: dict, scope: bytes | None) -> tuple[dict, list[MediaItem]]:
        """The media items, checked against the operator's rules, and the body with client
        uuids namespaced, by the key's scope too (what every stage gets instead of the client's body)."""
        body, items = own_media(body, ignore_client_uuids=self._ignore_client_uuids, scope=scope)
        if items:
            self.media_policy.check(items)
        return body, items

    def _headers_for(self, req: Request) -> Headers:
        extra = []  # a loop, not a list comprehension (its own frame): every request
        headers = req.headers
        for name in self._forward:
            value = headers.get(name)
            if value is not None:
                extra.append((name, value))
        return self._base_headers + extra if extra else self._base_headers


_RETRY_AFTER = {503: b"5", 429: b"1"}


async def _take_slot(role: str, cap: Admission) -> None:
    """A slot of a stage's cap, after waiting in its queue if need be; 429 past it."""
    verdict = cap.try_enter()
    if verdict == ADMIT or (verdict != SHED and await cap.wait()):
        return
    raise overloaded(f"the {role} stage is")
