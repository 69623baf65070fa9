"""Stored Responses: which decode instance holds each response, and the endpoints that read it.

vLLM keeps a Responses answer (``store``, on by default in the API; kept only with
``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the memory of the instance that made it, with the
messages that led to it: ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and
a follow-up naming ``previous_response_id`` work only there (``openai/responses/serving.py``:
``response_store``, ``msg_store``; 404 ``Response with id '…' not found.`` elsewhere). In P/D
that instance is the decode that answered (the prefill is sent ``store: false``).

So the proxy remembers, for each response it relayed, the decode that made it
(:class:`ResponseOwners`, bounded, least recently used out first), and sends these requests
there. An id it does not know (another ``--workers`` process or proxy replica relayed it, or
it was forgotten) is asked of every decode instance in turn: the first answer that is not
404 is the client's, and the owner is remembered. Only when every instance says 404 is the
404 the answer: a response the cluster holds is always found. With a shared state store
(``--state-store``, or the ``--workers`` parent) the owner is also kept there (under a
digest of the id, for :data:`OWNER_TTL`), so another replica or worker sends a follow-up
straight to it instead of asking every decode.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict

from epd_proxy.config import ProxyConfig
from epd_proxy.http import Headers
from epd_proxy.http.client import Response
from epd_proxy.http.response import Request, ResponseWriter
from epd_proxy.http.transport import TransportTimeouts
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.observe.metrics import ProxyMetrics
from epd_proxy.request.context import RequestContext
from epd_proxy.request.ingress import request_id
from epd_proxy.request.legs.upstream import UpstreamStage
from epd_proxy.request.relay import relay_body
from epd_proxy.request.turns.streams import MARK, strip_stream_params
from epd_proxy.state.guard import GuardedStore
from epd_proxy.wire.errors import ProxyError

PREFIX = "/v1/responses/"
CANCEL = "/cancel"
# The metric's endpoint labels (one per route, not per id).
RETRIEVE_ENDPOINT = "/v1/responses/{id}"
CANCEL_ENDPOINT = "/v1/responses/{id}/cancel"
# How long the shared store keeps an owner (vLLM keeps the answer until it restarts; an owner
# forgotten costs only the search of every decode).
OWNER_TTL = 86400.0


def parse_path(method: str, path: str) -> tuple[str, str] | None:
    """``(response id, metric endpoint)`` for ``GET|HEAD /v1/responses/{id}`` and ``POST
    /v1/responses/{id}/cancel``; None for any other method or shape."""
    rest = path[len(PREFIX):] if path.startswith(PREFIX) else ""
    if rest.endswith(CANCEL) and method == "POST":
        rid, endpoint = rest[:-len(CANCEL)], CANCEL_ENDPOINT
    elif method in ("GET", "HEAD"):
        rid, endpoint = rest, RETRIEVE_ENDPOINT
    else:
        return None
    return (rid, endpoint) if rid and "/" not in rid else None


class ResponseOwners:
    """Response id → the URL of the decode instance that holds it; at most ``limit`` ids here,
    and every one in the ``shared`` store when there is one."""

    def __init__(self, limit: int = 65536, shared: GuardedStore | None = None) -> None:
        self.limit = limit
        self.shared = shared
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._writes: set[asyncio.Task] = set()

    def remember(self, response_id: str, url: str) -> None:
        if self.shared is not None and self._owners.get(response_id) != url:
            task = asyncio.get_running_loop().create_task(
                self.shared.put(self._key(response_id), url.encode(), OWNER_TTL))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
        owners = self._owners
        owners[response_id] = url
        owners.move_to_end(response_id)
        if len(owners) > self.limit:
            owners.popitem(last=False)

    def owner(self, response_id: str) -> str | None:
        url = self._owners.get(response_id)
        if url is not None:
            self._owners.move_to_end(response_id)
        return url

    async def find(self, response_id: str) -> str | None:
        """The owner known here, else in the shared store (remembered here when found)."""
        url = self.owner(response_id)
        if url is not None or self.shared is None:
            return url
        found = await self.shared.get(self._key(response_id))
        if found is None:
            return None
        url = found.decode()
        self._owners[response_id] = url
        if len(self._owners) > self.limit:
            self._owners.popitem(last=False)
        return url

    def _key(self, response_id: str) -> bytes:
        assert self.shared is not None
        digest = hashlib.blake2b(response_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        return self.shared.key(b"r", digest)

    async def written(self) -> None:
        """Wait for the owners on their way to the shared store."""
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    def __len__(self) -> int:
        return len(self._owners)


def candidates(pool: InstancePool, owner: str | None) -> list[Instance]:
    """The decode instances to ask, the known owner first, then the rest in rotation order
    (healthy ones before the others)."""
    live = sorted(pool.instances, key=lambda i: not i.healthy)
    first = [i for i in live if i.url == owner]
    return first + [i for i in live if i.url != owner]


class StoredResponses:
    """Serves ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` from the
    decode instance that holds the response, and finds that instance for a follow-up."""

    def __init__(self, config: ProxyConfig, decode: InstancePool, owners: ResponseOwners, metrics: ProxyMetrics,
                 base_headers: Headers) -> None:
        t = config.timeouts
        self.stage = UpstreamStage(decode, TransportTimeouts(connect=t.connect, headers=t.decode_first,
                                                             idle=t.stream_idle))
        self.owners = owners
        self.metrics = metrics
        self._base_headers = base_headers

    async def handle(self, req: Request, writer: ResponseWriter, response_id: str, endpoint: str) -> None:
        t0 = time.perf_counter()
        ctx = RequestContext(request_id(req), endpoint, self._base_headers)
        target = f"{req.path}?{req.query}" if req.query else req.path
        method = "GET" if req.method == "HEAD" else req.method
        out = [(b"x-request-id", ctx.request_id.encode())]
        try:
            found = await self._ask(ctx, response_id, target, method, req.body)
            if isinstance(found, _Answered):
                writer.send(found.status, found.data, found.content_type, out)
                return
            inst, resp = found
            try:
                if b"content-length" in resp.headers:
                    data = await self.stage.read_body(ctx, inst, resp)
                    if data.find(MARK) >= 0:
                        # vLLM 0.32 stores the answer whole, a bidirectional decode's parameters
                        # included: never a client's (turns/streams.py).
                        data = strip_stream_params(data)[0]
                    writer.send(resp.status, data, resp.content_type, out)
                else:  # a background response's event stream (``?stream=true``), as it comes
                    await relay_body(writer, resp, out)
            finally:
                resp.close()
        except ProxyError as err:
            if not writer.started:
                writer.send(err.status, err.body(), err.content_type(), out)
        finally:
            ctx.release_all()
            self.metrics.observe_request(endpoint, writer.status or 499, time.perf_counter() - t0)

    async def locate(self, ctx: RequestContext, response_id: str) -> Instance | None:
        """The decode instance holding ``response_id`` (for a follow-up that names it), asked
        with ``GET`` when this proxy does not know it; None when none holds it."""
        owner = await self.owners.find(response_id)
        for inst in self.stage.pool.instances:
            if inst.url == owner:
                return inst
        try:
            found = await self._ask(ctx, response_id, PREFIX + response_id, "GET", b"")
        except ProxyError:
            return None
        if isinstance(found, _Answered):
            return None
        inst, resp = found
        resp.close()
        ctx.release(inst)
        return inst

    async def _ask(self, ctx: RequestContext, response_id: str, target: str, method: str, body: bytes
                   ) -> tuple[Instance, Response] | _Answered:
        """The first decode instance's answer that is not 404, the owner asked first (and
        remembered), its body unread; else the last 404, read. 503 when none could be asked."""
        headers = ctx.upstream_headers()
        last: _Answered | None = None
        for inst in candidates(self.stage.pool, await self.owners.find(response_id)):
            try:
                resp = await self.stage.call(ctx, inst, target, body, headers, method)
            except ProxyError:
                continue  # unreachable: the next one may hold it
            if resp.status != 404:
                self.stage.pool.record_success(inst)
                self.owners.remember(response_id, inst.url)
                return inst, resp
            try:  # read whole, so the connection is reused
                last = _Answered(resp.status, await self.stage.read_body(ctx, inst, resp), resp.content_type)
            finally:
                resp.close()
                ctx.release(inst)
        if last is None:
            raise ProxyError(503, "no decode instance could be asked for the response", retryable=True)
        return last


class _Answered:
    """An answer already read whole (every instance's 404)."""

    __slots__ = ("status", "data", "content_type")

    def __init__(self, status: int, data: bytes, content_type: bytes | None) -> None:
        self.status = status
        self.data = data
        self.content_type = content_type
