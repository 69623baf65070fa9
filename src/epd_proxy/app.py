"""The proxy's HTTP surface: routes, and the objects one server process owns."""

from __future__ import annotations

import logging
import time

import msgspec

from . import access_log, tracing
from .config import ProxyConfig
from .connectors import CONNECTORS
from .errors import ProxyError
from .http.client import Timeouts, UpstreamError
from .http.server import Request, ResponseWriter
from .metrics import ProxyMetrics
from .health import OutlierSettings
from .pipeline import CHAT, COMPLETIONS, Pipeline, client_request_id
from .pool import InstancePool

log = logging.getLogger("epd_proxy.app")

_METRICS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def validate_config(config: ProxyConfig) -> None:
    """Everything checkable before serving: raises ValueError with an operator-facing message."""
    config.validate()
    connector = CONNECTORS.get(config.kv_connector)
    if connector is None:
        raise ValueError(f"unknown --kv-connector {config.kv_connector!r} (known: {', '.join(CONNECTORS)})")
    if config.prefill:
        connector.check_instances(config.prefill)


class ProxyApp:
    """Routes requests; owns the pools, the pipeline and the metrics."""

    def __init__(self, config: ProxyConfig) -> None:
        validate_config(config)
        self.config = config
        self.pools: dict[str, InstancePool] = {}
        for role in ("encode", "prefill", "decode"):
            specs = getattr(config, role)
            if specs:
                self.pools[role] = InstancePool(role, specs, policy=config.routing,
                                                keep_alive=config.upstream_keep_alive,
                                                fail_threshold=config.fail_threshold,
                                                outlier=OutlierSettings.from_config(config),
                                                max_connections=config.max_upstream_connections)
        self.metrics = ProxyMetrics(self.pools)
        self.pipeline = Pipeline(config, self.pools, self.metrics)
        if access_log.enabled(config):
            self.pipeline.access_log = access_log.AccessLog(config.log_format)
        self.pipeline.tracing = tracing.from_environment()
        self._routes = {
            ("POST", CHAT): self._generate_chat,
            ("POST", COMPLETIONS): self._generate_completions,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/ready"): self._ready,
            ("GET", "/status"): self._status,
            ("GET", "/metrics"): self._metrics,
        }
        self._paths = {path for _, path in self._routes}
        self._generation = (self._routes[("POST", CHAT)], self._routes[("POST", COMPLETIONS)])
        self.draining = False  # set on SIGTERM (serve.py): /ready 503, every response closes its connection
        self.siblings = None  # siblings.SiblingChannel with --workers > 1: /metrics, /status, /ready ask siblings

    @property
    def topology(self) -> str:
        roles = [r for r in ("encode", "prefill", "decode") if r in self.pools]
        names = {"encode": "E", "prefill": "P", "decode": "D"}
        if "prefill" not in self.pools:
            return ("E+" if "encode" in self.pools else "") + "PD"
        return "+".join(names[r] for r in roles)

    async def start(self) -> None:
        await self.pipeline.connector.start()
        for pool in self.pools.values():
            pool.start_probing(self.config.probe_interval, self.config.probe_timeout)

    async def close(self) -> None:
        await self.pipeline.close()
        if self.pipeline.tracing is not None:
            self.pipeline.tracing.close()
        for pool in self.pools.values():
            await pool.close()

    async def __call__(self, req: Request, writer: ResponseWriter) -> None:
        if self.draining:
            writer.keep_alive = False
        handler = self._routes.get((req.method, req.path))
        if handler in self._generation:
            await handler(req, writer)  # the pipeline writes its own access-log line
            return
        t0 = time.perf_counter()
        if handler is None:
            if req.path in self._paths:
                err = ProxyError(405, f"method {req.method} not allowed on {req.path}")
            else:
                err = ProxyError(404, f"no route for {req.method} {req.path}")
            writer.send(err.status, err.body())
            self.metrics.observe_request("other", err.status, time.perf_counter() - t0)
        else:
            await handler(req, writer)
        access = self.pipeline.access_log
        if access is not None:
            rid = client_request_id(req)
            access.other(rid.decode("ascii") if rid else "-", req.method, req.path, writer.status,
                         writer.bytes_sent, time.perf_counter() - t0)

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
        last: ProxyError = ProxyError(503, "no healthy decode instance available")
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
                last = ProxyError(502, "decode instance unreachable")
                continue
            writer.send(resp.status, data, resp.content_type)
            return
        writer.send(last.status, last.body())

    async def _health(self, req: Request, writer: ResponseWriter) -> None:
        """Liveness of the proxy itself: never waits on a backend."""
        writer.send(200, b'{"status":"ok"}')

    async def _ready(self, req: Request, writer: ResponseWriter) -> None:
        """Whether this proxy can take traffic, not whether its backends are healthy: 503 while
        draining, or while a role the topology needs has no instance at all; otherwise 200,
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
                body = dict(body, workers=1 + len(peers))
        if status == 200:
            writer.send(200, _READY if self.siblings is None else msgspec.json.encode(body))
        else:
            writer.send(status, msgspec.json.encode(body), headers=[(b"retry-after", b"5")])

    def _local_ready(self) -> tuple[int, dict]:
        if self.draining:
            return 503, {"status": "draining"}
        missing = [role for role, pool in self.pools.items() if not pool.instances]
        if missing:
            return 503, {"status": "unavailable", "no_instances": missing}
        return 200, {"status": "ready"}

    def _local_status(self) -> dict:
        return {"topology": self.topology, "kv_connector": self.config.kv_connector if "prefill" in self.pools
                else None, "pools": {role: pool.snapshot() for role, pool in self.pools.items()}}

    async def _status(self, req: Request, writer: ResponseWriter) -> None:
        body = self._local_status()
        if self.siblings is not None:
            peers = await self.siblings.ask("status")
            body = dict(body, workers=1 + len(peers), pools=merge_pool_status([body["pools"]] +
                                                                              [p["pools"] for p in peers]))
        writer.send(200, msgspec.json.encode(body))

    async def _metrics(self, req: Request, writer: ResponseWriter) -> None:
        peers = await self.siblings.ask("metrics") if self.siblings is not None else None
        writer.send(200, self.metrics.render(peers), _METRICS_TYPE)

    async def answer_sibling(self, question: str):
        """This worker's own view, for the worker a client asked (siblings.py)."""
        if question == "metrics":
            return self.metrics.snapshot()
        if question == "status":
            return self._local_status()
        if question == "ready":
            return list(self._local_ready())
        return None


_READY = b'{"status":"ready"}'


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
                if inst["ejected_until"] is not None:
                    have["ejected_until"] = max(have["ejected_until"] or 0, inst["ejected_until"])
    return {role: list(merged.values()) for role, merged in out.items()}
