"""The prefill and decode stages, each one call to an instance of its pool.

How their failures become the client's :class:`ProxyError` is ``upstream.py``'s
business; the encode stage is ``legs/fanout.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from epd_proxy.http import Headers
from epd_proxy.http.client import Response
from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.request.apis import COMMIT, FAILURE
from epd_proxy.request.context import RequestContext
from epd_proxy.request.legs.upstream import UpstreamStage, upstream_message
from epd_proxy.request.usage.rewrite import PrefillReport
from epd_proxy.wire.blobs import encode_json
from epd_proxy.wire.errors import ProxyError

log = logging.getLogger("epd_proxy.stages")


class _PrefillReply(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")
    usage: msgspec.Raw = msgspec.Raw(b"null")  # kept for the client's usage (usage/rewrite.py)


_prefill_reply = msgspec.json.Decoder(_PrefillReply).decode  # a decoder made once: every prefill's answer


class PrefillStage(UpstreamStage):
    """One prefill call: the whole (1-token, non-streamed) answer, and its
    ``kv_transfer_params`` kept as raw bytes so decode gets them verbatim."""

    def __init__(self, pool: InstancePool, *, timeout: float, connect_timeout: float) -> None:
        super().__init__(pool, TransportTimeouts(connect=connect_timeout, headers=timeout, idle=timeout))

    async def run(self, ctx: RequestContext, inst: Instance, body: dict, extra_headers: Headers | None = None,
                  request_id: str | None = None) -> msgspec.Raw | None:
        t0 = time.perf_counter()
        # exchange's, inline: one coroutine less under every wait of every prefill.
        headers = ctx.upstream_headers(request_id, extra_headers)
        payload = encode_json(body)
        inst.requests += 1
        inst.inflight += 1  # ctx.hold's, inline
        ctx.held.append(inst)
        ctx.legs.append(inst)
        trace = ctx.trace
        if trace is not None:
            headers = trace.leg(inst, self.role, headers)
        try:
            resp = await inst.connections.request("POST", ctx.path, body=payload, headers=headers,
                                                  timeouts=self.timeouts)
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
            data = resp.body()  # all here with its head (a small answer's common case): no coroutine
            if data is None:
                try:
                    data = await resp.read()
                except UpstreamError as exc:
                    raise self.transport_error(ctx, inst, exc, "reading its answer") from None
        finally:
            resp.close()
            ctx.release(inst)
        if resp.status != 200:
            raise self.status_error(ctx, inst, resp.status, data, resp.content_type)
        self.outliers.record_success(inst)
        timings = ctx.timings  # ctx.timing's, inline (so below): every request
        timings["prefill"] = timings.get("prefill", 0.0) + (time.perf_counter() - t0)
        try:
            reply = _prefill_reply(data)
            raw = reply.kv_transfer_params
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("request %s: prefill instance %s returned an unreadable answer", ctx.request_id,
                        inst.url)
            raise ProxyError(502, "prefill instance returned an unreadable answer", retryable=True) from None
        kv = bytes(raw)
        ctx.prefill_report = PrefillReport(bytes(reply.usage), kv)
        return None if kv == b"null" else raw


class DecodeLeg(msgspec.Struct, eq=False):
    """An opened decode response: headers received, and for a stream the first
    SSE event already read (``first``), so nothing has been committed yet.

    A ``msgspec.Struct`` (so the other per-request records): built in C, without the
    ``__init__`` frame a class pays on every request."""

    inst: Instance
    resp: Response
    first: bytes = b""
    body: bytes | None = None  # the whole answer, non-stream
    # A leg still running beside decode (push mode's prefill), watched by the relay.
    companion: asyncio.Task | None = None


class DecodeStage(UpstreamStage):
    """Opens the decode call and checks it before anything reaches the client."""

    def __init__(self, pool: InstancePool, *, first_timeout: float, idle_timeout: float,
                 connect_timeout: float) -> None:
        super().__init__(pool, TransportTimeouts(connect=connect_timeout, headers=first_timeout, idle=idle_timeout))

    async def open(self, ctx: RequestContext, inst: Instance, body: dict, extra_headers: Headers | None = None,
                   request_id: str | None = None) -> DecodeLeg:
        t0 = time.perf_counter()
        # call's, inline: one coroutine less on every decode.
        payload, headers = encode_json(body), ctx.upstream_headers(request_id, extra_headers)
        inst.requests += 1
        inst.inflight += 1  # ctx.hold's, inline
        ctx.held.append(inst)
        ctx.legs.append(inst)
        trace = ctx.trace
        if trace is not None:
            headers = trace.leg(inst, self.role, headers)
        try:
            resp = await inst.connections.request("POST", ctx.path, body=payload, headers=headers,
                                                  timeouts=self.timeouts)
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
            if resp.status != 200:
                data = await self.read_body(ctx, inst, resp)
                raise self.status_error(ctx, inst, resp.status, data, resp.content_type)
            ctype = resp.content_type or b""
            if not ctype.startswith(b"text/event-stream"):
                whole = resp.body()  # all here with its head: no coroutine
                if whole is None:
                    try:  # read_body's, inline: every non-stream answer passes here
                        whole = await resp.read()
                    except UpstreamError as exc:
                        raise self.transport_error(ctx, inst, exc, "reading its answer") from None
                self.outliers.record_success(inst)
                timings = ctx.timings
                timings["decode"] = timings.get("decode", 0.0) + (time.perf_counter() - t0)
                return DecodeLeg(inst, resp, body=whole)
            first = await self._first_event(ctx, inst, resp)
        except BaseException:
            resp.close()
            ctx.release(inst)
            raise
        self.outliers.record_success(inst)
        timings = ctx.timings
        timings["decode_first"] = timings.get("decode_first", 0.0) + (time.perf_counter() - t0)
        return DecodeLeg(inst, resp, first=first)

    async def _first_event(self, ctx: RequestContext, inst: Instance, resp: Response) -> bytes:
        """Read until the first event that says something: an error there is still retryable.

        vLLM's chat streams open with a content-free role chunk, sent even when the
        request then fails (e.g. a KV load failure: role chunk, then the error event),
        so role-only chunks are read past before deciding.
        """
        buf = b""
        pos = 0  # start of the first event not yet examined
        for _ in range(_MAX_LEADING_EVENTS):
            end = buf.find(b"\n\n", pos)
            while end < 0:
                try:
                    chunk = await resp.read_chunk()
                except UpstreamError as exc:
                    raise self.transport_error(ctx, inst, exc, "reading its stream before the first event") from None
                if not chunk:
                    if pos and ctx.api is not None and ctx.api.lead:
                        # Only announcements so far (Responses: vLLM breaks a failing stream off).
                        raise ProxyError(502, "decode instance ended its stream before its first output",
                                         retryable=True)
                    return buf  # the stream ended: relay what there is
                buf += chunk
                end = buf.find(b"\n\n", pos)
            event = buf[pos:end]
            pos = end + 2
            if not event.startswith(b"data: {"):
                api = ctx.api
                if api is None or not event.startswith(b"event: "):
                    return buf
                # A named event (Messages, Responses: apis.py).
                line = event.find(b"\n")
                verdict = api.first_event(event[7:line] if line > 0 else event[7:])
                if verdict == COMMIT:
                    return buf
                if verdict == FAILURE:
                    data = event.find(b"data: ")
                    raise self._in_band(ctx, inst, upstream_message(event[data + 6:] if data >= 0 else event))
                continue
            try:
                parsed = _stream_event(event[6:])
            except (msgspec.DecodeError, msgspec.ValidationError):
                return buf
            if parsed.error is not None:
                raise self._in_band(ctx, inst, upstream_message(event[6:]))
            if not parsed.role_only():
                return buf
        return buf

    def _in_band(self, ctx: RequestContext, inst: Instance, message: str) -> ProxyError:
        """Decode's stream opened with an error event: a request failure, retryable."""
        log.warning("request %s: decode instance %s failed in-band: %s", ctx.request_id, inst.url, message)
        self.outliers.record_request_failure(inst, f"in-band error: {message}", "in_band", ctx)
        return ProxyError(502, f"decode instance failed: {message}", retryable=True)


_MAX_LEADING_EVENTS = 8


class _Choice(msgspec.Struct):
    delta: dict | None = None
    finish_reason: object = None


class _StreamEvent(msgspec.Struct):
    error: object = None
    choices: list[_Choice] | None = None
    usage: object = None

    def role_only(self) -> bool:
        """A chat chunk that only announces the assistant role (no content, no end)."""
        if not self.choices or self.usage is not None:
            return False
        for c in self.choices:
            d = c.delta
            if c.finish_reason is not None or d is None or d.get("content") or set(d) - {"role", "content"}:
                return False
        return True


_stream_event = msgspec.json.Decoder(_StreamEvent).decode  # a decoder made once: every stream's first event
