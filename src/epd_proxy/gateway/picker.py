"""The endpoint picker's shell: one request the gateway asks about, from its headers and body
to the ordered endpoints (or the refusal), and what the gateway reports back.

It runs what the proxy's own request path runs before it routes, with the same objects the
composition root built (``runtime/build.py``): the client key, the key's limits and class
(``tenants/``: a refusal is a 429 or 403 in the request's API envelope), the ``--max-inflight``
slot, the body read (``request/ingress.py``: fields the proxy owns taken out), the model alias
(the body rewritten), the model's instances (404/400/503 as the proxy answers), an adapter
loaded on demand, the block index lookup (``placement/kv_lookup.py``); then the one decision,
``pick.pick``. A request it placed is held until the gateway's stream ends: its instance's
in-flight count (what the load policies read), its speculative KV entries on the instance the
gateway reports having served it, its key's concurrency and tokens settled from the answer's
usage, the request counted in ``/metrics`` like the proxy's own.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from epd_proxy.api.client_auth import CHALLENGE, ClientKeys, unauthorized
from epd_proxy.config import ProxyConfig
from epd_proxy.encode.media_policy import MediaPolicy
from epd_proxy.encode.multimodal import own_media
from epd_proxy.gateway.pick import Known, Pick, PickView, endpoint, pick
from epd_proxy.http.response import Request, parsed_request
from epd_proxy.instances.adapters import Adapters
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.observe.metrics import ModelSeries, ProxyMetrics
from epd_proxy.observe.record import RequestRecord
from epd_proxy.observe.tokens import NO_TOKENS, usage_of
from epd_proxy.placement.decision import Known as PlacementKnown
from epd_proxy.placement.kv_lookup import KvLookup
from epd_proxy.request.admission import ADMIT, SHED, Admission, shed_error
from epd_proxy.request.apis import GENERATION_APIS, speaks_anthropic
from epd_proxy.request.context import RequestContext
from epd_proxy.request.entry_gate import EntryGate
from epd_proxy.request.ingress import CHAT, COMPLETIONS, PROXY_OWNED_FIELDS, parse_body, request_id
from epd_proxy.routing.endpoints import request_model
from epd_proxy.routing.view import RequestView
from epd_proxy.tenants.key_scope import salt
from epd_proxy.tenants.limiter import Tenants, Ticket
from epd_proxy.wire.blobs import encode_json
from epd_proxy.wire.errors import ProxyError

log = logging.getLogger("epd_proxy.epp")

# What one decision came to (``epd_proxy_epp_decisions_total{outcome}``).
OUTCOMES = ("picked", "rewritten", "none_eligible", "shed", "refused")
# A refused key's messages, as the proxy's own front door words them (client_auth.py); each
# refusal raises a fresh error (one raised again and again would carry every traceback).
_MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>'"
_INVALID_KEY = "invalid API key"


@dataclasses.dataclass
class Ask:
    """What the gateway tells of one request: its method, target, headers (lower-case names),
    whole body, and its subset hint (None: the whole pool)."""

    method: str
    target: bytes
    headers: dict[bytes, bytes]
    body: bytes
    subset: frozenset[str] | None = None


@dataclasses.dataclass
class Refusal:
    """No endpoint: the answer the gateway gives the client instead, in its API's envelope."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]


class Lease:
    """One placed request, until the gateway's stream for it ends."""

    __slots__ = ("ctx", "rec", "ticket", "ticket_key", "admitted", "path", "start", "chosen", "served", "series",
                 "stream", "status", "tail", "ended", "model", "nbytes", "outcome")

    def __init__(self, ctx: RequestContext, rec: RequestRecord, path: str, start: float) -> None:
        self.ctx = ctx
        self.rec = rec  # what the access log and the console are told at the end
        self.nbytes = 0  # the answer's body bytes that passed through the picker
        self.outcome: str | None = None  # a refusal's count, when its status does not say it
        self.ticket: Ticket | None = None
        self.ticket_key: str | None = None  # its key (kept after the ticket is given back)
        self.model: object = None  # the model the body named
        self.admitted = False  # holds a --max-inflight slot
        self.path = path
        self.start = start
        self.chosen: tuple[Instance, ...] = ()
        self.served: Instance | None = None
        self.series: ModelSeries | None = None
        self.stream = False
        self.status = 0  # the answer's status, once the gateway reported its headers
        self.tail = b""  # the answer's last bytes (its usage), as the response body passes
        self.ended = False


@dataclasses.dataclass
class Routed:
    """The endpoints, best first, and the body to send when it changed (None: as it came)."""

    lease: Lease
    pick: Pick
    body: bytes | None

    @property
    def endpoints(self) -> list[str]:
        return self.pick.endpoints


Decision = Routed | Refusal

# The statuses that speak of the instance rather than the request (as request/legs/upstream.py).
_GATEWAY_STATUSES = frozenset({502, 503, 504})
# The answer's tail kept for its usage (the last SSE event, or a whole small answer).
TAIL_BYTES = 8192


class EndpointPicker:
    """Places requests for a gateway over the proxy's pools and rules."""

    def __init__(self, config: ProxyConfig, pools: dict[str, InstancePool], metrics: ProxyMetrics, *,
                 tenants: Tenants, admission: Admission, gate: EntryGate, kv: KvLookup | None,
                 client_keys: ClientKeys | None, adapters: Adapters | None, placement: PlacementKnown,
                 endpoints: int) -> None:
        self.config = config
        self.serving = pools["decode"]  # the pods the gateway sends requests to (decode, or PD)
        self.models = self.serving.served.directory
        self.metrics = metrics
        self.tenants = tenants
        self.admission = admission
        self.gate = gate  # the access log and the console's ring, as the proxy's own requests use them
        self.kv = kv
        self.client_keys = client_keys
        self.adapters = adapters if adapters is not None and adapters.on_demand else None
        # The proxy's own decision over what the composition root built for it (placement/): P/D and
        # E/P/D through the gateway as llm-d's sidecar reads them (x-prefiller-host-port, ...).
        self.known = Known(placement, endpoints)
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.leases = 0  # requests placed and not yet ended
        self.served_elsewhere = 0  # answers the gateway reports from a fallback endpoint
        self.media_policy = MediaPolicy(max_items=config.max_media_items, schemes=config.allowed_media_schemes,
                                        allowed_hosts=config.allowed_media_hosts)
        self.max_body = config.max_body_size or (1 << 62)  # a body past it is refused (413), as the proxy does
        shed = shed_error()
        self._shed = (shed.body(), shed.body(anthropic=True))

    # -- the request ---------------------------------------------------------------------------
    async def decide(self, ask: Ask) -> Decision:
        """The endpoints for ``ask``, or the refusal the gateway answers with."""
        req = parsed_request(ask.method, ask.target, ask.headers, ask.body, True, None)
        path = req.path
        anthropic = speaks_anthropic(path)
        start = time.perf_counter()
        rid = request_id(req)
        lease = Lease(RequestContext(rid, path, []), RequestRecord(rid, ask.method, path, start, None, ask.headers,
                                                                   None, self.metrics.no_model), path, start)
        try:
            key = lease.rec.key = self._key(req)
            scope = self.client_keys.scope(key) if self.client_keys is not None else None
            if self.tenants.active:
                lease.ticket = await self.tenants.enter(key, anthropic, len(ask.body), req.headers)
                lease.ticket_key = lease.ticket.key
                lease.rec.ticket = lease.ticket
            if self.admission.limit:
                refusal = await self._admit(lease, anthropic)
                if refusal is not None:
                    self._end(lease, refusal.status)
                    return refusal
            decision = await self._place(req, lease, ask.subset, scope)
        except ProxyError as err:
            self._end(lease, err.status)
            self.outcomes[lease.outcome or ("shed" if err.status == 429 else "refused")] += 1
            if err.code == "model_not_found" and lease.ticket_key is not None:  # only the key's models named
                ids = self.tenants.model_ids(lease.ticket_key, self.models.current)
                if ids is not None:
                    err = self.models.current.not_found(str(lease.model), ids)
            return Refusal(err.status, err.body(anthropic), _refusal_headers(err))
        except BaseException:
            self._end(lease, 499)
            raise
        return decision

    def too_large(self, target: bytes) -> Refusal:
        """A body past ``--max-body-size``: refused before it is all held (counted, not placed)."""
        path = target.partition(b"?")[0].decode("latin-1")
        err = ProxyError(413, f"request body larger than {self.max_body} bytes")
        self.outcomes["refused"] += 1
        self.metrics.observe_request(path, 413, 0.0)
        return Refusal(413, err.body(speaks_anthropic(path)), [])

    def failed(self, target: bytes) -> Refusal:
        """The picker itself failed on a request: a 500 in its envelope (a failed gRPC stream
        would fail open where the gateway allows it, past the key's limits)."""
        path = target.partition(b"?")[0].decode("latin-1")
        self.outcomes["refused"] += 1
        self.metrics.observe_request(path, 500, 0.0)
        err = ProxyError(500, "the endpoint picker failed on this request")
        return Refusal(500, err.body(speaks_anthropic(path)), [])

    def _key(self, req: Request) -> str | None:
        """The client key presented: with keys, every request through the gateway needs one."""
        keys = self.client_keys
        if keys is None:
            return None
        authorization, api_key = req.headers.get(b"authorization"), req.headers.get(b"x-api-key")
        key = keys.identify(authorization, api_key)
        if key is None:
            raise unauthorized(_INVALID_KEY if authorization or api_key else _MISSING_KEY)
        return key

    async def _admit(self, lease: Lease, anthropic: bool) -> Refusal | None:
        ticket = lease.ticket
        flow, rank, weight, sheddable, name = ("", 0, 1.0, False, None) if ticket is None else ticket.queueing()
        verdict = self.admission.try_enter(rank, sheddable, name)
        if verdict == ADMIT or (verdict != SHED and await self.admission.wait(flow, rank, weight)):
            lease.admitted = True
            return None
        self.outcomes["shed"] += 1
        return Refusal(429, self._shed[anthropic], [(b"retry-after", b"1")])

    async def _place(self, req: Request, lease: Lease, subset: frozenset[str] | None,
                     scope: bytes | None) -> Decision:
        path, ctx = lease.path, lease.ctx
        rewrite = False
        body: dict | None = None
        model = asked = None
        ticket, tenants = lease.ticket, self.tenants
        if req.body and not _generation(path):  # an endpoint one instance answers (audio forms too)
            model = asked = request_model(req.body, req.headers.get(b"content-type"))  # 400: a form's two
            lease.model = model
            if ticket is not None and model is not None:
                tenants.check_model(ticket, asked, model)
            if model is not None:
                ctx.models = self.models.current.route(model)  # 404 as the proxy's forwarder answers
        elif req.method == "POST" and req.body:
            body = parse_body(req, path)
            rewrite = any(req.body.find(b'"' + f.encode() + b'"') >= 0 for f in PROXY_OWNED_FIELDS)
            model = asked = body.get("model")
            lease.model = model
            lease.stream = body.get("stream") is True
            if scope is not None and self.config.cache_salt_per_key and path in (CHAT, COMPLETIONS):
                salt(body, scope)  # no key shares (or probes) another key's prefix cache
                rewrite = True
            aliases = tenants.aliases
            if aliases is not None:  # an alias to its served model: the body names the served one
                model = aliases.resolve(model, self.models.current)
                if model is not asked:
                    body["model"] = model
                    rewrite = True
            if ticket is not None:
                if model is not None:  # 403 before the route, as the proxy's own path
                    tenants.check_model(ticket, asked, model)
                sent = body.get("priority")
                priority = tenants.engine_priority(ticket, sent)  # the key's class, at most lowered
                if priority is not None and priority != sent:
                    body["priority"] = priority
                    rewrite = True
        if body is not None:  # a request without a body (GET /v1/models) goes to any instance
            try:
                ctx.models = self.models.current.route(model)
            except ProxyError as err:
                if err.code != "model_not_found" or self.adapters is None or not self.adapters.loadable(model):
                    raise
                await self.adapters.ensure(model)  # type: ignore[arg-type]  # loadable: a name
                ctx.models = self.models.current.route(model)
            if model is None and ticket is not None:  # the cluster's only model, if the key may not use it
                bases = self.models.current.bases
                tenants.check_model(ticket, None, bases[0] if len(bases) == 1 else None)
        lease.series = (type(model) is str and self.metrics.models.get(model)) or self.metrics.model(model)
        routing = RequestView()
        split = body is not None
        items: list = []
        if body is not None:
            api = GENERATION_APIS.get(path)
            ctx.api = api
            if path == CHAT:  # its media as the proxy owns them: checked, client uuids namespaced
                owned, items = own_media(body, ignore_client_uuids=self.config.ignore_client_uuids, scope=scope)
                if items:
                    self.media_policy.check(items)  # the schemes, hosts and count an engine may be sent
                if owned is not body:
                    body, rewrite = owned, True
            ctx.view = routing = RequestView(body, items, path == CHAT or (api is not None and api.chat_view))
            split = api is None or api.whole(body) is None  # a Responses follow-up, say, is served whole
            kv = self.kv
            if kv is not None and kv.feed.readers:
                await kv.prepare(ctx, body, _has_media(body))
        view = PickView(routing, ctx.models, subset, split, items)
        placed = pick(view, self.known)
        if not placed.instances:
            lease.outcome = "none_eligible"
            raise ProxyError(503, "no endpoint of the pool is eligible for this request"
                             + (" within the gateway's subset" if view.subset is not None else ""))
        first = placed.instances[0]
        ctx.hold(first)  # the load policies see it in flight there until the gateway's stream ends
        if placed.prefill is not None:
            ctx.hold(placed.prefill)
        for encoder in placed.encoders:
            ctx.hold(encoder)
        lease.chosen = placed.instances
        if self.kv is not None:  # the instance computing the prompt holds its blocks soon
            self.kv.chosen(placed.prefill or first, ctx)
        self.leases += 1
        self.metrics.inflight += 1
        self.outcomes["rewritten" if rewrite else "picked"] += 1
        log.debug("request %s: %s (%s)", ctx.request_id, ",".join(placed.endpoints), "; ".join(placed.reasons))
        return Routed(lease, placed, encode_json(body) if rewrite else None)

    # -- what the gateway reports --------------------------------------------------------------
    def served(self, lease: Lease, address: str | None, status: int) -> None:
        """The answer's headers passed: ``address``, the endpoint that served (None: not told),
        and its status. What the proxy learns from its own legs it learns from this report: the
        endpoints the gateway's retries passed over did not take the connection (an instance
        signal each), and the serving one's status is a signal as a leg's would be."""
        lease.status = status
        if not address or not lease.chosen:
            return
        chosen, ctx, outliers = lease.chosen, lease.ctx, self.serving.outliers
        at = next((n for n, inst in enumerate(chosen) if endpoint(inst) == address), None)
        if at is None:  # not one the picker named (a fail-open answer, or another cluster's)
            return
        inst = lease.served = chosen[at]
        inst.requests += 1
        if at:  # a fallback served: it holds the request, and its prompt's blocks
            self.served_elsewhere += 1
            for skipped in chosen[:at]:
                outliers.record_failure(skipped, "the gateway could not connect (a fallback served)", "connection",
                                    ctx)
            ctx.release(chosen[0])
            ctx.hold(inst)
            if self.kv is not None:
                self.kv.chosen(inst, ctx)
        if status in _GATEWAY_STATUSES:  # an overloaded or dying instance, or the gateway's own
            outliers.record_failure(inst, f"HTTP {status} through the gateway", f"http_{status}", ctx)
        elif status >= 500:  # vLLM failed this one request
            outliers.record_request_failure(inst, f"HTTP {status} through the gateway", f"http_{status}", ctx)
        elif status:
            outliers.record_success(inst)

    def answered(self, lease: Lease, chunk: bytes) -> None:
        """A piece of the answer's body passed (kept: its tail, for the usage)."""
        lease.nbytes += len(chunk)
        tail = lease.tail + chunk if lease.tail else chunk
        lease.tail = tail[-TAIL_BYTES:]

    def ended(self, lease: Lease, complete: bool = True) -> None:
        """The gateway's stream for the request ended: the answer ``complete``, or not (the
        client gone, or the gateway's stream reset: logged ``client_gone``, as the proxy logs a
        client that left mid-answer)."""
        if lease.ended:
            return
        self.leases -= 1
        self.metrics.inflight -= 1
        if not complete:
            lease.rec.outcome = "client_gone"
        self._end(lease, lease.status or 499, usage_of(lease.tail) if lease.tail else NO_TOKENS)

    def _end(self, lease: Lease, status: int, tokens: tuple = NO_TOKENS) -> None:
        lease.ended = True
        lease.ctx.release_all()
        if lease.admitted:
            lease.admitted = False
            self.admission.leave()
        if lease.ticket is not None:
            ticket, lease.ticket = lease.ticket, None
            self.tenants.leave(ticket, status, tokens)
        if tokens[1] is not None and lease.series is not None:
            self.metrics.observe_tokens(lease.series, tokens)
        seconds = time.perf_counter() - lease.start
        self.metrics.observe_request(lease.path, status, seconds, lease.stream, lease.series)
        rec, access, recent = lease.rec, self.gate.access_log, self.gate.recent
        if not lease.chosen:  # refused: a line as the proxy's own refusals get
            if access is not None:
                access.other(rec.request_id, rec.method, rec.path, status, 0, seconds, None, rec.headers,
                             _text(lease.model), rec.key)
            if recent.on:
                recent.add_refused(rec.request_id, rec.method, rec.path, status, seconds)
            return
        rec.ctx, rec.model, rec.stream = lease.ctx, _text(lease.model), lease.stream
        if rec.outcome != "client_gone":
            rec.outcome = "ok" if status < 400 else "client_gone" if status == 499 else "error"
        if access is not None:
            access.request(rec, status, tokens, lease.nbytes, seconds)
        if recent.on:  # a console looked lately
            recent.add(rec, status, tokens, lease.nbytes, seconds)

    def collect(self, f: dict[str, list]) -> None:
        for outcome, n in self.outcomes.items():
            f["epd_proxy_epp_decisions"].append([outcome, n])
        f["epd_proxy_epp_requests"].append([self.leases])
        f["epd_proxy_epp_served_by_fallback"].append([self.served_elsewhere])


def _generation(path: str) -> bool:
    """A generation API's path (its body is read, and may be rewritten and split)."""
    return path == CHAT or path == COMPLETIONS or path in GENERATION_APIS


def _text(model: object) -> str | None:
    return model if type(model) is str else None


def _has_media(body: dict) -> bool:
    """Whether a chat carries a media part (its tokens are not a text tokenization's)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") not in ("text", None):
                    return True
    return False


def _refusal_headers(err: ProxyError) -> list[tuple[bytes, bytes]]:
    headers = list(err.headers or [])
    if err.status == 401:
        headers += CHALLENGE
    if err.status in (429, 503) and not any(n == b"retry-after" for n, _ in headers):
        headers.append((b"retry-after", b"1" if err.status == 429 else b"5"))
    return headers

