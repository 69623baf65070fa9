"""The proxy's HTTP surface: routes, and the objects one server process owns."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import msgspec

from .access import READ, AccessPolicy
from .admin import AdminApi
from .client_auth import CHALLENGE, INVALID_KEY_BODY, MISSING_KEY_BODY, ClientKeys, admin_key_presented, unauthorized
from .config import ROLES, ProxyConfig
from .connectors import CONNECTORS
from .errors import ProxyError
from .http.client import Timeouts, UpstreamError
from .http.server import Request, ResponseWriter
from .metrics import ProxyMetrics
from .health import OutlierSettings
from .pipeline import CHAT, COMPLETIONS, Pipeline
from .load_signals import LoadScraper
from .membership import Membership, check_registration
from .pool import InstancePool
from .routing import make_policy

log = logging.getLogger("epd_proxy.app")

_METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def validate_config(config: ProxyConfig) -> None:
    """Everything checkable before serving: raises ValueError with an operator-facing message."""
    config.validate()
    ClientKeys.from_config(config)  # the key file can be read
    connector = CONNECTORS.get(config.kv_connector)
    if connector is None:
        raise ValueError(f"unknown --kv-connector {config.kv_connector!r} (known: {', '.join(CONNECTORS)})")
    if config.prefill:
        connector.check_instances(config.prefill)
    if config.topology != "auto":
        for role in ROLES:
            for spec in getattr(config, role):
                reason = check_registration(spec, (), config.topology)
                if reason is not None:
                    raise ValueError(f"{spec.url}: {reason}")


class ProxyApp:
    """Routes requests; owns the pools, the pipeline and the metrics."""

    def __init__(self, config: ProxyConfig) -> None:
        validate_config(config)
        self.config = config
        # Every role has a pool, possibly empty: instances may register at run time.
        self.pools: dict[str, InstancePool] = {}
        for role in ROLES:
            specs = _with_ec_consumers(config) if role == "decode" else getattr(config, role)
            policy = make_policy(config.policy_for(role), balance_abs=config.balance_abs,
                                 balance_rel=config.balance_rel)
            self.pools[role] = InstancePool(role, specs, policy=policy,
                                            keep_alive=config.upstream_keep_alive,
                                            fail_threshold=config.fail_threshold,
                                            outlier=OutlierSettings.from_config(config),
                                            max_connections=config.max_upstream_connections)
        connector = CONNECTORS[config.kv_connector]
        self.membership = Membership(self.pools, evicted_ttl=config.evicted_ttl, topology=config.topology,
                                     check=lambda spec: connector.check_instances([spec])
                                     if spec.role == "prefill" else None)
        self.metrics = ProxyMetrics(self.pools)
        self.metrics.membership = self.membership
        # Load signals are scraped only for the pools whose policy reads them.
        self.scrapers = [LoadScraper(pool, config.scrape_interval, config.probe_timeout)
                         for pool in self.pools.values() if pool.policy.uses_signals]
        self.pipeline = Pipeline(config, self.pools, self.metrics)
        self.membership.subscribe(self._roster_changed)
        self.admin = AdminApi(self.membership, AccessPolicy(config.admin_api_key, config.registration_allow),
                              self.pipeline._base_headers)
        self._routes = {
            ("POST", CHAT): self._generate_chat,
            ("POST", COMPLETIONS): self._generate_completions,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("HEAD", "/health"): self._health,
            ("GET", "/ready"): self._ready,
            ("HEAD", "/ready"): self._ready,
            ("GET", "/status"): self._status,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/instances"): self.admin.register,
            ("DELETE", "/instances"): self.admin.unregister,
            ("GET", "/instances"): self.admin.roster,
            ("POST", "/instances/drain"): self.admin.drain,
            ("POST", "/start_profile"): self.admin.start_profile,
            ("POST", "/stop_profile"): self.admin.stop_profile,
        }
        self._paths = {path for _, path in self._routes}
        self.draining = False  # set on SIGTERM (serve.py): /ready 503, every response closes its connection
        # Who may call /v1/* (client_auth.py); None = open. /health, /ready and /metrics stay open
        # (/metrics needs the admin key with --protect-metrics).
        self.client_keys = ClientKeys.from_config(config)
        self._metrics_key = config.admin_api_key.encode() if config.protect_metrics else None

    def reload(self) -> None:
        """A reload hook (reload.py): read the client key file again; ValueError if it cannot be
        read (the keys in force stay)."""
        if self.client_keys is not None:
            self.client_keys.reload()

    @property
    def topology(self) -> str:
        """PD, E+PD, P+D or E+P+D: pinned, or what the roster holds (``none`` while empty)."""
        return self.membership.topology

    def _roster_changed(self, change) -> None:
        if change.event in ("registered", "removed", "forgotten"):
            self.pipeline.connector.forget(change.spec.url)

    async def start(self) -> None:
        await self.pipeline.connector.start()
        for pool in self.pools.values():
            pool.start_probing(self.config.probe_interval, self.config.probe_timeout)
        self.membership.start()
        for scraper in self.scrapers:
            scraper.start()

    async def close(self) -> None:
        for scraper in self.scrapers:
            await scraper.close()
        await self.membership.close()
        await self.pipeline.close()
        for pool in self.pools.values():
            await pool.close()

    async def __call__(self, req: Request, writer: ResponseWriter) -> None:
        if self.draining:
            writer.keep_alive = False
        keys = self.client_keys
        if keys is not None and req.path.startswith("/v1/"):
            authorization = req.headers.get(b"authorization")
            if not keys.allows(authorization):
                # Before the route: an unauthenticated caller learns nothing about the API's paths.
                body = INVALID_KEY_BODY if authorization else MISSING_KEY_BODY
                writer.send(401, body, b"application/json", CHALLENGE)
                return
        handler = self._routes.get((req.method, req.path))
        if handler is None:
            if req.path in self._paths:
                err = ProxyError(405, f"method {req.method} not allowed on {req.path}")
            else:
                err = ProxyError(404, f"no route for {req.method} {req.path}")
            writer.send(err.status, err.body())
            return
        await handler(req, writer)

    async def _generate_chat(self, req: Request, writer: ResponseWriter) -> None:
        await self.pipeline.handle(req, writer, CHAT)

    async def _generate_completions(self, req: Request, writer: ResponseWriter) -> None:
        await self.pipeline.handle(req, writer, COMPLETIONS)

    async def _models(self, req: Request, writer: ResponseWriter) -> None:
        """The model list of a live decode instance, relayed as received."""
        pool = self.pools["decode"]
        t = self.config.timeouts
        timeouts = Timeouts(connect=t.connect, headers=10.0, idle=10.0)
        tried = set()
        last: ProxyError = ProxyError(503, "no decode instance available")
        for _ in range(min(2, len(pool))):
            try:
                inst = pool.choose(tried)
            except ProxyError as err:
                last = err
                break
            tried.add(inst)
            try:
                resp = await inst.http.request("GET", "/v1/models", headers=self.pipeline._base_headers,
                                               timeouts=timeouts)
                try:
                    data = await resp.read()
                finally:
                    resp.close()
            except UpstreamError as exc:
                pool.record_failure(inst, str(exc))
                log.warning("GET /v1/models: decode instance %s unreachable: %s", inst.url, exc)
                last = ProxyError(502, "decode instance unreachable")  # the address stays in the log
                continue
            writer.send(resp.status, data, resp.content_type)
            return
        writer.send(last.status, last.body(), headers=[(b"retry-after", b"5")] if last.status == 503 else None)

    async def _health(self, req: Request, writer: ResponseWriter) -> None:
        """Liveness of the proxy itself: never waits on a backend."""
        writer.send(200, b'{"status":"ok"}')

    async def _ready(self, req: Request, writer: ResponseWriter) -> None:
        """Whether this proxy can take traffic, not whether its backends are healthy: 503 while
        draining, or while a role the topology needs has no instance at all; otherwise 200,
        even when a pool is failing (the proxy then answers those requests itself, which beats
        a load balancer dropping every replica at once). Backend health is in /status."""
        if self.draining:
            writer.send(503, b'{"status":"draining"}', headers=[(b"retry-after", b"5")])
            return
        missing = [role for role in self.membership.required_roles() if not self.pools[role].instances]
        if missing:
            body = msgspec.json.encode({"status": "unavailable", "no_instances": missing})
            writer.send(503, body, headers=[(b"retry-after", b"5")])
        else:
            writer.send(200, b'{"status":"ready"}')

    async def _status(self, req: Request, writer: ResponseWriter) -> None:
        if not self.admin.allowed(req, writer, READ):  # internal addresses: the admin key's, if one is set
            return
        body = {"topology": self.topology, "kv_connector": self.config.kv_connector if self.pools["prefill"]
                else None, "pools": {role: pool.snapshot() for role, pool in self.pools.items()},
                "roster": self.membership.snapshot(), "pid": os.getpid(),  # pid: which --workers worker
                "routing": {role: pool.policy.name for role, pool in self.pools.items()}}
        writer.send(200, msgspec.json.encode(body))

    async def _metrics(self, req: Request, writer: ResponseWriter) -> None:
        if self._metrics_key is not None and not admin_key_presented(req.headers, self._metrics_key):
            err = unauthorized("/metrics needs the admin API key (X-API-Key or Authorization: Bearer)")
            writer.send(401, err.body(), b"application/json", CHALLENGE)
            return
        writer.send(200, self.metrics.render(), _METRICS_TYPE)


def _with_ec_consumers(config: ProxyConfig) -> list:
    """The decode specs with their EC consumer addresses (``--ec-consumer-zmq-addrs``,
    aligned with them, ``--ec-consumer-dp-size`` each), so every decode instance
    carries its own, as a registered one does."""
    addrs, dp = config.ec_consumer_zmq_addrs, config.ec_consumer_dp_size
    if not addrs:
        return list(config.decode)
    return [dataclasses.replace(spec, ec_zmq_addrs=tuple(addrs[i * dp:(i + 1) * dp]), dp_size=dp)
            for i, spec in enumerate(config.decode)]


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
