"""The proxy's Prometheus metrics.

Label children are bound once, so recording a request costs a few dict
look-ups and lock-free increments, not label resolution.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ProxyMetrics:
    def __init__(self, pools: dict | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("epd_proxy_requests", "Client requests answered, by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.duration = Histogram("epd_proxy_request_duration_seconds", "Time to the end of the response.",
                                  ["endpoint"], buckets=_STAGE_BUCKETS, registry=r)
        self.stage = Histogram("epd_proxy_stage_duration_seconds",
                               "Time spent in each stage (encode, prefill, decode_first = decode until "
                               "its first event).", ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        self.retries = Counter("epd_proxy_retries", "Attempts retried before the response was committed.",
                               registry=r)
        self.stream_errors = Counter("epd_proxy_stream_errors",
                                     "Committed streams ended with an in-band error event.", registry=r)
        self.disconnects = Counter("epd_proxy_client_disconnects",
                                   "Requests whose client went away before the end.", registry=r)
        self.inflight = Gauge("epd_proxy_inflight_requests", "Client requests in progress.", registry=r)
        self._req_children: dict = {}
        self._dur_children: dict = {}
        self._stage_children: dict = {}
        if pools:
            r.register(_PoolCollector(pools))

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, status)
        child = self._req_children.get(key)
        if child is None:
            child = self._req_children[key] = self.requests.labels(endpoint, str(status))
        child.inc()
        d = self._dur_children.get(endpoint)
        if d is None:
            d = self._dur_children[endpoint] = self.duration.labels(endpoint)
        d.observe(seconds)

    def observe_stages(self, timings: dict) -> None:
        for stage, seconds in timings.items():
            child = self._stage_children.get(stage)
            if child is None:
                child = self._stage_children[stage] = self.stage.labels(stage)
            child.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector:
    """Instance health and load, read at scrape time."""

    def __init__(self, pools: dict) -> None:
        self.pools = pools

    def describe(self):
        return []

    def collect(self):
        healthy = GaugeMetricFamily("epd_proxy_instance_healthy", "1 if the instance is in rotation.",
                                    labels=["role", "url"])
        inflight = GaugeMetricFamily("epd_proxy_instance_inflight", "Requests in flight to the instance.",
                                     labels=["role", "url"])
        errors = GaugeMetricFamily("epd_proxy_instance_errors", "Failures seen on the instance (total).",
                                   labels=["role", "url"])
        for role, pool in self.pools.items():
            for inst in pool.instances:
                healthy.add_metric([role, inst.url], 1.0 if inst.healthy else 0.0)
                inflight.add_metric([role, inst.url], float(inst.inflight))
                errors.add_metric([role, inst.url], float(inst.errors))
        yield healthy
        yield inflight
        yield errors
