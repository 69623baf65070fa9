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

With client keys, a response belongs to the key that created it: the owner carries the key's
scope (``tenants/key_scope.py``; in the store, never the key), and a request of another key,
or for an id whose owner is not known here or in the store, is answered 404 as vLLM answers
an id it does not hold, without asking any decode (so no key can find another's response by
asking every decode, nor make the proxy ask them for ids it invents). Only the key's own id
whose decode no longer answers for it is looked for among the others. What the shared store
returns is checked like any input: an owner that is not a well-formed entry is not an owner
(``epd_proxy_state_store_invalid_total{entry="response_owner"}``), and whatever URL an owner
names, only the decodes of the pool are ever asked.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict

import msgspec

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


class Owner(msgspec.Struct, array_like=True):
    """Who holds a response: the decode's URL, and the scope of the key that made it (None
    without client keys)."""

    url: str
    scope: bytes | None = None


# The most an owner entry read back from the shared store may hold (a URL and a digest).
MAX_OWNER_BYTES = 4096
_SCOPE_BYTES = 16


class ResponseOwners:
    """Response id → its :class:`Owner`; at most ``limit`` ids here, and every one in the
    ``shared`` store when there is one."""

    def __init__(self, limit: int = 65536, shared: GuardedStore | None = None) -> None:
        self.limit = limit
        self.shared = shared
        self._owners: OrderedDict[str, Owner] = OrderedDict()
        self._writes: set[asyncio.Task] = set()

    def remember(self, response_id: str, url: str, scope: bytes | None = None) -> None:
        owner = Owner(url, scope)
        if self.shared is not None and self._owners.get(response_id) != owner:
            task = asyncio.get_running_loop().create_task(
                self.shared.put(self._key(response_id), msgspec.msgpack.encode(owner), OWNER_TTL))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
        self._keep(response_id, owner)

    def _keep(self, response_id: str, owner: Owner) -> None:
        owners = self._owners
        owners[response_id] = owner
        owners.move_to_end(response_id)
        if len(owners) > self.limit:
            owners.popitem(last=False)

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)

    def owner(self, response_id: str) -> Owner | None:
        owner = self._owners.get(response_id)
        if owner is not None:
            self._owners.move_to_end(response_id)
        return owner

    async def find(self, response_id: str) -> Owner | None:
        """The owner known here, else in the shared store (remembered here when found). What
        the store returns is checked: a well-formed owner, or none (counted). Only decodes of
        the pool are ever asked, whatever URL an owner names (``candidates``)."""
        owner = self.owner(response_id)
        if owner is not None or self.shared is None:
            return owner
        found = await self.shared.get(self._key(response_id))
        if found is None:
            return None
        owner = read_owner(found)
        if owner is None:
            self.shared.invalid("response_owner")
            return None
        self._keep(response_id, owner)
        return owner

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


def read_owner(value: bytes) -> Owner | None:
    """An owner entry as the shared store returned it, if it is one: bounded, a URL, a scope
    of the digest's size or none."""
    if len(value) > MAX_OWNER_BYTES:
        return None
    try:
        owner = msgspec.msgpack.decode(value, type=Owner)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if owner.scope is not None and len(owner.scope) != _SCOPE_BYTES:
        return None
    return owner


def not_found(response_id: str) -> ProxyError:
    """vLLM's answer for an id it does not hold (``openai/responses/serving.py``)."""
    return ProxyError(404, f"Response with id '{response_id}' not found.", type="invalid_request_error",
                      param="response_id")


def candidates(pool: InstancePool, owner: str | None) -> list[Instance]:
    """The decode instances to ask, the known owner first, then the rest in rotation order
    (healthy ones before the others)."""
    live = sorted(pool.instances, key=lambda i: not i.healthy)
    first = [i for i in live if i.url == owner]
    return first + [i for i in live if i.url != owner]


# Lookups of a stored response by what was known of its owner (``epd_proxy_response_lookups_total``).
OWNER = "owner"  # asked at its owner, which answered
SEARCHED = "searched"  # the owner not known, or gone: every decode asked
REFUSED = "refused"  # with client keys: another key's, or an owner known nowhere: 404, no decode asked


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
        self.lookups: dict[str, int] = {}

    async def handle(self, req: Request, writer: ResponseWriter, response_id: str, endpoint: str,
                     scope: bytes | None = None) -> None:
        """``scope``: the scope of the client key the request presented (None without keys)."""
        t0 = time.perf_counter()
        ctx = RequestContext(request_id(req), endpoint, self._base_headers)
        ctx.scope = scope
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
        with ``GET`` when this proxy does not know it; None when none holds it. With client
        keys, 404 (ProxyError) for a response that is not the request's key's."""
        owner = await self.owners.find(response_id)
        if owner is not None and self._mine(ctx, owner):
            for inst in self.stage.pool.instances:
                if inst.url == owner.url:
                    self._count(OWNER)
                    return inst
        try:
            found = await self._ask(ctx, response_id, PREFIX + response_id, "GET", b"")
        except ProxyError as err:
            if err.status == 404:
                raise
            return None
        if isinstance(found, _Answered):
            if ctx.scope is not None:
                raise not_found(response_id)
            return None
        inst, resp = found
        resp.close()
        ctx.release(inst)
        return inst

    def _mine(self, ctx: RequestContext, owner: Owner | None) -> bool:
        """Whether the request may have the response ``owner`` holds: any request without
        client keys; with them, a request of the key that made it."""
        return ctx.scope is None or (owner is not None and owner.scope == ctx.scope)

    def _count(self, result: str) -> None:
        self.lookups[result] = self.lookups.get(result, 0) + 1

    async def _ask(self, ctx: RequestContext, response_id: str, target: str, method: str, body: bytes
                   ) -> tuple[Instance, Response] | _Answered:
        """The first decode instance's answer that is not 404, the owner asked first (and
        remembered), its body unread; else the last 404, read. 503 when none could be asked.
        With client keys only the key's own response is asked for (404 otherwise, no decode
        asked), and only its known owner unless that one no longer holds it."""
        headers = ctx.upstream_headers()
        last: _Answered | None = None
        owner = await self.owners.find(response_id)
        if not self._mine(ctx, owner):
            self._count(REFUSED)
            raise not_found(response_id)
        asked = 0
        for inst in candidates(self.stage.pool, owner.url if owner is not None else None):
            try:
                resp = await self.stage.call(ctx, inst, target, body, headers, method)
            except ProxyError:
                continue  # unreachable: the next one may hold it
            finally:
                asked += 1
            if resp.status != 404:
                self.stage.outliers.record_success(inst)
                self._count(OWNER if owner is not None and inst.url == owner.url else SEARCHED)
                self.owners.remember(response_id, inst.url, ctx.scope)
                return inst, resp
            try:  # read whole, so the connection is reused
                last = _Answered(resp.status, await self.stage.read_body(ctx, inst, resp), resp.content_type)
            finally:
                resp.close()
                ctx.release(inst)
        self._count(SEARCHED if asked > 1 or owner is None else OWNER)
        if last is None:
            raise ProxyError(503, "no decode instance could be asked for the response", retryable=True)
        if owner is not None:
            self.owners.forget(response_id)  # held nowhere now: a next ask is refused (keys) at once
        return last

    def collect(self, f: dict[str, list]) -> None:
        """``epd_proxy_response_lookups_total{result}`` for ``/metrics``."""
        f["epd_proxy_response_lookups"] += [[r, n] for r, n in self.lookups.items()]


class _Answered:
    """An answer already read whole (every instance's 404)."""

    __slots__ = ("status", "data", "content_type")

    def __init__(self, status: int, data: bytes, content_type: bytes | None) -> None:
        self.status = status
        self.data = data
        self.content_type = content_type
