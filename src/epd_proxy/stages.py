"""The three stages of a request, each one call (or fan-out) to an instance pool.

Each stage turns transport failures and upstream statuses into a
:class:`ProxyError` with the status the client should see: an upstream 4xx is
relayed as received (it is the client's mistake, e.g. vLLM's validation 400),
a 5xx or a broken connection is a retryable 502, a stage timeout a 504, a
refused connection with no other instance of the role in rotation a
(retryable) 503, and the proxy's own shortage of descriptors or memory a 503.
On the way, each failure tells the pool what it says about the instance
(``health.py``): an instance signal, a request signal, or nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import msgspec

from .blobs import encode_json
from .context import RequestContext
from .ec_match import consumer_ec_params, match_encoder_output
from .encoder_plan import encoder_body, encoder_request_id, new_transfer_id, plan_sub_requests
from .errors import ProxyError
from .http.client import Response, Timeouts, UpstreamError, UpstreamTimeout
from .ids import hex_id
from .multimodal import MediaItem, rewrite_media
from .pool import Instance, InstancePool
from .usage import PrefillReport

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


def status_error(pool: InstancePool, inst: Instance, att: RequestContext, stage: str, status: int, body: bytes,
                 content_type: bytes | None) -> ProxyError:
    """An upstream answered with a non-200 status: what it says about the instance is
    recorded, and the error the client should see is returned."""
    if 400 <= status < 500:
        # The request itself is wrong: the client gets the engine's own answer, and the
        # instance, which answered properly, is not blamed.
        pool.record_success(inst)
        return ProxyError(status, upstream_message(body), upstream_body=body,
                          upstream_content_type=content_type or _JSON)
    message = upstream_message(body)
    log.warning("request %s: %s instance %s answered HTTP %d: %s", att.request_id, stage, inst.url, status,
                message)
    if status in _GATEWAY_STATUSES:
        # What gateways and an overloaded or dying vLLM answer: about the instance.
        pool.record_failure(inst, f"HTTP {status}: {message}", f"http_{status}", att)
    else:
        # vLLM's 500: this request failed on it (e.g. one odd image), not the instance.
        pool.record_request_failure(inst, f"HTTP {status}: {message}", f"http_{status}", att)
    return ProxyError(502, f"{stage} instance failed with HTTP {status}: {message}", retryable=True)


_GATEWAY_STATUSES = frozenset({502, 503, 504})


def transport_error(pool: InstancePool, inst: Instance, att: RequestContext, stage: str, exc: UpstreamError,
                    doing: str) -> ProxyError:
    """A failure below HTTP talking to an instance, as the client should see it. The
    address goes to the log line only: clients learn the role, never our topology."""
    kind = exc.kind
    if kind == "local":
        # This process is short of descriptors, buffers or memory: nothing the instance did.
        pool.record_local_error()
        log.error("request %s: cannot reach %s instance %s for lack of local resources: %s",
                  att.request_id, stage, inst.url, exc)
        return ProxyError(503, f"the proxy is short of local resources ({_reason(exc)}); retry later",
                          retryable=False)
    log.warning("request %s: %s instance %s: %s %s", att.request_id, stage, inst.url, doing, exc)
    pool.record_failure(inst, f"{doing}: {exc}", kind, att)
    if kind == "connect" and not pool.reachable(att.excluded):
        # Nothing in rotation that has not already refused this request: the role is
        # unreachable now (a retry may still find another instance answering).
        return ProxyError(503, f"no {stage} instance available: none accepts connections", retryable=True)
    if isinstance(exc, UpstreamTimeout):
        return ProxyError(504, f"{stage} instance timed out: {exc}", retryable=True)
    if kind == "connect":
        return ProxyError(502, f"{stage} instance unreachable", retryable=True)
    if kind == "ejected":
        return ProxyError(502, f"{stage} instance stopped answering and was taken out of rotation",
                          retryable=True)
    return ProxyError(502, f"{stage} instance broke off the connection while {doing}", retryable=True)


def _reason(exc: UpstreamError) -> str:
    """The OS's words from a connect failure, without the address before them."""
    return str(exc).rsplit(": ", 1)[-1]


async def call(pool: InstancePool, inst: Instance, att: RequestContext, stage: str, path: str, body: bytes,
               headers: list, timeouts: Timeouts) -> Response:
    """POST to one instance; a transport failure becomes a ProxyError and counts against it."""
    inst.requests += 1
    att.hold(inst)
    trace = att.trace
    if trace is not None:
        headers = trace.leg(inst, stage, headers)
    try:
        resp = await inst.http.request("POST", path, body=body, headers=headers, timeouts=timeouts)
        if trace is not None:
            trace.status(inst, resp.status)
        return resp
    except UpstreamError as exc:
        if trace is not None:
            trace.failed(inst, str(exc))
        att.release(inst)
        raise transport_error(pool, inst, att, stage, exc, "sending the request") from None
    except BaseException:
        att.release(inst)
        raise


async def read_body(pool: InstancePool, inst: Instance, att: RequestContext, stage: str, resp: Response) -> bytes:
    try:
        return await resp.read()
    except UpstreamError as exc:
        raise transport_error(pool, inst, att, stage, exc, "reading its answer") from None


async def exchange(pool: InstancePool, inst: Instance, att: RequestContext, stage: str, path: str, body: bytes,
                   headers: list, timeouts: Timeouts) -> bytes:
    """A whole request/response with one instance; a non-200 answer raises (and a
    5xx is retryable elsewhere)."""
    resp = await call(pool, inst, att, stage, path, body, headers, timeouts)
    try:
        data = await read_body(pool, inst, att, stage, resp)
    finally:
        resp.close()
        att.release(inst)
    if resp.status != 200:
        raise status_error(pool, inst, att, stage, resp.status, data, resp.content_type)
    pool.record_success(inst)
    return data


class _EncoderReply(msgspec.Struct):
    ec_transfer_params: object = None


class EncoderFanout:
    """Sends a request's media items to the encoders and rewrites the body for the consumer.

    Each item's encoder is the pool's policy's choice (``--encode-policy``:
    affinity by the item's uuid, or the persistent round-robin cursor, ...),
    images on the same encoder are batched, and every sub-request runs
    concurrently; the first failure cancels the others.
    """

    def __init__(self, pool: InstancePool, *, max_batch: int, rewrite: bool, timeout: float,
                 connect_timeout: float) -> None:
        self.pool = pool
        self.max_batch = max_batch
        self.rewrite = rewrite
        self.timeouts = Timeouts(connect=connect_timeout, headers=timeout, idle=timeout)
        # metrics: each sub-request's duration (set by the pipeline)
        self.observe_sub_request: Callable[[float], None] | None = None

    async def run(self, att: RequestContext, body: dict, items: list[MediaItem], consumer_zmq: str | None) -> dict:
        subs = plan_sub_requests(items, self.pool.assign(items, att.excluded), self.max_batch)
        # Fresh transfer ids per item occurrence and per attempt (never reused on retry).
        tids = [[new_transfer_id() for _ in sub.items] for sub in subs]
        t0 = time.perf_counter()
        if len(subs) == 1:  # the common case: no task to schedule, one loop turn saved
            outcomes = [await self._one(att, body, subs[0].encoder, subs[0], tids[0], consumer_zmq)]
        else:
            try:
                async with asyncio.TaskGroup() as tg:
                    tasks = [tg.create_task(self._one(att, body, sub.encoder, sub, t, consumer_zmq))
                             for sub, t in zip(subs, tids)]
            except* ProxyError as group:
                raise _first(group) from None
            outcomes = [task.result() for task in tasks]
        att.timing("encode", time.perf_counter() - t0)
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

    async def _one(self, att: RequestContext, body: dict, inst: Instance, sub, tids: list[str],
                   consumer_zmq: str | None):
        payload = encode_json(
            encoder_body(body, sub, rewrite=self.rewrite, transfer_ids=tids, consumer_zmq=consumer_zmq))
        rid = encoder_request_id(att.request_id, sub.items[0].index, hex_id(24))
        t0 = time.perf_counter()
        data = await exchange(self.pool, inst, att, "encode", "/v1/chat/completions", payload,
                              att.upstream_headers(rid), self.timeouts)
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


class _PrefillReply(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")
    usage: msgspec.Raw = msgspec.Raw(b"null")  # kept for the client's usage (usage.py)


class PrefillStage:
    """One prefill call: the whole (1-token, non-streamed) answer, and its
    ``kv_transfer_params`` kept as raw bytes so decode gets them verbatim."""

    def __init__(self, pool: InstancePool, *, timeout: float, connect_timeout: float) -> None:
        self.pool = pool
        self.timeouts = Timeouts(connect=connect_timeout, headers=timeout, idle=timeout)

    async def run(self, att: RequestContext, inst: Instance, body: dict, extra_headers: list | None = None,
                  request_id: str | None = None) -> msgspec.Raw | None:
        t0 = time.perf_counter()
        data = await exchange(self.pool, inst, att, "prefill", att.path, encode_json(body),
                              att.upstream_headers(request_id, extra_headers), self.timeouts)
        att.timing("prefill", time.perf_counter() - t0)
        try:
            reply = msgspec.json.decode(data, type=_PrefillReply)
            raw = reply.kv_transfer_params
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("request %s: prefill instance %s returned an unreadable answer", att.request_id,
                        inst.url)
            raise ProxyError(502, "prefill instance returned an unreadable answer", retryable=True) from None
        att.prefill_report = PrefillReport(bytes(reply.usage), bytes(raw))
        return None if bytes(raw) == b"null" else raw


class DecodeLeg:
    """An opened decode response: headers received, and for a stream the first
    SSE event already read (``first``), so nothing has been committed yet."""

    __slots__ = ("inst", "resp", "first", "body", "companion")

    def __init__(self, inst: Instance, resp: Response, first: bytes = b"", body: bytes | None = None) -> None:
        self.inst = inst
        self.resp = resp
        self.first = first
        self.body = body  # the whole answer, non-stream
        # A leg still running beside decode (push mode's prefill), watched by the relay.
        self.companion: asyncio.Task | None = None


class DecodeStage:
    """Opens the decode call and checks it before anything reaches the client."""

    def __init__(self, pool: InstancePool, *, first_timeout: float, idle_timeout: float,
                 connect_timeout: float) -> None:
        self.pool = pool
        self.timeouts = Timeouts(connect=connect_timeout, headers=first_timeout, idle=idle_timeout)

    async def open(self, att: RequestContext, inst: Instance, body: dict, extra_headers: list | None = None,
                   request_id: str | None = None) -> DecodeLeg:
        t0 = time.perf_counter()
        resp = await call(self.pool, inst, att, "decode", att.path, encode_json(body),
                          att.upstream_headers(request_id, extra_headers), self.timeouts)
        try:
            if resp.status != 200:
                data = await read_body(self.pool, inst, att, "decode", resp)
                raise status_error(self.pool, inst, att, "decode", resp.status, data, resp.content_type)
            ctype = resp.content_type or b""
            if not ctype.startswith(b"text/event-stream"):
                data = await read_body(self.pool, inst, att, "decode", resp)
                self.pool.record_success(inst)
                att.timing("decode", time.perf_counter() - t0)
                return DecodeLeg(inst, resp, body=data)
            first = await self._first_event(att, inst, resp)
        except BaseException:
            resp.close()
            att.release(inst)
            raise
        self.pool.record_success(inst)
        att.timing("decode_first", time.perf_counter() - t0)
        return DecodeLeg(inst, resp, first=first)

    async def _first_event(self, att: RequestContext, inst: Instance, resp: Response) -> bytes:
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
                    raise transport_error(self.pool, inst, att, "decode", exc,
                                          "reading its stream before the first event") from None
                if not chunk:
                    return buf  # the stream ended: relay what there is
                buf += chunk
                end = buf.find(b"\n\n", pos)
            event = buf[pos:end]
            pos = end + 2
            if not event.startswith(b"data: {"):
                return buf
            try:
                parsed = msgspec.json.decode(event[6:], type=_StreamEvent)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return buf
            if parsed.error is not None:
                message = upstream_message(event[6:])
                log.warning("request %s: decode instance %s failed in-band: %s", att.request_id, inst.url,
                            message)
                self.pool.record_request_failure(inst, f"in-band error: {message}", "in_band", att)
                raise ProxyError(502, f"decode instance failed: {message}", retryable=True)
            if not parsed.role_only():
                return buf
        return buf


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
