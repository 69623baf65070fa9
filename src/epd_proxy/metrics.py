"""The proxy's Prometheus metrics.

Recording is plain arithmetic on the event loop's thread: an ``int += 1`` and,
for a histogram, one ``bisect``. The Prometheus families are built from those
numbers only when ``/metrics`` is scraped, so a request pays no locks, no label
resolution and no per-sample objects (prometheus_client's own metric objects
take a lock per increment: about a dozen per request).
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Buckets:
    """One histogram series: counts per bucket (upper bounds inclusive, as Prometheus'
    ``le``), the last one for values above every bound."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple = _STAGE_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of values <= le)`` for each bound and ``+Inf``."""
        out, total = [], 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            out.append((_le(bound), total))
        out.append(("+Inf", total + self.counts[-1]))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


class ProxyMetrics:
    """Request, stage and failure counts of this process, and its pools' state."""

    def __init__(self, pools: dict | None = None) -> None:
        self.requests: dict[tuple[str, int], int] = {}  # (endpoint, status) -> answered
        self.durations: dict[str, Buckets] = {}  # endpoint -> time to the end of the response
        self.stages: dict[str, Buckets] = {}  # stage -> time spent in it
        self.retries = 0
        self.stream_errors = 0
        self.disconnects = 0
        self.inflight = 0
        self.pools = pools or {}
        self.admission = None  # admission.Admission, read at scrape time
        self.role_admission: dict = {}  # role -> Admission (--max-inflight-per-role)
        self.queue_wait = Buckets()  # queued requests only: time until admitted or shed
        self.membership = None  # set by the app: roster size and changes
        self.front_door = None  # http.server.HttpServer, read at scrape time
        self.discovery = None  # discovery.DnsDiscovery (dns+ instances), read at scrape time
        self.reloader = None  # reload.Reloader (SIGHUP, cluster file), read at scrape time
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- recording (hot path) -------------------------------------------------------------
    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        d = self.durations.get(endpoint)
        if d is None:
            d = self.durations[endpoint] = Buckets()
        d.observe(seconds)

    def observe_stages(self, timings: dict) -> None:
        stages = self.stages
        for stage, seconds in timings.items():
            b = stages.get(stage)
            if b is None:
                b = stages[stage] = Buckets()
            b.observe(seconds)

    # -- exposition (scrape time) ----------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def describe(self):
        return []

    def collect(self):
        req = CounterMetricFamily("epd_proxy_requests", "Client requests answered, by endpoint and status.",
                                  labels=["endpoint", "status"])
        for (endpoint, status), n in sorted(self.requests.items()):
            req.add_metric([endpoint, str(status)], float(n))
        yield req
        yield _histogram("epd_proxy_request_duration_seconds", "Time to the end of the response.",
                         "endpoint", self.durations)
        yield _histogram("epd_proxy_stage_duration_seconds",
                         "Time spent in each stage (encode, prefill, decode_first = decode until its first "
                         "event).", "stage", self.stages)
        for name, doc, value in (
            ("epd_proxy_retries", "Attempts retried before the response was committed.", self.retries),
            ("epd_proxy_stream_errors", "Committed streams ended with an in-band error event.",
             self.stream_errors),
            ("epd_proxy_client_disconnects", "Requests whose client went away before the end.",
             self.disconnects),
        ):
            yield CounterMetricFamily(name, doc, value=float(value))
        yield GaugeMetricFamily("epd_proxy_inflight_requests", "Client requests in progress.",
                                value=float(self.inflight))
        yield from _admission_families(self.admission, self.queue_wait)
        yield from _role_admission_families(self.role_admission)
        yield from _front_door_families(self.front_door)
        yield from _pool_families(self.pools)
        if self.membership is not None:
            yield from _membership_families(self.membership)
        yield from _discovery_families(self.discovery, self.reloader)


def _histogram(name: str, doc: str, label: str, series: dict[str, Buckets]) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=[label])
    for key, b in sorted(series.items()):
        h.add_metric([key], b.cumulative(), sum_value=b.sum)
    return h


def _admission_families(admission, queue_wait: Buckets):
    """Admission control (admission.py): what was shed, what waits, how long it waited."""
    if admission is None:
        return
    yield CounterMetricFamily("epd_proxy_shed_requests", "Requests answered 429 by admission control "
                              "(queue full or queue timeout).", value=float(admission.shed))
    yield GaugeMetricFamily("epd_proxy_queue_depth", "Requests waiting for an admission slot.",
                            value=float(admission.waiting))
    yield GaugeMetricFamily("epd_proxy_admitted_requests", "Admission slots in use (0 when unlimited).",
                            value=float(admission.active))
    h = HistogramMetricFamily("epd_proxy_queue_wait_seconds", "Time queued requests waited for a slot "
                              "(until admitted or shed).")
    h.add_metric([], queue_wait.cumulative(), sum_value=queue_wait.sum)
    yield h


def _role_admission_families(caps: dict):
    if not caps:
        return
    shed = CounterMetricFamily("epd_proxy_stage_shed_requests", "Requests answered 429 by a stage's "
                               "concurrency cap (--max-inflight-per-role).", labels=["role"])
    depth = GaugeMetricFamily("epd_proxy_stage_queue_depth", "Requests waiting for a stage's slot.",
                              labels=["role"])
    for role, cap in sorted(caps.items()):
        shed.add_metric([role], float(cap.shed))
        depth.add_metric([role], float(cap.waiting))
    yield shed
    yield depth


def _front_door_families(server):
    """Client connections and what the HTTP server refused before any handler ran."""
    if server is None:
        return
    yield GaugeMetricFamily("epd_proxy_client_connections", "Open client connections.",
                            value=float(len(server.connections)))
    yield CounterMetricFamily("epd_proxy_client_connections_refused", "Connections answered 503 at once "
                              "because --max-connections were open and none was idle.", value=float(server.refused))
    yield CounterMetricFamily("epd_proxy_client_connections_reclaimed", "Idle keep-alive connections closed "
                              "to make room for new ones at --max-connections.", value=float(server.reclaimed))
    yield GaugeMetricFamily("epd_proxy_buffered_body_bytes", "Request-body bytes held (--max-buffered-bytes).",
                            value=float(server.budget.used))
    rejected = CounterMetricFamily("epd_proxy_client_rejections", "Requests refused by the HTTP server before "
                                   "any handler ran (400 malformed, 408 too slow, 413/431 too large, 503 "
                                   "over the body budget), by status.", labels=["status"])
    for status, n in sorted(server.rejections.items()):
        rejected.add_metric([str(status)], float(n))
    yield rejected


def _pool_families(pools: dict):
    """Instance health and load, read at scrape time."""
    healthy = GaugeMetricFamily("epd_proxy_instance_healthy", "1 if the instance is in rotation.",
                                labels=["role", "url"])
    inflight = GaugeMetricFamily("epd_proxy_instance_inflight", "Requests in flight to the instance.",
                                 labels=["role", "url"])
    errors = GaugeMetricFamily("epd_proxy_instance_errors", "Failures seen on the instance (total).",
                               labels=["role", "url"])
    ejections = CounterMetricFamily("epd_proxy_instance_ejections",
                                    "Times the instance was taken out of rotation (probes or outlier detection).",
                                    labels=["role", "url"])
    panics = CounterMetricFamily("epd_proxy_panic_routing",
                                 "Requests routed over every instance of a role because none was in rotation.",
                                 labels=["role"])
    local = CounterMetricFamily("epd_proxy_local_errors",
                                "Upstream connects that failed for lack of the proxy's own resources (EMFILE, "
                                "ENOBUFS, memory); never blamed on an instance.", labels=["role"])
    for role, pool in pools.items():
        for inst in pool.instances:
            healthy.add_metric([role, inst.url], 1.0 if inst.healthy else 0.0)
            inflight.add_metric([role, inst.url], float(inst.inflight))
            errors.add_metric([role, inst.url], float(inst.errors))
            ejections.add_metric([role, inst.url], float(inst.health.ejections))
        panics.add_metric([role], float(pool.panics))
        local.add_metric([role], float(pool.local_errors))
    yield healthy
    yield inflight
    yield errors
    yield ejections
    yield panics
    yield local


def _membership_families(m):
    """The roster, read at scrape time (``membership.py``)."""
    roster = GaugeMetricFamily("epd_proxy_roster_instances",
                               "Instances in the roster, by registered role and state (healthy, ejected, "
                               "half-open, draining; leaving = removed, requests still in flight).",
                               labels=["role", "state"])
    for (role, state), n in sorted(m.counts().items()):
        roster.add_metric([role, state], float(n))
    joins = CounterMetricFamily("epd_proxy_registrations", "Instances that joined the roster, by role.",
                                labels=["role"])
    for role, n in sorted(m.registrations.items()):
        joins.add_metric([role], float(n))
    leaves = CounterMetricFamily("epd_proxy_removals",
                                 "Instances that left the roster, by role and why (unregistered, drained, "
                                 "forgotten).", labels=["role", "reason"])
    for (role, why), n in sorted(m.removals.items()):
        leaves.add_metric([role, why], float(n))
    yield roster
    yield joins
    yield leaves


def _discovery_families(discovery, reloader):
    """DNS lookups and reloads (``discovery.py``, ``reload.py``), read at scrape time."""
    if discovery is not None:
        lookups = CounterMetricFamily("epd_proxy_dns_lookups", "Re-resolutions of dns+ instance names, by "
                                      "result (failed: the known instances were kept).", labels=["result"])
        lookups.add_metric(["ok"], float(discovery.lookups))
        lookups.add_metric(["failed"], float(discovery.failures))
        yield lookups
    if reloader is not None:
        reloads = CounterMetricFamily("epd_proxy_reloads", "Reloads (SIGHUP or a changed cluster file), by "
                                      "result (failed: the running configuration was kept).", labels=["result"])
        reloads.add_metric(["ok"], float(reloader.reloads - reloader.failures))
        reloads.add_metric(["failed"], float(reloader.failures))
        yield reloads
