"""Calls to one upstream instance, and what their failures say.

Every stage talks to its instances through these few functions, so a failure
is turned into the client's :class:`ProxyError` in one place: an upstream 4xx
is relayed as received (it is the client's mistake, e.g. vLLM's validation
400), a 5xx or a broken connection is a retryable 502, a stage timeout a 504
(retryable only while another instance of the role is left to try),
a refused connection with no other instance of the role in rotation a
(retryable) 503, and the proxy's own shortage of descriptors or memory a 503.
On the way, each failure tells the role's outlier detector what it says about
the instance (``instances/outliers.py``): an instance signal, a request signal, or
nothing; its ``record_*`` call with the request's ``ctx`` also marks the
instance failed for this request, so a retry prefers another. A stage that
``holds_signals`` (the encode stage) gets a failure the work itself may have
caused (a timeout, vLLM's 500) as a :class:`HeldFailure` instead: the instance
out of the request, its signal recorded or let go on the stage's verdict.
"""

from __future__ import annotations

import logging

import msgspec

from epd_proxy.http import Headers
from epd_proxy.http.client import Response
from epd_proxy.http.transport import TransportTimeouts, UpstreamError, UpstreamTimeout
from epd_proxy.instances.health import TIMEOUT
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.request.context import RequestContext
from epd_proxy.wire.errors import ProxyError

# The stages' failures keep the logger name they have always had (log filters use it).
log = logging.getLogger("epd_proxy.stages")

_JSON = b"application/json"


class _ErrorBody(msgspec.Struct):
    error: dict | str | None = None
    detail: object = None


def upstream_message(body: bytes) -> str:
    """The human part of an upstream error body (vLLM's envelope, FastAPI's detail, or text)."""
    try:
        parsed = msgspec.json.decode(body, type=_ErrorBody)
        if isinstance(parsed.error, dict) and parsed.error.get("message"):
            return str(parsed.error["message"])
        if isinstance(parsed.error, str):
            return parsed.error
        if parsed.detail is not None:
            return str(parsed.detail)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    text = body[:300].decode("utf-8", "replace").strip()
    return text or "(empty body)"


def status_error(pool: InstancePool, inst: Instance, ctx: RequestContext, stage: str, status: int, body: bytes,
                 content_type: bytes | None, hold: bool = False) -> ProxyError:
    """An upstream answered with a non-200 status: what it says about the instance is
    recorded, and the error the client should see is returned. With ``hold``, vLLM's 500
    (which the work itself may cause) is a :class:`HeldFailure` instead of a recorded signal."""
    if 400 <= status < 500:
        # The request itself is wrong: the client gets the engine's own answer, and the
        # instance, which answered properly, is not blamed.
        pool.outliers.record_success(inst)
        return ProxyError(status, upstream_message(body), upstream_body=body,
                          upstream_content_type=content_type or _JSON)
    message = upstream_message(body)
    log.warning("request %s: %s instance %s answered HTTP %d: %s", ctx.request_id, stage, inst.url, status,
                message)
    if status in _GATEWAY_STATUSES:
        # What gateways and an overloaded or dying vLLM answer: about the instance.
        pool.outliers.record_failure(inst, f"HTTP {status}: {message}", f"http_{status}", ctx)
    else:
        # vLLM's 500: this request failed on it (e.g. one odd image), not the instance.
        reason, text = f"HTTP {status}: {message}", f"{stage} instance failed with HTTP {status}: {message}"
        if hold:
            return held_failure(pool, inst, ctx, 502, text, reason, f"http_{status}", request_signal=True)
        pool.outliers.record_request_failure(inst, reason, f"http_{status}", ctx)
    return ProxyError(502, f"{stage} instance failed with HTTP {status}: {message}", retryable=True)


_GATEWAY_STATUSES = frozenset({502, 503, 504})


def transport_error(pool: InstancePool, inst: Instance, ctx: RequestContext, stage: str, exc: UpstreamError,
                    doing: str, hold: bool = False) -> ProxyError:
    """A failure below HTTP talking to an instance, as the client should see it. The
    address goes to the log line only: clients learn the role, never our topology. With
    ``hold``, a timeout (which the work itself may cause) is a :class:`HeldFailure`."""
    kind = exc.kind
    if kind == "local":
        # This process is short of descriptors, buffers or memory: nothing the instance did.
        pool.outliers.record_local_error()
        log.error("request %s: cannot reach %s instance %s for lack of local resources: %s",
                  ctx.request_id, stage, inst.url, exc)
        return ProxyError(503, f"the proxy is short of local resources ({_reason(exc)}); retry later",
                          retryable=False)
    log.warning("request %s: %s instance %s: %s %s", ctx.request_id, stage, inst.url, doing, exc)
    if isinstance(exc, UpstreamTimeout):
        # An instance signal of its own kind. The instance is out of this request for good
        # (no retry goes back to it: it may still be hung), so with no other instance of the
        # role to try, the timeout is the answer, at the stage timeout.
        ctx.timed_out_on(inst)
        if hold:
            return held_failure(pool, inst, ctx, 504, f"{stage} instance timed out: {exc}", f"{doing}: {exc}", TIMEOUT)
        pool.outliers.record_failure(inst, f"{doing}: {exc}", TIMEOUT, ctx)
        return ProxyError(504, f"{stage} instance timed out: {exc}",
                          retryable=pool.spare(ctx.excluded, ctx.model_for(pool.role)))
    pool.outliers.record_failure(inst, f"{doing}: {exc}", kind, ctx)
    if kind == "connect":
        if not pool.reachable(ctx.excluded, ctx.model_for(pool.role)):
            # Nothing in rotation that has not already refused this request: the role is
            # unreachable now (a retry may still find another instance answering).
            err = ProxyError(503, f"no {stage} instance available: none accepts connections", retryable=True)
        else:
            err = ProxyError(502, f"{stage} instance unreachable", retryable=True)
        err.unsent = True  # it never got the request: what the request carried can go elsewhere
        return err
    if kind == "ejected":
        return ProxyError(502, f"{stage} instance stopped answering and was taken out of rotation",
                          retryable=True)
    return ProxyError(502, f"{stage} instance broke off the connection while {doing}", retryable=True)


class HeldFailure(ProxyError):
    """A failure the work may have caused as much as the instance (a timeout, vLLM's 500 on
    one request), its health signal held: the caller knows whether another instance failed
    the same work alike (then the work is the cause, and no instance is blamed) and
    :meth:`settle` records it or lets it go. The instance is out of the request either way."""

    def __init__(self, status: int, message: str, retryable: bool, inst: Instance | None, reason: str, kind: str,
                 request_signal: bool) -> None:
        super().__init__(status, message, retryable=retryable)
        self.inst = inst  # None: the request had already blamed it (a signal counts once per request)
        self.reason = reason
        self.kind = kind
        self.request_signal = request_signal  # a request signal (vLLM's 500), else an instance signal

    def settle(self, pool: InstancePool, blame: bool) -> None:
        """The verdict: ``blame`` records the held signal against the instance."""
        inst, self.inst = self.inst, None
        if inst is None or not blame:
            return
        if self.request_signal:
            pool.outliers.record_request_failure(inst, self.reason, self.kind)
        else:
            pool.outliers.record_failure(inst, self.reason, self.kind)


def held_failure(pool: InstancePool, inst: Instance, ctx: RequestContext, status: int, message: str, reason: str,
                 kind: str, request_signal: bool = False) -> HeldFailure:
    """What ``record_*`` with the request's ``ctx`` does but the signal: the instance out of
    the request (a retry prefers others), a timeout retryable while another instance is left."""
    fresh = inst not in ctx.excluded
    ctx.failed(inst)
    retryable = request_signal or pool.spare(ctx.excluded, ctx.model_for(pool.role))
    return HeldFailure(status, message, retryable, inst if fresh else None, reason, kind, request_signal)


def _reason(exc: UpstreamError) -> str:
    """The OS's words from a connect failure, without the address before them."""
    return str(exc).rsplit(": ", 1)[-1]


class UpstreamStage:
    """What the encode, prefill and decode stages share: their pool (its ``role`` names the
    stage in errors and logs), their transport timeouts, and the calls to one of the pool's
    instances, whose failures take the one path above."""

    # Whether a failure the work may cause (a timeout, vLLM's 500) is held for the caller's
    # verdict (HeldFailure) rather than recorded at once: the encode stage's, per item.
    holds_signals = False

    def __init__(self, pool: InstancePool, timeouts: TransportTimeouts) -> None:
        self.pool = pool
        self.role = pool.role
        self.outliers = pool.outliers  # what its calls say of an instance (instances/outliers.py)
        self.timeouts = timeouts

    async def call(self, ctx: RequestContext, inst: Instance, path: str, body: bytes, headers: Headers,
                   method: str = "POST", timeouts: TransportTimeouts | None = None) -> Response:
        """A request (POST unless ``method`` says otherwise) to one instance, within the
        stage's timeouts unless ``timeouts`` says otherwise; a transport failure becomes a
        ProxyError and counts against it."""
        inst.requests += 1
        ctx.hold(inst)
        trace = ctx.trace
        if trace is not None:
            headers = trace.leg(inst, self.role, headers)
        try:
            resp = await inst.connections.request(method, path, body=body, headers=headers,
                                                  timeouts=timeouts or self.timeouts)
            if trace is not None:
                trace.status(inst, resp.status)
            return resp
        except UpstreamError as exc:
            if trace is not None:
                trace.failed(inst, str(exc))
            ctx.release(inst)
            raise self.transport_error(ctx, inst, exc, "sending the request") from None
        except BaseException:
            ctx.release(inst)
            raise

    async def read_body(self, ctx: RequestContext, inst: Instance, resp: Response) -> bytes:
        """The whole answer; a transport failure on the way becomes a ProxyError and counts
        against the instance."""
        try:
            return await resp.read()
        except UpstreamError as exc:
            raise self.transport_error(ctx, inst, exc, "reading its answer") from None

    async def exchange(self, ctx: RequestContext, inst: Instance, path: str, body: bytes, headers: Headers,
                       timeouts: TransportTimeouts | None = None) -> bytes:
        """A whole request/response with one instance; a non-200 answer raises (and a
        5xx is retryable elsewhere)."""
        # call's, inline: one coroutine less on every exchange (prefill, encoders, /tokenize).
        inst.requests += 1
        inst.inflight += 1  # ctx.hold's, inline
        ctx.held.append(inst)
        ctx.legs.append(inst)
        trace = ctx.trace
        if trace is not None:
            headers = trace.leg(inst, self.role, headers)
        try:
            resp = await inst.connections.request("POST", path, body=body, headers=headers,
                                                  timeouts=timeouts or self.timeouts)
            if trace is not None:
                trace.status(inst, resp.status)
        except UpstreamError as exc:
            if trace is not None:
                trace.failed(inst, str(exc))
            ctx.release(inst)
            raise self.transport_error(ctx, inst, exc, "sending the request") from None
        except BaseException:
            ctx.release(inst)
            raise
        try:
            try:  # read_body's, inline: one coroutine less on every exchange
                data = await resp.read()
            except UpstreamError as exc:
                raise self.transport_error(ctx, inst, exc, "reading its answer") from None
        finally:
            resp.close()
            ctx.release(inst)
        if resp.status != 200:
            raise self.status_error(ctx, inst, resp.status, data, resp.content_type)
        self.outliers.record_success(inst)
        return data

    def status_error(self, ctx: RequestContext, inst: Instance, status: int, body: bytes,
                     content_type: bytes | None) -> ProxyError:
        return status_error(self.pool, inst, ctx, self.role, status, body, content_type, self.holds_signals)

    def transport_error(self, ctx: RequestContext, inst: Instance, exc: UpstreamError, doing: str) -> ProxyError:
        return transport_error(self.pool, inst, ctx, self.role, exc, doing, self.holds_signals)
