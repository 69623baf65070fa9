"""The gate every request passes before its body is parsed: its key's models and limits, then a slot.

A request refused here (its key over a limit, no slot in time, the proxy shutting down)
is answered with a prebuilt body in its API's envelope and counted, logged and shown like
any other; nothing behind the gate has run for it.
"""

from __future__ import annotations

import asyncio
import time

from epd_proxy.config import ProxyConfig
from epd_proxy.http.response import Request, ResponseWriter
from epd_proxy.instances.model_directory import ModelDirectory
from epd_proxy.observe.access_log import AccessLog
from epd_proxy.observe.metrics import ProxyMetrics
from epd_proxy.observe.recent import RecentRequests
from epd_proxy.observe.tokens import NO_TOKENS
from epd_proxy.request.admission import ADMIT, SHED, Admission, shed_error
from epd_proxy.request.apis import MESSAGES, speaks_anthropic
from epd_proxy.request.ingress import client_request_id
from epd_proxy.routing.endpoints import request_model
from epd_proxy.tenants.limiter import Tenants, Ticket
from epd_proxy.wire.errors import ProxyError

_FIFO = ("", 0, 1.0, False, None)  # a request without a ticket: one flow, one class


class EntryGate:
    """The tenant ticket and the ``--max-inflight`` slot, and the answers of a refusal."""

    def __init__(self, config: ProxyConfig, admission: Admission, tenants: Tenants, metrics: ProxyMetrics,
                 recent: RecentRequests, access_log: AccessLog | None, models: ModelDirectory | None = None) -> None:
        self.admission = admission
        self.tenants = tenants
        self.models = models if models is not None else ModelDirectory()  # the cluster's, for the model check
        self.metrics = metrics
        self.recent = recent
        self.access_log = access_log  # when on
        # Set by the shutdown: every new request is refused with 503.
        self.closing = False
        self.gated = bool(config.max_inflight)  # admission has work to do: a limit, or closing
        # The refusals are built once, in each envelope (indexed by speaks_anthropic(path)).
        shed = shed_error()
        closing = ProxyError(503, "the proxy is shutting down; retry the request")
        self._429 = (shed.body(), shed.body(anthropic=True))
        self._503_closing = (closing.body(), closing.body(anthropic=True))

    def close(self) -> None:
        """Shutting down: every new request is answered 503 at once (in-flight ones go on)."""
        self.closing = True
        self.gated = True
        self.admission.close()

    def leave(self) -> None:
        """Give back the slot :meth:`admit` took."""
        if self.admission.limit:
            self.admission.leave()

    async def enter_tenant(self, req: Request, writer: ResponseWriter, path: str, t0: float,
                           key: str | None) -> Ticket | None:
        """The request's ticket against its key's limits (tenants/limiter.py), or None: refused, answered.
        A key with a model list is first checked on the model the body names: a 403 before any
        limit is consulted, so a refused request spends nothing and no 429 hides it."""
        tenants = self.tenants
        try:
            if req.body and tenants.table.policy(key).models is not None:  # a body that may name one
                tenants.check_entry(key, request_model(req.body, req.headers.get(b"content-type")),
                                    self.models.current)
            return await tenants.enter(key, path.startswith(MESSAGES), len(req.body), req.headers)
        except ProxyError as err:
            self.refused(req, writer, path, t0, err.status, err.body(speaks_anthropic(path)), err.headers or [], key)
            return None

    async def admit(self, req: Request, writer: ResponseWriter, path: str, t0: float,
                    ticket: Ticket | None = None) -> bool:
        """Take a slot (waiting in the queue: by class and key with a ``ticket``), or answer 429/503
        and return False (the ticket given back). Before the body is parsed: a prebuilt answer.
        Callers test :attr:`gated` first: without a limit and not closing, there is nothing to take."""
        if self.closing:
            status, refusals = 503, self._503_closing
        else:
            admission = self.admission
            flow, rank, weight, sheddable, name = _FIFO if ticket is None else ticket.queueing()
            verdict = admission.try_enter(rank, sheddable, name)
            if verdict == ADMIT:
                return True
            status, refusals = 429, self._429
            if verdict != SHED:
                try:
                    admitted = await admission.wait(flow, rank, weight)
                except asyncio.CancelledError:
                    if ticket is not None:  # the client left while queued
                        self.tenants.leave(ticket, 499, NO_TOKENS)
                    raise
                self.metrics.queue_wait.observe(time.perf_counter() - t0)
                if admitted and not self.closing:
                    return True
                if admitted:
                    admission.leave()  # the proxy began shutting down meanwhile: the slot goes unused
                if self.closing:
                    status, refusals = 503, self._503_closing
        body, retry = refusals[speaks_anthropic(path)], b"1"  # the path's envelope, only when refused
        if ticket is not None:
            self.tenants.leave(ticket, status, NO_TOKENS)
        self.refused(req, writer, path, t0, status, body, [(b"retry-after", retry)],
                     ticket.key if ticket is not None else None)
        return False

    def refused(self, req: Request, writer: ResponseWriter, path: str, t0: float, status: int, body: bytes,
                headers: list, key: str | None) -> None:
        """A request answered before it was admitted (admission, or its key's limits)."""
        rid = client_request_id(req)
        if rid is not None:
            headers = headers + [(b"x-request-id", rid)]
        writer.send(status, body, b"application/json", headers)
        seconds = time.perf_counter() - t0
        self.metrics.observe_request(path, status, seconds)
        if self.access_log is not None:
            self.access_log.other(rid.decode("ascii") if rid else "-", req.method, path, status, writer.bytes_sent,
                                  seconds, req.peer, req.headers, key=key if key != "-" else None)
        if self.recent.on:
            self.recent.add_refused(rid.decode("ascii") if rid else "-", req.method, path, status, seconds)
