"""The proxy's HTTP surface: the route table and the handlers besides generation."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import unquote

import msgspec

from epd_proxy import routing
from epd_proxy.api.access import READ
from epd_proxy.api.admin import AdminApi
from epd_proxy.api.client_auth import (
    CHALLENGE,
    INVALID_KEY_BODY,
    MISSING_KEY_BODY,
    ClientKeys,
    admin_key_presented,
    check_tenant_names,
    unauthorized,
)
from epd_proxy.api.console import ConsoleApi
from epd_proxy.api.siblings import SiblingChannel
from epd_proxy.config import ProxyConfig, gather
from epd_proxy.encode import media_policy
from epd_proxy.http import Headers
from epd_proxy.http.response import Request, ResponseWriter
from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.instances import discovery
from epd_proxy.instances.adapters import LOAD, UNLOAD
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.load_scraper import LoadScraper
from epd_proxy.instances.membership import Membership
from epd_proxy.instances.model_directory import model_readiness
from epd_proxy.instances.models import models_list
from epd_proxy.instances.pool import InstancePool
from epd_proxy.instances.roster import check_pinned_topology
from epd_proxy.kvcache.feed import EventFeed
from epd_proxy.observe.metrics import ProxyMetrics, render
from epd_proxy.observe.tokens import NO_TOKENS
from epd_proxy.observe.version import VERSION
from epd_proxy.placement.choose import choose
from epd_proxy.request.admission import Admission
from epd_proxy.request.apis import GENERATE, MESSAGES, RESPONSES, speaks_anthropic
from epd_proxy.request.entry_gate import EntryGate
from epd_proxy.request.forward import Forwarder
from epd_proxy.request.ingress import CHAT, COMPLETIONS, client_request_id
from epd_proxy.request.legs.connectors import KVConnector, check_connector_config
from epd_proxy.request.pipeline import Pipeline
from epd_proxy.request.stored_responses import StoredResponses, parse_path
from epd_proxy.request.turns.reuse import TurnReuse
from epd_proxy.routing.endpoints import ROUTED
from epd_proxy.state.guard import GuardedStore
from epd_proxy.tenants.aliases import may_use
from epd_proxy.tenants.limiter import Tenants
from epd_proxy.tenants.limiter import check_config as check_tenants
from epd_proxy.wire.errors import ProxyError, as_anthropic

if TYPE_CHECKING:
    from epd_proxy.observe.tracing import Tracing

log = logging.getLogger("epd_proxy.app")

_METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
_MODEL_PREFIX = "/v1/models/"
# With client keys (--api-key, --api-key-file), every path needs one (a routed endpoint, a
# path added later, a path that does not exist) except these: the probes, which a load
# balancer or kubelet calls without credentials and which never show more than a status.
# The console's static page is open too, and the views and changes guarded by the admin key
# (access.py) take no client key: they are listed where the routes are built (ProxyApp).
OPEN_PATHS = frozenset({"/health", "/ready"})


def validate_config(config: ProxyConfig) -> None:
    """Everything checkable before serving: raises ConfigErrors (a ValueError) listing every
    mistake found, each an operator-facing line. Each check lives beside what it protects: each
    section's own values in config/sections.py (what spans them in config/proxy.py), the key
    file in client_auth.py, the KV connector and its instances in connectors.py, a pinned
    topology in roster.py, the policy names in routing/, the DNS server in discovery.py, the
    media hosts in media_policy.py; each given the section it checks where one is enough."""
    gather((
        config.validate,
        lambda: routing.check_config(config.policies),
        lambda: discovery.check_config(config.membership),
        lambda: media_policy.check_config(config.media),
        lambda: check_connector_config(config),
        lambda: check_pinned_topology(config),
        lambda: validate_tables(config),
    ))


def validate_tables(config: ProxyConfig) -> None:
    """The client keys and the tenants' tables (what ``--simulate`` leaves to check)."""
    gather((
        lambda: ClientKeys.from_config(config),  # the key file can be read
        lambda: check_tenants(config),  # the [tenants] and [model_aliases] tables
        lambda: check_tenant_names(config),  # each [[tenants.keys]] entry names a client key
    ))


class ProxyApp:
    """Routes requests to the pipeline, the admin API and the small handlers below. What it
    holds is built for it (``runtime/build.py``)."""

    def __init__(self, config: ProxyConfig, *, pools: dict[str, InstancePool], membership: Membership,
                 metrics: ProxyMetrics, pipeline: Pipeline, admin: AdminApi, scrapers: list[LoadScraper],
                 client_keys: ClientKeys | None, base_headers: Headers, forwarder: Forwarder, gate: EntryGate,
                 stored: StoredResponses, reuse: TurnReuse, tenants: Tenants, admission: Admission,
                 connector: KVConnector, state: GuardedStore | None = None, tracing: Tracing | None = None,
                 siblings: SiblingChannel | None = None, console: ConsoleApi | None = None,
                 kv_events: EventFeed | None = None) -> None:
        self.config = config
        self.kv_events = kv_events  # vLLM's KV cache events into the block index (kvcache/feed.py)
        self.pools = pools  # every role's, possibly empty: instances may register at run time
        self.membership = membership
        self.metrics = metrics
        self.scrapers = scrapers  # load signals, for the pools whose policy reads them
        self.pipeline = pipeline
        self.gate = gate  # the slots and the access log of the requests the pipeline does not run
        self.stored = stored  # GET /v1/responses/{id} and its cancel (request/stored_responses.py)
        self.reuse = reuse  # multi-turn KV reuse: /status's held KV per decode
        self.tenants = tenants  # /status's per-key use; the aliases /v1/models lists
        self.admission = admission  # the slots kept for the top class (reloaded with the tenants)
        self.connector = connector  # started with the app (Mooncake's engine ids)
        self.state = state  # the shared state store, if any: /status, closed with the app
        self.tracing = tracing
        self.models = pools["decode"].served.directory  # the cluster's models (every pool tells the same directory)
        self.admin = admin
        self.forwarder = forwarder  # the endpoints one instance answers (routing/endpoints.py)
        self._base_headers = base_headers  # /v1/models' upstream headers (--upstream-api-key)
        other = Generation("")  # the other generation APIs (request/apis.py): the path is the request's
        self._routes: dict[tuple[str, str], Callable[[Request, ResponseWriter], Awaitable[None]] | Generation] = {
            ("POST", CHAT): Generation(CHAT),
            ("POST", COMPLETIONS): Generation(COMPLETIONS),
            ("POST", MESSAGES): other,
            ("POST", RESPONSES): other,
            ("POST", GENERATE): other,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/ready"): self._ready,
            ("GET", "/load"): self._load,
            ("GET", "/status"): self._status,
            ("GET", "/metrics"): self.own_metrics,
            ("POST", "/instances"): self.admin.register,
            ("DELETE", "/instances"): self.admin.unregister,
            ("GET", "/instances"): self.admin.roster,
            ("POST", "/instances/drain"): self.admin.drain,
            ("POST", "/start_profile"): self.admin.start_profile,
            ("POST", "/stop_profile"): self.admin.stop_profile,
            ("POST", LOAD): self.admin.load_lora,
            ("POST", UNLOAD): self.admin.unload_lora,
        }
        # The paths that take no client key (OPEN_PATHS): the probes, the admin key's (the
        # handlers of admin.py, /status, /metrics, the console's JSON: each checks the admin key
        # itself), the console's static page.
        keyless = set(OPEN_PATHS) | {"/status", "/metrics"}
        keyless.update(path for (_, path), handler in self._routes.items()
                       if getattr(handler, "__self__", None) is self.admin)
        self.console = console  # the live page and its JSON (console.py)
        if console is not None:
            console_routes = console.routes()
            self._routes.update(console_routes)
            keyless.update(path for _, path in console_routes)
        self._keyless = frozenset(keyless)
        self._model_views = (self._routes[("GET", "/v1/models")], self._model)  # they show the key's models
        self._forwarded = self.forwarder.handle
        for path, endpoint in ROUTED.items():
            self._routes[(endpoint.method, path)] = self._forwarded
        # HEAD on every GET route: answered as GET, without the body (the writer drops it).
        for method, path in list(self._routes):
            if method == "GET":
                self._routes[("HEAD", path)] = self._routes[(method, path)]
        self._allow = allowed_methods(self._routes)  # a 405's Allow header, per path
        # Set on SIGTERM (serve.py): /ready 503, every response closes its connection. Not an
        # instance's drain (an operator taking one instance out: membership.py).
        self.shutting_down = False
        self.siblings = siblings  # --workers > 1: /metrics, /status, /ready ask siblings
        # Who may call the API (client_auth.py); None = open. Every path but the keyless ones
        # needs a client key; /metrics (its labels are instance URLs) is the roster's: the admin
        # key's whenever any key is set.
        self.client_keys = client_keys
        self._metrics_key = config.admin_api_key.encode() if config.admin_api_key else None

    def add_route(self, method: str, path: str, handler: Callable[[Request, ResponseWriter], Awaitable[None]], *,
                  keyless: bool = False) -> None:
        """A route set after construction (the sidecar's: ``runtime/sidecar.py``); a GET one
        answers HEAD too. ``keyless``: reached without a client key (the handler decides who may)."""
        self._routes[(method, path)] = handler
        if method == "GET":
            self._routes[("HEAD", path)] = handler
        if keyless:
            self._keyless = self._keyless | {path}
        self._allow = allowed_methods(self._routes)

    def reload(self) -> None:
        """A reload hook (reload.py): read the client key file again; ValueError if it cannot be
        read (the keys in force stay)."""
        if self.client_keys is not None:
            self.client_keys.reload()

    @property
    def topology(self) -> str:
        """PD, E+PD, P+D or E+P+D: pinned, or what the roster holds (``none`` while empty)."""
        return self.membership.topology

    async def start(self) -> None:
        await self.connector.start()
        for pool in self.pools.values():
            pool.checks.start(self.config.probe_interval, self.config.probe_timeout)
        self.membership.start()
        for scraper in self.scrapers:
            scraper.start()
        if self.kv_events is not None:
            self.kv_events.start(i.spec for pool in self.pools.values() for i in pool.instances)

    async def close(self) -> None:
        if self.console is not None:
            await self.console.close()  # its last gateway summary, before the store closes
        for scraper in self.scrapers:
            await scraper.close()
        if self.kv_events is not None:
            await self.kv_events.close()
        await self.membership.close()
        await self.pipeline.close()
        await self.stored.owners.written()
        if self.state is not None:
            await self.state.close()
        if self.tracing is not None:
            self.tracing.close()
        for pool in self.pools.values():
            await pool.close()

    def __call__(self, req: Request, writer: ResponseWriter) -> Awaitable[None]:
        """The request's handling, to be awaited. Not a coroutine itself: a generation request
        is the pipeline's coroutine, awaited by the connection directly (one coroutine less
        between the connection and every await of the request path)."""
        if self.shutting_down:
            writer.keep_alive = False
        keys = self.client_keys
        key = scope = None  # the name of the client key presented (the access log's, its tenant's), and its scope
        if keys is not None and req.path not in self._keyless:
            authorization = req.headers.get(b"authorization")
            key = keys.identify(authorization, req.headers.get(b"x-api-key"))
            if key is None:
                # Before the route: an unauthenticated caller learns nothing about the API's paths.
                body = INVALID_KEY_BODY if authorization or req.headers.get(b"x-api-key") else MISSING_KEY_BODY
                if speaks_anthropic(req.path):
                    body = _ANTHROPIC_401[body]
                writer.send(401, body, b"application/json", CHALLENGE)
                self._served(req, writer, time.perf_counter())
                return _answered()
            scope = keys.scope(key)  # what the request stores and reads back is its key's (key_scope.py)
        handler = self._routes.get((req.method, req.path))
        if handler is None and req.path.startswith(_MODEL_PREFIX) and req.method in ("GET", "HEAD"):
            handler = self._model_views[1]
        if isinstance(handler, Generation):
            # The pipeline is handed the client key's name and scope too, and writes its own access-log line.
            return self.pipeline.handle(req, writer, handler.path or req.path, key, scope)
        return self._other(req, writer, handler, key, scope)

    async def _other(self, req: Request, writer: ResponseWriter, handler, key: str | None,
                     scope: bytes | None) -> None:
        """Every request but a generation request (``handler``: its route's, None: none)."""
        if handler == self._forwarded:  # a routed endpoint: it writes its line too, with its model
            await self.forwarder.handle(req, writer, key)
            return
        if handler in self._model_views:  # the models the caller's key may use
            t0 = time.perf_counter()
            await handler(req, writer, key)
            self._served(req, writer, t0, key)
            return
        t0 = time.perf_counter()
        stored = parse_path(req.method, req.path) if handler is None else None
        if stored is not None:  # a stored response (request/stored_responses.py): the key's limits too
            gate, tenants = self.gate, self.tenants
            ticket = await gate.enter_tenant(req, writer, stored[1], t0, key) if tenants.active else None
            if (ticket is not None or not tenants.active) and (
                    not gate.gated or await gate.admit(req, writer, stored[1], t0, ticket)):
                try:
                    await self.stored.handle(req, writer, *stored, scope)
                finally:
                    gate.leave()
                    if ticket is not None:
                        tenants.leave(ticket, writer.status or 499, NO_TOKENS)
            self._served(req, writer, t0, key)
            return
        if handler is None:
            allow = self._allow.get(req.path)
            if allow is not None:
                err = ProxyError(405, f"method {req.method} not allowed on {req.path}")
                writer.send(err.status, err.body(speaks_anthropic(req.path)), headers=[(b"allow", allow)])
            else:
                err = ProxyError(404, f"no route for {req.method} {req.path}")
                writer.send(err.status, err.body(speaks_anthropic(req.path)))
            self.metrics.observe_request("other", err.status, time.perf_counter() - t0)
        else:
            await handler(req, writer)
        self._served(req, writer, t0, key)

    def _served(self, req: Request, writer: ResponseWriter, t0: float, key: str | None = None) -> None:
        """The access-log line of a request the pipeline did not run (``key``: the client key's name)."""
        access = self.gate.access_log
        if access is not None:
            rid = client_request_id(req)
            access.other(rid.decode("ascii") if rid else "-", req.method, req.path, writer.status,
                         writer.bytes_sent, time.perf_counter() - t0, req.peer, req.headers, key=key)

    async def _models(self, req: Request, writer: ResponseWriter, key: str | None = None) -> None:
        """The models of the live instances, each id once, in vLLM's shape (instances/models.py),
        those ``key`` may use (tenants/limiter.py). While no instance has said what it serves
        yet: a live decode instance's list, learnt and relayed as received (to a key without a
        model list; a key with one gets its models of what was learnt)."""
        cards = self.models.current.cards
        tenants = self.tenants
        if not cards and tenants.visible(key) is None:
            await self._models_of_one(writer)
            return
        if not cards:
            await self._models_of_one(None)
            cards = self.models.current.cards
            if not cards:
                err = ProxyError(503, "no decode instance has said which models it serves yet")
                writer.send(err.status, err.body(), headers=[(b"retry-after", b"5")])
                return
        writer.send(200, models_list(tenants.cards(key, cards)))  # aliases listed as the operator chose

    async def _model(self, req: Request, writer: ResponseWriter, key: str | None = None) -> None:
        """``GET /v1/models/{id}``: one model card of the union (vLLM itself has no such route);
        404 for a model ``key`` may not use, as for one nobody serves."""
        name = unquote(req.path[len(_MODEL_PREFIX):])
        catalog = self.models.current
        if not catalog.cards:  # nothing known yet: learn from a decode instance first
            await self._models_of_one(None)
            catalog = self.models.current
        card = catalog.card(name)
        tenants = self.tenants
        aliases = tenants.aliases
        if card is None and aliases is not None:
            card = next((c for c in aliases.cards(catalog.cards) if c.get("id") == name), None)
        allowed = tenants.visible(key)
        if allowed is not None:  # one of the key's models (the aliases its list names, in any listing)
            served = aliases.names.get(name, name) if aliases is not None else name
            card = next((c for c in tenants.cards(key, catalog.cards) if c.get("id") == name),
                        card if card is not None and may_use(allowed, aliases, name, served) else None)
        if card is not None:
            writer.send(200, msgspec.json.encode(card))
            return
        writer.send(404, catalog.not_found(name, tenants.model_ids(key, catalog)).body())

    async def _models_of_one(self, writer: ResponseWriter | None) -> None:
        """A live decode instance's model list: learnt (served_models.py), and relayed to ``writer`` if given."""
        pool = self.pools["decode"]
        t = self.config.timeouts
        timeouts = TransportTimeouts(connect=t.connect, headers=10.0, idle=10.0)
        tried: set[Instance] = set()
        last: ProxyError = ProxyError(503, "no decode instance available")
        for _ in range(min(2, len(pool))):
            try:
                inst = choose(pool, tried)
            except ProxyError as err:
                last = err
                break
            tried.add(inst)
            try:
                status, content_type, data = await inst.connections.fetch(
                    "GET", "/v1/models", headers=self._base_headers, timeouts=timeouts)
            except UpstreamError as exc:
                pool.outliers.record_failure(inst, str(exc))
                log.warning("GET /v1/models: decode instance %s unreachable: %s", inst.url, exc)
                last = ProxyError(502, "decode instance unreachable")  # the address stays in the log
                continue
            if status == 200:
                try:
                    pool.served.learned(inst, data)
                except ValueError:
                    pass  # not a model list: relayed as it is
            if writer is not None:
                writer.send(status, data, content_type)
            return
        if writer is not None:
            writer.send(last.status, last.body(), headers=[(b"retry-after", b"5")] if last.status == 503 else None)

    async def _load(self, req: Request, writer: ResponseWriter) -> None:
        """vLLM's ``/load`` for the cluster as this proxy sees it: ``server_load`` is the
        requests it has in progress on the instances (a P/D request counts on both of its
        instances; with --workers, this worker's), ``by_role`` the same per pool."""
        by_role = {role: sum(inst.inflight for inst in pool.instances) for role, pool in self.pools.items()}
        writer.send(200, msgspec.json.encode({"server_load": sum(by_role.values()), "by_role": by_role}))

    async def _health(self, req: Request, writer: ResponseWriter) -> None:
        """Liveness of the proxy itself: never waits on a backend."""
        writer.send(200, b'{"status":"ok"}')

    async def _ready(self, req: Request, writer: ResponseWriter) -> None:
        """Whether this proxy can take traffic, not whether its backends are healthy: 503 while
        shutting down, or while a role the topology needs has no instance at all; otherwise 200,
        even when a pool is failing (the proxy then answers those requests itself, which beats
        a load balancer dropping every replica at once). Backend health is in /status.
        With --workers, 200 only when every worker that answers is ready."""
        status, body = self._local_ready()
        if status == 200 and self.siblings is not None:
            peers = await self.siblings.ask("ready")
            for peer_status, peer_body in peers:
                if peer_status != 200:
                    status, body = peer_status, peer_body
                    break
            else:
                # Live workers (one being replaced does not answer), and how many there should be.
                body = dict(body, workers=1 + len(peers), workers_configured=self.siblings.count)
        if status == 200:
            writer.send(200, _READY if self.siblings is None else msgspec.json.encode(body))
        else:
            writer.send(status, msgspec.json.encode(body), headers=[(b"retry-after", b"5")])

    def ready_locally(self) -> bool:
        """This process's readiness as ``/ready`` tells it (the endpoint picker's gRPC readiness)."""
        return self._local_ready()[0] == 200

    def _local_ready(self) -> tuple[int, dict]:
        if self.shutting_down:
            return 503, {"status": "draining"}  # the word load balancers have seen since the start
        missing = [role for role in self.membership.required_roles() if not self.pools[role].instances]
        if missing:
            return 503, {"status": "unavailable", "no_instances": missing}
        return 200, {"status": "ready"}

    def _local_status(self) -> dict:
        pools = {role: pool.snapshot() for role, pool in self.pools.items()}
        _with_held_kv(pools, self.reuse)
        return {"topology": self.topology, "kv_connector": self.config.kv_connector if self.pools["prefill"]
                else None, "pools": pools, "models": self._model_status(pools),
                "roster": self.membership.snapshot(), "pid": os.getpid(),  # pid: which --workers worker
                "proxy": {"version": VERSION},  # the proxy's own (GET /version answers an instance's)
                "routing": {role: pool.policy.name for role, pool in self.pools.items()},
                "state_store": self.state.status() if self.state is not None else None,
                **({"kv_events": self.kv_events.status()} if self.kv_events is not None and self.kv_events.active
                   else {})}

    def _model_status(self, pools: dict[str, list[dict]]) -> dict:
        """Per model: its roles' instances in rotation and out, ready or not and why (model_directory.py)."""
        return model_readiness(pools, self.models.current.parents, self.membership.required_roles())

    async def _status(self, req: Request, writer: ResponseWriter) -> None:
        if not self.admin.allowed(req, writer, READ):  # internal addresses: access.py says who sees them
            return
        body = self._local_status()
        if self.tenants.active:  # each key's use of its limits (with --workers: this worker's view)
            body["tenants"] = await self.tenants.status()
        if self.siblings is not None:
            peers, supervisor = await asyncio.gather(self.siblings.ask("status"), self.siblings.supervisor())
            pools = merge_pool_status([body["pools"]] + [p["pools"] for p in peers])
            body = dict(body, workers=1 + len(peers), workers_configured=self.siblings.count,
                        supervisor=supervisor,  # per worker: pid, restarts, last exit, back-off
                        pools=pools, models=self._model_status(pools))
        writer.send(200, msgspec.json.encode(body))

    async def own_metrics(self, req: Request, writer: ResponseWriter) -> None:
        """This process's exposition (its workers' too): ``/metrics``, or the sidecar's own path."""
        if self._metrics_key is not None:
            if not admin_key_presented(req.headers, self._metrics_key):
                err = unauthorized(f"{req.path} needs the admin API key (X-API-Key or Authorization: Bearer)")
                writer.send(401, err.body(), b"application/json", CHALLENGE)
                return
        elif self.client_keys is not None and not self.admin.allowed(req, writer, READ):
            return  # client keys and no admin key: refused to everyone (access.py)
        if self.siblings is None:
            writer.send(200, self.metrics.render(), _METRICS_TYPE)
            return
        own = self.siblings.own(self.metrics.snapshot())  # kept by the parent before it is shown
        writer.send(200, render([own] + await self.siblings.metrics()), _METRICS_TYPE)

    async def answer_sibling(self, question: str):
        """This worker's own view, for the worker a client asked (siblings.py)."""
        if question == "metrics":
            snapshot = self.metrics.snapshot()
            return self.siblings.own(snapshot) if self.siblings is not None else snapshot
        if question == "status":
            return self._local_status()
        if question == "ready":
            return list(self._local_ready())
        if self.console is not None:
            return await self.console.answer(question)
        return None


_READY = b'{"status":"ready"}'
# The refused API call's answers for Anthropic's clients (/v1/messages), encoded once.
_ANTHROPIC_401 = {body: as_anthropic(401, body) for body in (MISSING_KEY_BODY, INVALID_KEY_BODY)}


class Generation:
    """A generation route's entry in the route table: ``ProxyApp.__call__`` hands the request to
    the pipeline under ``path`` ("": the request's own), with the client key's name. In the
    table so the path has its 405 ``Allow`` like any route; never called."""

    __slots__ = ("path",)

    def __init__(self, path: str) -> None:
        self.path = path


async def _answered() -> None:
    """What a request answered before any await has left to do: nothing."""


def allowed_methods(routes) -> dict[str, bytes]:
    """Per path, the ``Allow`` header value of its 405 (RFC 9110 §15.5.6): its methods, sorted."""
    methods: dict[str, set[str]] = {}
    for method, path in routes:
        methods.setdefault(path, set()).add(method)
    return {path: ", ".join(sorted(ms)).encode() for path, ms in methods.items()}


def merge_pool_status(views: list[dict]) -> dict:
    """Per-worker ``/status`` pools as one: counts add up, an instance is ``healthy`` only if
    every worker has it in rotation (``healthy_workers`` says in how many it is)."""
    out: dict[str, dict] = {}
    for pools in views:
        for role, instances in pools.items():
            merged = out.setdefault(role, {})
            for inst in instances:
                have = merged.get(inst["url"])
                if have is None:
                    have = merged[inst["url"]] = dict(inst, errors=dict(inst["errors"]), healthy_workers=0)
                    have["healthy_workers"] = 1 if inst["healthy"] else 0
                    continue
                for key in ("inflight", "requests", "ejections"):
                    have[key] += inst[key]
                for kind, n in inst["errors"].items():
                    have["errors"][kind] = have["errors"].get(kind, 0) + n
                have["consecutive_failures"] = max(have["consecutive_failures"], inst["consecutive_failures"])
                have["healthy"] = have["healthy"] and inst["healthy"]
                have["healthy_workers"] += 1 if inst["healthy"] else 0
                if have["state"] != inst["state"]:
                    have["state"] = "mixed"
                have["last_error"] = have["last_error"] or inst["last_error"]
                have["models"] = have.get("models") or inst.get("models")  # a worker that has read them
                if inst["ejected_until"] is not None:
                    have["ejected_until"] = max(have["ejected_until"] or 0, inst["ejected_until"])
                _merge_held_kv(have, inst)
    return {role: list(merged.values()) for role, merged in out.items()}


def _with_held_kv(pools: dict[str, list[dict]], reuse: TurnReuse) -> None:
    """Each decode's multi-turn KV reuse (``kv_reuse``, unless --no-kv-reuse): whether it keeps
    blocks (null: not known yet), and the tokens and conversations this process keeps for a
    next turn there (architecture.md, "Multi-turn KV reuse")."""
    if reuse.store is None:
        return
    held = reuse.status()
    for inst in pools.get("decode", ()):
        inst["kv_reuse"] = held.get(inst["url"]) or {"keeps_blocks": None, "held_tokens": 0, "held_conversations": 0,
                                                  "kv_budget": None}


def _merge_held_kv(have: dict, inst: dict) -> None:
    """Another worker's ``kv_reuse`` of the same decode: held counts add up; it keeps blocks if
    any worker saw it do so."""
    mine, theirs = have.get("kv_reuse"), inst.get("kv_reuse")
    if theirs is None:
        return
    if mine is None:
        have["kv_reuse"] = dict(theirs)
        return
    mine = have["kv_reuse"] = dict(mine)
    mine["held_tokens"] += theirs["held_tokens"]
    mine["held_conversations"] += theirs["held_conversations"]
    if theirs["keeps_blocks"] is not None and mine["keeps_blocks"] is not True:
        mine["keeps_blocks"] = theirs["keeps_blocks"]


def log_requests(handler):
    """``--log-requests`` (the reference's flag): one debug line per request. Off by
    default: the success path logs nothing."""
    async def logged(req: Request, writer: ResponseWriter) -> None:
        t0 = time.perf_counter()
        try:
            await handler(req, writer)
        finally:
            log.debug("%s %s -> %s in %.1f ms (%s)", req.method, req.target.decode("latin-1"), writer.status or 499,
                      (time.perf_counter() - t0) * 1000, (req.header(b"x-request-id") or b"-").decode("latin-1"))
    return logged
