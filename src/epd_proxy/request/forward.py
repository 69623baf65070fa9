"""The endpoints one instance answers whole (tokenizer, pooling, scoring, audio, version):
the request passed to an instance of the pool the endpoint needs, its answer relayed.

What passes is the client's: method, path and query, body (the server's buffer, not
copied: multipart audio included), its content type and request id, the headers the
operator forwards. What comes back is the instance's: status, content type and body as
received (a ``Content-Length`` answer in one piece, any other streamed through). The pool
is ``routing/endpoints.py``'s rule; the instance the least loaded of those serving the request's model
(its ``model``: a JSON body's field, a multipart form's field; ``routing/endpoints.py``
reads it without copying the body), within the pools' health rules, placed by
``placement/routed.py``. A model no instance
serves is the proxy's 404 (``model_not_found``), a model whose instances are all out a 503
with ``Retry-After``, before any upstream work, as for generation. These requests take
``--max-inflight`` slots like generation, count in ``epd_proxy_requests`` under their path
and in the per-model families, and write the access log's short line with their model.

Retries: an instance that did not take the request (refused or dropped the connection
before answering) is excluded and another tried, each at most once; a timeout or an
answer is final, as vLLM's own work is not repeated behind the client's back.
"""

from __future__ import annotations

import time

import msgspec

from epd_proxy.config import ProxyConfig
from epd_proxy.http import Headers
from epd_proxy.http.response import Request, ResponseWriter
from epd_proxy.http.transport import TransportTimeouts
from epd_proxy.instances.pool import InstancePool
from epd_proxy.observe.metrics import ProxyMetrics
from epd_proxy.observe.tokens import NO_TOKENS, usage_of
from epd_proxy.placement.routed import another_routed, place_routed
from epd_proxy.request.apis import speaks_anthropic
from epd_proxy.request.context import RequestContext
from epd_proxy.request.entry_gate import EntryGate
from epd_proxy.request.ingress import request_id
from epd_proxy.request.legs.upstream import UpstreamStage
from epd_proxy.request.relay import relay_body
from epd_proxy.routing.endpoints import ROUTED, least_loaded_first, request_model, roles_for
from epd_proxy.routing.policies import LeastLoaded
from epd_proxy.tenants.limiter import Tenants
from epd_proxy.wire.errors import ProxyError

_JSON = b"application/json"
# Failures of ``call`` that mean the instance never took the request: 502 (unreachable, broke
# off while sending, taken out of rotation) and 503 (nothing in rotation accepts connections).
# A 504 (no answer in time) is not retried: the instance may be working on it.
_NOT_TAKEN = frozenset({502, 503})


class Forwarder:
    """Serves the routed endpoints (``ROUTED``) through the role pools."""

    def __init__(self, config: ProxyConfig, pools: dict[str, InstancePool], metrics: ProxyMetrics,
                 gate: EntryGate, tenants: Tenants, base_headers: Headers) -> None:
        t = config.timeouts
        timeouts = TransportTimeouts(connect=t.connect, headers=t.decode_first, idle=t.stream_idle)
        self.pools = pools
        self.stages = {role: UpstreamStage(pool, timeouts) for role, pool in pools.items()}
        self.metrics = metrics
        self.gate = gate  # admission: the same --max-inflight slots and queue as the pipeline's
        self.tenants = tenants
        self.models = pools["decode"].served.directory  # the cluster's models (instances/model_directory.py)
        self.policy = LeastLoaded()  # among the candidates of every pool the endpoint may use
        self._base_headers = base_headers
        self._forward = tuple(h.lower().encode() for h in config.forward_headers)

    async def handle(self, req: Request, writer: ResponseWriter, key: str | None = None) -> None:
        """``key``: the name of the client key the request presented (the access log's)."""
        path = req.path
        t0 = time.perf_counter()
        tenants = self.tenants
        gate = self.gate
        ticket = await gate.enter_tenant(req, writer, path, t0, key) if tenants.active else None
        if tenants.active and ticket is None:
            return  # over its key's limits: answered
        if gate.gated and not await gate.admit(req, writer, path, t0, ticket):  # refused: the ticket given back
            return
        ctx = RequestContext(request_id(req), path, self._base_headers)
        get = ROUTED[path].method == "GET"  # names no model: any instance of its pools answers
        model = None
        series = self.metrics.no_model
        answer = None
        try:
            if not get:
                model = asked = request_model(req.body, req.headers.get(b"content-type"))  # 400: a form's two
                resolved = model if tenants.aliases is None else tenants.aliases.resolve(model, self.models.current)
                if ticket is not None and model is not None:
                    tenants.check_model(ticket, asked, resolved)  # 403: a model the key may not use
                priority = None if ticket is None or ROUTED[path].need != "model" else \
                    tenants.engine_priority(ticket, _sent_priority(req.body))  # the engine schedules model work
                if resolved != asked or priority is not None:
                    model, body = _rewritten(req, resolved, asked, priority)
                    if body is not None:
                        req.body = body  # the served model's name in a JSON body (a form's stays), the priority
                try:
                    ctx.models = self.models.current.route(model)  # 404 / 400 before any upstream work
                except ProxyError as err:
                    ids = None if ticket is None or err.code != "model_not_found" else \
                        tenants.model_ids(ticket.key, self.models.current)
                    if ids is None:
                        raise
                    raise self.models.current.not_found(str(model), ids) from None  # the models the key may use
                if ticket is not None and model is None:
                    bases = self.models.current.bases
                    tenants.check_model(ticket, None, bases[0] if len(bases) == 1 else None)
                series = self.metrics.model(model)
            answer = await self._forward_once(ctx, req, writer)
        except ProxyError as err:
            if not writer.started:
                headers = [(b"x-request-id", ctx.request_id.encode())]
                if err.status == 503:
                    headers.append((b"retry-after", b"5"))
                writer.send(err.status, err.body(speaks_anthropic(path)), err.content_type(), headers)
        finally:
            ctx.release_all()
            gate.leave()
            seconds = time.perf_counter() - t0
            status = writer.status or 499
            if ticket is not None:
                tenants.leave(ticket, status, usage_of(answer) if answer is not None else NO_TOKENS)
            self.metrics.observe_request(path, status, seconds, series=series)
            access = gate.access_log
            if access is not None:
                access.other(ctx.request_id, req.method, path, status, writer.bytes_sent, seconds, req.peer,
                             req.headers, model=model if type(model) is str else None, key=key)

    async def _forward_once(self, ctx: RequestContext, req: Request, writer: ResponseWriter) -> bytes | None:
        """The instance's answer relayed; its body when it came whole (its usage is settled)."""
        path = ctx.path
        method = ROUTED[path].method  # HEAD on a GET route asks GET: the writer drops the body
        target = f"{path}?{req.query}" if req.query else path
        headers = self._headers(req, ctx.request_id)
        pools, roles, spread = self.pools, roles_for(path), least_loaded_first(path)
        while True:
            # The instance: placement/routed.py's, the least loaded of the pools' candidates.
            inst = place_routed(pools, roles, self.policy, spread=spread, exclude=ctx.excluded, models=ctx.models,
                                path=path)
            stage = self.stages[inst.role]
            try:
                resp = await stage.call(ctx, inst, target, req.body, headers, method)
            except ProxyError as err:
                if err.status in _NOT_TAKEN and err.retryable and another_routed(pools, roles, ctx.excluded,
                                                                                 ctx.models):
                    continue
                raise
            break
        try:
            if resp.status >= 400:
                data = await stage.read_body(ctx, inst, resp)
                raise stage.status_error(ctx, inst, resp.status, data, resp.content_type)
            stage.outliers.record_success(inst)
            out = [(b"x-request-id", ctx.request_id.encode())]
            if b"content-length" in resp.headers:
                data = await stage.read_body(ctx, inst, resp)
                writer.send(resp.status, data, resp.content_type, out)
                return data
            await relay_body(writer, resp, out)
            return None
        finally:
            resp.close()
            ctx.release(inst)

    def _headers(self, req: Request, rid: str) -> Headers:
        """The client's content type (a multipart boundary must survive) and request id, the
        upstream key, and the headers the operator forwards."""
        headers: Headers = [(b"x-request-id", rid.encode())]
        if req.body:
            headers.append((b"content-type", req.headers.get(b"content-type") or _JSON))
        headers += self._base_headers
        headers += [(name, value) for name in self._forward if (value := req.headers.get(name)) is not None]
        return headers


def _sent_priority(body: bytes) -> object:
    """The ``priority`` a JSON body sends (None: none, or not JSON); read only when the body
    holds the word."""
    if b'"priority"' not in body:
        return None
    try:
        return _DECODE_PRIORITY(body).priority
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class _Priority(msgspec.Struct):
    priority: object = None


_DECODE_PRIORITY = msgspec.json.Decoder(_Priority).decode


def _rewritten(req: Request, model: object, asked: object, priority: int | None) -> tuple[object, bytes | None]:
    """The model an alias resolved to, and a JSON body naming it instead, with the engine
    ``priority`` its key's class sets (None: unchanged, or a multipart form, whose fields are
    passed as sent)."""
    if not req.body.startswith(b"{"):
        return model, None
    try:
        body = msgspec.json.decode(req.body)
    except msgspec.DecodeError:
        return asked, None
    if not isinstance(body, dict):
        return asked, None
    if model != asked:
        body["model"] = model
    if priority is not None:
        body["priority"] = priority
    return model, msgspec.json.encode(body)

