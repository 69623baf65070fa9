"""The composition root: every object one proxy process runs, built in one place and handed
its collaborators in its constructor (sglang's ``app_context.rs`` has the same job). Nothing
built here is given more collaborators afterwards; the metrics learn about each source
through the collector the source registers."""

from __future__ import annotations

import dataclasses
import errno
import os
import ssl

try:
    import resource
except ImportError:  # pragma: no cover - not POSIX
    resource = None  # type: ignore[assignment]

from epd_proxy.api.access import AccessPolicy
from epd_proxy.api.admin import AdminApi
from epd_proxy.api.app import ProxyApp, log_requests, validate_config
from epd_proxy.api.client_auth import ClientKeys
from epd_proxy.api.console import ConsoleApi
from epd_proxy.api.gateway import GatewayBoard
from epd_proxy.api.siblings import SiblingChannel
from epd_proxy.config import ROLES, ProxyConfig
from epd_proxy.encode.media_policy import MediaPolicy
from epd_proxy.gateway.pick import DEFAULT_FALLBACKS
from epd_proxy.gateway.picker import EndpointPicker
from epd_proxy.http import Headers
from epd_proxy.http.heap import trim_heap
from epd_proxy.http.server import HttpServer
from epd_proxy.http.server_limits import ServerLimits
from epd_proxy.instances.adapters import Adapters
from epd_proxy.instances.collectors import adapters_collector, pool_collector, roster_collector
from epd_proxy.instances.health import OutlierSettings
from epd_proxy.instances.load_scraper import LoadScraper
from epd_proxy.instances.membership import Membership
from epd_proxy.instances.model_directory import ModelDirectory
from epd_proxy.instances.pool import InstancePool
from epd_proxy.instances.roster import needs_role
from epd_proxy.instances.shared import SharedRoster
from epd_proxy.instances.sources import RosterSources
from epd_proxy.kvcache.feed import EventFeed
from epd_proxy.kvcache.index import BlockIndex
from epd_proxy.observe import access_log, tracing
from epd_proxy.observe.metrics import Collector, ProxyMetrics
from epd_proxy.observe.recent import RecentRequests
from epd_proxy.placement.decision import Known
from epd_proxy.placement.kv_lookup import KvLookup
from epd_proxy.placement.shared_homes import shared_homes
from epd_proxy.request.admission import Admission, admission_collector
from epd_proxy.request.answer import Answers
from epd_proxy.request.apis import front_door_error_body
from epd_proxy.request.deadline import Deadlines
from epd_proxy.request.entry_gate import EntryGate
from epd_proxy.request.forward import Forwarder
from epd_proxy.request.legs.connectors import CONNECTORS, DecodeOnly, NixlPull
from epd_proxy.request.legs.fanout import EncoderFanout, encoder_collector
from epd_proxy.request.legs.hedged import EncoderHedging, PrefillHedging
from epd_proxy.request.legs.stages import DecodeStage, PrefillStage
from epd_proxy.request.pipeline import Pipeline
from epd_proxy.request.stored_responses import ResponseOwners, StoredResponses
from epd_proxy.request.turns.reuse import TurnReuse
from epd_proxy.routing import make_policy
from epd_proxy.routing.lora_affinity import AdapterAffinity
from epd_proxy.runtime.reload import Reloader
from epd_proxy.runtime.running import ListenError, RunningEpp, RunningProxy, listen_url
from epd_proxy.runtime.workers import PeerLink
from epd_proxy.state.configured import open_store
from epd_proxy.state.guard import GuardedStore, state_collector
from epd_proxy.tenants.limiter import Tenants, build_tenants


def build_app(config: ProxyConfig, *, worker: int = 0, siblings: SiblingChannel | None = None,
              link: PeerLink | None = None) -> ProxyApp:
    """A process's pools, roster, metrics and their sources, load scrapers, pipeline and admin
    API, wired into the app that routes to them (``worker``: this process's index)."""
    validate_config(config)
    pools = build_pools(config)
    connector_class = CONNECTORS[config.kv_connector]
    membership = Membership(pools, evicted_ttl=config.evicted_ttl, topology=config.topology,
                            check=lambda spec: connector_class.check_instances([spec])
                            if spec.role == "prefill" else None)
    metrics = ProxyMetrics(worker=worker, max_models=config.metrics_max_models)
    metrics.register(pool_collector(pools, worker))
    metrics.register(roster_collector(membership))
    # Load signals are scraped for the pools whose policy reads them, and always for the decodes:
    # their queue gauges find one that stands still (wedged), whatever the policy.
    scrapers = [LoadScraper(pool, config.scrape_interval, config.probe_timeout)
                for role, pool in pools.items() if pool.policy.uses_signals or role == "decode"]
    admission = Admission(config.max_inflight, config.queue_size, config.queue_timeout)
    role_caps = {role: Admission(n, config.queue_size, config.queue_timeout)
                 for role, n in config.max_inflight_per_role.items() if n > 0 and role in pools}
    metrics.register(admission_collector(admission, role_caps, metrics.queue_wait))
    tenants = build_tenants(config)  # per-key limits, classes, aliases (off without their tables)
    metrics.register(tenants.collect)
    admission.reserve_for(tenants.table.top_rank, tenants.table.reserved_slots)
    base_headers = upstream_headers(config)
    t = config.timeouts
    fanout = EncoderFanout(pools["encode"], max_batch=config.encoder_max_batch_size, rewrite=config.rewrite,
                           timeout=t.encode, connect_timeout=t.connect,
                           max_outstanding=config.encoder_max_outstanding, fallback=config.encoder_fallback,
                           observe_sub_request=metrics.observe_encoder_request)
    metrics.register(encoder_collector(fanout))
    prefill = PrefillStage(pools["prefill"], timeout=t.prefill, connect_timeout=t.connect)
    decode = DecodeStage(pools["decode"], first_timeout=t.decode_first, idle_timeout=t.stream_idle,
                         connect_timeout=t.connect)
    connector = connector_class(prefill, decode)
    if config.hedging:
        bounds = (config.hedge_budget, config.hedge_min_delay, config.hedge_max_delay, config.hedge_max_per_instance)
        fanout.hedging = EncoderHedging(pools["encode"], metrics.hedges, *bounds)
        if isinstance(connector, NixlPull):  # push and Mooncake: never (hedged.py)
            connector.hedging = PrefillHedging(prefill, metrics.hedges, *bounds)
    state = open_store(config, link)  # shared by replicas (--state-store) or --workers (the parent)
    metrics.register(state_collector(state))
    adapters = Adapters(pools, base_headers, timeout=config.lora_load_timeout, sources=config.lora_sources,
                        directory=config.lora_dir, max_loads=config.max_lora_loads,
                        learn_timeout=config.probe_timeout, shared=state)
    metrics.register(adapters_collector(adapters))
    kv_events = EventFeed(BlockIndex(config.kv_index_max_blocks), config.kv_events_port)
    kv = KvLookup(kv_events, pools["decode"], base_headers)
    recent = RecentRequests()  # the console's ring: filled only while a console looks
    decode_only = DecodeOnly(None, decode)
    known = Known(pools["decode"], pools["prefill"], connector=connector.name,
                  prefill_needed=needs_role(config, "prefill"),
                  local_prefill_max_tokens=config.local_prefill_max_tokens,
                  local_prefill_max_streams=config.local_prefill_max_streams, balance_abs=config.balance_abs,
                  balance_rel=config.balance_rel, ec_consumer_dp_size=config.ec_consumer_dp_size,
                  encode=pools["encode"], encode_outstanding=fanout.outstanding,
                  encode_bound=config.encoder_max_outstanding)
    # Multi-turn KV reuse: decode's parameters kept for each conversation's next turn.
    reuse = TurnReuse(config, prefill=pools["prefill"], decode=pools["decode"], connector=connector,
                      decode_only=decode_only, models=pools["decode"].served.directory, base_headers=base_headers,
                      shared=state, kv=kv)
    metrics.register(reuse.collector())
    stored = StoredResponses(config, pools["decode"], ResponseOwners(shared=state), metrics, base_headers)
    metrics.register(stored.collect)
    gate = EntryGate(config, admission, tenants, metrics, recent,
                     access_log.AccessLog(config.log_format, trusted_proxies=config.trusted_proxies)
                     if access_log.enabled(config) else None, pools["decode"].served.directory)
    tracer = tracing.from_environment()
    homes = shared_homes(state, pools)  # where other replicas sent turns (cache-aware with a shared store)
    if homes is not None:
        metrics.register(homes.collect)
    pipeline = Pipeline(config, pools, metrics, known=known, fanout=fanout, connector=connector,
                        decode_only=decode_only, admission=admission, role_caps=role_caps, gate=gate, reuse=reuse,
                        answers=Answers(reuse), stored=stored, media_policy=MediaPolicy.of(config.media),
                        deadlines=Deadlines(t.first_byte) if t.first_byte > 0 else None, tenants=tenants,
                        base_headers=base_headers, recent=recent, tracing=tracer, adapters=adapters, kv=kv,
                        homes=homes)
    membership.subscribe(_forget_departed(connector))
    membership.subscribe(_drop_held(reuse))
    membership.subscribe(kv_events.changed)  # an instance that joins is subscribed, one that leaves dropped
    metrics.register(lambda f: kv_events.collect(f, str(worker)))
    metrics.register(kv.collect)
    admin = AdminApi(membership, AccessPolicy.from_config(config), base_headers, adapters)
    forwarder = Forwarder(config, pools, metrics, gate, tenants, base_headers)
    # With a shared store, each process publishes a summary of itself for every console (the
    # gateway), through a guard of its own: its failures never open the request path's breaker.
    board = None if state is None else GatewayBoard(
        GuardedStore(state.store, config.state_store_prefix, config.state_store_timeout, state.url, owns=False),
        metrics, membership, worker=None if siblings is None else siblings.index,
        workers=1 if siblings is None else siblings.count)
    console = ConsoleApi(config, pools=pools, membership=membership, recent=recent, admin=admin,
                         siblings=siblings, kv_events=kv_events, reuse=reuse, state=state, tenants=tenants,
                         board=board)
    return ProxyApp(config, pools=pools, membership=membership, metrics=metrics, pipeline=pipeline, admin=admin,
                    scrapers=scrapers, client_keys=ClientKeys.from_config(config), base_headers=base_headers,
                    forwarder=forwarder, gate=gate, stored=stored, reuse=reuse, tenants=tenants, state=state,
                    connector=connector, tracing=tracer, admission=admission,
                    siblings=siblings, console=console, kv_events=kv_events)


def build_pools(config: ProxyConfig) -> dict[str, InstancePool]:
    """Every role's pool, possibly empty: instances may register at run time."""
    pools = {}
    models = ModelDirectory()  # one catalog over every pool's instances
    headers = upstream_headers(config)  # a /v1/models read's
    for role in ROLES:
        specs = _with_ec_consumers(config) if role == "decode" else getattr(config, role)
        policy = make_policy(config.policy_for(role), balance_abs=config.balance_abs, balance_rel=config.balance_rel)
        affinity = AdapterAffinity(config.balance_abs, config.balance_rel) if config.lora_affinity else None
        pools[role] = InstancePool(role, specs, policy=policy, keep_alive=config.upstream_keep_alive,
                                   outlier=OutlierSettings.from_config(config),
                                   max_connections=config.max_upstream_connections, models=models,
                                   headers=headers, affinity=affinity)
    return pools


def upstream_headers(config: ProxyConfig) -> Headers:
    """The headers every call to an instance carries (``--upstream-api-key``)."""
    if config.upstream_api_key:
        return [(b"authorization", b"Bearer " + config.upstream_api_key.encode())]
    return []


def _reload_tenants(tenants: Tenants, admission: Admission):
    """A reloaded file's tenants' tables, and the admission slots kept for the top class."""
    def apply(config) -> None:
        tenants.apply_config(config)
        table = tenants.table
        admission.reserve_for(table.top_rank, table.reserved_slots)
    return apply


def _forget_departed(connector):
    """A connector keeps per-instance state (Mooncake's engines): forgotten when the instance
    joins anew or leaves."""
    def changed(change) -> None:
        if change.event in ("registered", "removed", "forgotten"):
            connector.forget(change.spec.url)
    return changed


def _drop_held(reuse: TurnReuse):
    """Parameters kept for a decode that left (or joined anew: a new engine) name blocks
    nobody can read, and what it said of keeping blocks may no longer hold."""
    def changed(change) -> None:
        if change.spec.role == "decode" and change.event in ("registered", "removed", "forgotten"):
            reuse.forget(change.spec.url)
    return changed


def _with_ec_consumers(config: ProxyConfig) -> list:
    """The decode specs with their EC consumer addresses (``--ec-consumer-zmq-addrs``,
    aligned with them, ``--ec-consumer-dp-size`` each), so every decode instance
    carries its own, as a registered one does."""
    addrs, dp = config.ec_consumer_zmq_addrs, config.ec_consumer_dp_size
    if not addrs:
        return list(config.decode)
    return [dataclasses.replace(spec, ec_zmq_addrs=tuple(addrs[i * dp:(i + 1) * dp]), dp_size=dp)
            for i, spec in enumerate(config.decode)]


def front_door_collector(server: HttpServer) -> Collector:
    """The client connections and what the server refused before any handler ran."""
    def collect(f: dict[str, list]) -> None:
        f["epd_proxy_client_connections"] = [[len(server.connections)]]
        f["epd_proxy_client_connections_refused"] = [[server.refused]]
        f["epd_proxy_client_connections_reclaimed"] = [[server.reclaimed]]
        f["epd_proxy_buffered_body_bytes"] = [[server.budget.used]]
        rejections = dict.fromkeys(_REJECTIONS, 0)  # each known status from the start
        rejections.update(server.rejections)
        f["epd_proxy_client_rejections"] = [[str(s), n] for s, n in rejections.items()]
    return collect


# What the HTTP server refuses before any handler runs (the family's help lists them).
_REJECTIONS = (400, 408, 413, 431, 503)


async def start_proxy(config: ProxyConfig, host: str = "127.0.0.1", port: int = 0, *,
                      backlog: int = 4096, reuse_port: bool = False, link: PeerLink | None = None,
                      siblings: SiblingChannel | None = None, reloads: bool = False, settings=None,
                      watch: bool = True, surface=None, adapt=None) -> RunningProxy:
    """Build and start a proxy listening on ``host:port``. A ``serve`` process adds its
    ``--workers`` ``link`` (the shared roster) and ``siblings``, and ``reloads`` (SIGHUP, and
    with ``watch`` a changed cluster file; ``settings``: serve_command.ServeSettings).
    ``surface`` wraps the handler (the endpoint picker's port: ``gateway/surface.py``);
    ``adapt(app)`` is called before the app starts (the sidecar's steering: ``runtime/sidecar.py``)."""
    tls = tls_context(config)
    app = build_app(config, worker=siblings.index if siblings is not None else 0, siblings=siblings, link=link)
    if adapt is not None:
        adapt(app)
    await app.start()
    # The bound method, not the app: called through vectorcall, not the type's __call__ slot (every request).
    handler = log_requests(app) if config.log_requests else app.__call__
    if surface is not None:
        handler = surface(handler)
    try:
        server = await HttpServer(handler, error_body=front_door_error_body, limits=server_limits(config),
                                  on_large_release=trim_heap).start(host, port, backlog=backlog,
                                                                    reuse_port=reuse_port, ssl=tls)
    except OSError as exc:
        await app.close()
        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        if exc.errno == errno.EADDRINUSE:
            reason += " (another process listens there; choose another --port)"
        raise ListenError(f"cannot listen on {listen_url(host, port, tls=tls is not None)}: {reason}") from None
    except BaseException:
        await app.close()
        raise
    app.metrics.register(front_door_collector(server))
    sources = RosterSources(app.membership, shared=SharedRoster(app.membership, link) if link is not None else None,
                            dns_interval=config.dns_interval, dns_server=config.dns_server,
                            register=app.metrics.register)
    sources.follow_dns(config.discover)
    app.reuse.start()  # after the channel to the parent is read (SharedRoster)
    if app.console is not None and app.console.board is not None:  # its store calls too
        app.console.board.start(f"{server.host}:{server.port}")
    reloader = None
    if reloads:
        reloader = Reloader(settings, sources.apply_config, args=settings.started if settings is not None else None,
                            watch=watch)
        reloader.start()
        if config.api_key_file:
            reloader.on_reload(app.reload)  # the client key file (client_auth.py)
        reloader.on_config(_reload_tenants(app.tenants, app.admission))  # the [tenants] and [model_aliases] tables
        app.metrics.register(reloader.collect)
    if siblings is not None:
        siblings.parent = link  # counters kept, the supervisor's view (workers.py)
        await siblings.start(app.answer_sibling)
        if link is not None:
            link.serving()
    return RunningProxy(app, server, sources, reloader=reloader)


def build_picker(app: ProxyApp, endpoints: int = DEFAULT_FALLBACKS) -> EndpointPicker:
    """The endpoint picker over the objects ``build_app`` made for the proxy (pools, tenants,
    admission, the block index, client keys, adapters, metrics): one wiring for both."""
    pipeline = app.pipeline
    picker = EndpointPicker(app.config, app.pools, app.metrics, tenants=pipeline.tenants,
                            admission=pipeline.admission, gate=pipeline.gate, kv=pipeline.kv,
                            client_keys=app.client_keys, adapters=pipeline.adapters, placement=pipeline.known,
                            endpoints=endpoints)
    app.metrics.register(picker.collect)
    return picker


async def start_epp(config: ProxyConfig, host: str = "127.0.0.1", port: int = 0, *, grpc_host: str = "127.0.0.1",
                    grpc_port: int = 0, endpoints: int = DEFAULT_FALLBACKS, settings=None,
                    watch: bool = True) -> RunningEpp:
    """``epd-proxy epp``: the proxy's runtime (membership, probes, load scraping, KV events,
    tenants, the state store, reloads) with the operator's HTTP surface on ``host:port`` and the
    endpoint picker's gRPC service on ``grpc_host:grpc_port``."""
    from epd_proxy.gateway.grpc_server import GrpcListener  # the optional gateway extra's protos
    from epd_proxy.gateway.surface import operator_surface

    proxy = await start_proxy(config, host, port, reloads=True, settings=settings, watch=watch,
                              surface=operator_surface)
    listener = GrpcListener(build_picker(proxy.app, endpoints), proxy.app.ready_locally)
    try:
        await listener.start(grpc_host, grpc_port)
    except BaseException:
        await proxy.close()
        raise
    return RunningEpp(proxy, listener)


def apply_config(proxy: RunningProxy, config: ProxyConfig) -> None:
    """A reloaded cluster file's instances into the roster, as one diff, and its DNS names
    into discovery (``RosterSources.apply_config``)."""
    proxy.sources.apply_config(config)


def tls_context(config: ProxyConfig) -> ssl.SSLContext | None:
    """The listener's TLS context (``--ssl-certfile``/``--ssl-keyfile``), built once; None for plain HTTP."""
    if not config.ssl_certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot load {config.ssl_certfile}"
                         f"{' / ' + config.ssl_keyfile if config.ssl_keyfile else ''}: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    return ctx


# Descriptors kept for what is not a client or upstream connection: the listening
# socket, logs, probes, the event loop's own.
_RESERVED_FDS = 64


def connection_cap(fd_limit: int) -> int:
    """The default client-connection cap for a descriptor limit: a third of what is
    left after the reserve, so every client connection can have two upstream legs
    (prefill and decode) open at once without running out of descriptors."""
    return max(16, (fd_limit - _RESERVED_FDS) // 3)


def fd_limit() -> int:
    """This process's soft RLIMIT_NOFILE (0 if unknown or unlimited)."""
    if resource is None:  # pragma: no cover
        return 0
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 0 if soft == resource.RLIM_INFINITY else soft


def server_limits(config: ProxyConfig) -> ServerLimits:
    """The client-facing limits of a config; the connection cap, unless set, from the
    descriptor limit in force now."""
    cap = config.max_connections
    if not cap:
        limit = fd_limit()
        cap = connection_cap(limit) if limit else 0
    return ServerLimits(max_body_bytes=config.max_body_size, max_buffered_bytes=config.max_buffered_bytes,
                        max_connections=cap, header_timeout=config.header_timeout,
                        body_timeout=config.body_timeout)
