"""The endpoints one instance answers whole (tokenizer, pooling, scoring, audio, version):
the request passed to an instance of the pool the endpoint needs, its answer relayed.

What passes is the client's: method, path and query, body (the server's buffer, not
copied: multipart audio included), its content type and request id, the headers the
operator forwards. What comes back is the instance's: status, content type and body as
received (a ``Content-Length`` answer in one piece, any other streamed through). The pool
is ``routing/endpoints.py``'s rule; the instance the pool's policy and health rules. These
requests take ``--max-inflight`` slots like generation, count in ``epd_proxy_requests``
under their path, and write the access log's short line (``api/app.py``).

Retries: an instance that did not take the request (refused or dropped the connection
before answering) is excluded and another tried, each at most once; a timeout or an
answer is final, as vLLM's own work is not repeated behind the client's back.
"""

from __future__ import annotations

import time

from epd_proxy.config import ProxyConfig
from epd_proxy.http import Headers
from epd_proxy.http.response import Request, ResponseWriter
from epd_proxy.http.transport import TransportTimeouts
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.observe.metrics import ProxyMetrics
from epd_proxy.request.context import RequestContext
from epd_proxy.request.ingress import request_id
from epd_proxy.request.pipeline import Pipeline
from epd_proxy.request.relay import relay_body
from epd_proxy.request.upstream import UpstreamStage
from epd_proxy.routing.endpoints import ROUTED, least_loaded_first, roles_for
from epd_proxy.wire.errors import ProxyError

_JSON = b"application/json"
# Failures of ``call`` that mean the instance never took the request: 502 (unreachable, broke
# off while sending, taken out of rotation) and 503 (nothing in rotation accepts connections).
# A 504 (no answer in time) is not retried: the instance may be working on it.
_NOT_TAKEN = frozenset({502, 503})


class Forwarder:
    """Serves the routed endpoints (``ROUTED``) through the role pools."""

    def __init__(self, config: ProxyConfig, pools: dict[str, InstancePool], metrics: ProxyMetrics,
                 pipeline: Pipeline, base_headers: Headers) -> None:
        t = config.timeouts
        timeouts = TransportTimeouts(connect=t.connect, headers=t.decode_first, idle=t.stream_idle)
        self.pools = pools
        self.stages = {role: UpstreamStage(pool, timeouts) for role, pool in pools.items()}
        self.metrics = metrics
        self.pipeline = pipeline  # admission: the same --max-inflight slots and queue
        self._base_headers = base_headers
        self._forward = tuple(h.lower().encode() for h in config.forward_headers)

    async def handle(self, req: Request, writer: ResponseWriter) -> None:
        path = req.path
        t0 = time.perf_counter()
        if not await self.pipeline.admit(req, writer, path, t0):
            return
        ctx = RequestContext(request_id(req), path, self._base_headers)
        try:
            await self._forward_once(ctx, req, writer)
        except ProxyError as err:
            if not writer.started:
                headers = [(b"x-request-id", ctx.request_id.encode())]
                if err.status == 503:
                    headers.append((b"retry-after", b"5"))
                writer.send(err.status, err.body(), err.content_type(), headers)
        finally:
            ctx.release_all()
            self.pipeline.leave()
            self.metrics.observe_request(path, writer.status or 499, time.perf_counter() - t0)

    async def _forward_once(self, ctx: RequestContext, req: Request, writer: ResponseWriter) -> None:
        path = ctx.path
        method = ROUTED[path].method  # HEAD on a GET route asks GET: the writer drops the body
        target = f"{path}?{req.query}" if req.query else path
        headers = self._headers(req, ctx.request_id)
        while True:
            stage, inst = self.choose(path, ctx.excluded)
            try:
                resp = await stage.call(ctx, inst, target, req.body, headers, method)
            except ProxyError as err:
                if err.status in _NOT_TAKEN and err.retryable and self._another(path, ctx.excluded):
                    continue
                raise
            break
        try:
            if resp.status >= 400:
                data = await stage.read_body(ctx, inst, resp)
                raise stage.status_error(ctx, inst, resp.status, data, resp.content_type)
            stage.pool.record_success(inst)
            out = [(b"x-request-id", ctx.request_id.encode())]
            if b"content-length" in resp.headers:
                writer.send(resp.status, await stage.read_body(ctx, inst, resp), resp.content_type, out)
            else:
                await relay_body(writer, resp, out)
        finally:
            resp.close()
            ctx.release(inst)

    def choose(self, path: str, excluded: set[Instance]) -> tuple[UpstreamStage, Instance]:
        """The instance for one attempt: among the pools ``roles_for(path)`` names, the first
        with an instance that has not failed this request; for tokenizer work, the least
        loaded of every such pool's choice."""
        roles = roles_for(path)
        live = [role for role in roles if self.pools.get(role)]
        if not live:
            raise ProxyError(503, f"no {' or '.join(roles)} instance can answer {path}", retryable=True)
        fresh = [role for role in live if self.pools[role].reachable(excluded)] or live
        if least_loaded_first(path) and len(fresh) > 1:
            picks = [(role, self.pools[role].choose(excluded)) for role in fresh]
            role, inst = min(picks, key=lambda pick: (pick[1] in excluded, pick[1].inflight))
        else:
            role = fresh[0]
            inst = self.pools[role].choose(excluded)
        return self.stages[role], inst

    def _another(self, path: str, excluded: set[Instance]) -> bool:
        """Whether an instance in rotation that has not failed this request is left."""
        return any(self.pools[role].reachable(excluded) for role in roles_for(path) if role in self.pools)

    def _headers(self, req: Request, rid: str) -> Headers:
        """The client's content type (a multipart boundary must survive) and request id, the
        upstream key, and the headers the operator forwards."""
        headers: Headers = [(b"x-request-id", rid.encode())]
        if req.body:
            headers.append((b"content-type", req.headers.get(b"content-type") or _JSON))
        headers += self._base_headers
        headers += [(name, value) for name in self._forward if (value := req.headers.get(name)) is not None]
        return headers
