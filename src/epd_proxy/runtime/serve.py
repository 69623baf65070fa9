"""Running the proxy: one event loop per process (event_loop.py), optionally several processes.

With ``workers > 1`` each worker process binds the same port with
``SO_REUSEPORT`` and the kernel spreads connections over them. Each worker
has its own pools, cursors and metrics; the roster is shared and the parent
supervises (workers.py). SIGHUP reloads (reload.py). ``/metrics``, ``/status`` and
``/ready`` answer for all the workers (siblings.py).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import shutil
import signal
import ssl
import sys
import tempfile

try:
    import resource
except ImportError:  # pragma: no cover - not POSIX
    resource = None  # type: ignore[assignment]

from epd_proxy.api.app import ProxyApp, log_requests
from epd_proxy.api.siblings import SiblingChannel
from epd_proxy.config import InstanceSpec, ProxyConfig
from epd_proxy.http import event_loop
from epd_proxy.http.heap import trim_heap
from epd_proxy.http.limits import ServerLimits
from epd_proxy.http.server import HttpServer
from epd_proxy.instances.discovery import DnsDiscovery
from epd_proxy.instances.shared import SharedRoster
from epd_proxy.runtime.reload import Reloader
from epd_proxy.runtime.workers import Carry, PeerLink, supervise
from epd_proxy.wire.errors import error_body

log = logging.getLogger("epd_proxy")


class RunningProxy:
    """A started proxy (app + listening server), for tests and embedding."""

    def __init__(self, app: ProxyApp, server: HttpServer, discovery: DnsDiscovery | None = None) -> None:
        self.app = app
        self.server = server
        self.discovery = discovery  # following the config's dns+ instances, if any
        self.shared: SharedRoster | None = None  # --workers: the roster shared with the other workers
        self.reloader: Reloader | None = None  # SIGHUP (serve's processes only)

    def apply_roster(self, specs: list[InstanceSpec], source: str):
        """``Membership.apply`` for changes every worker makes by itself (reload, DNS)."""
        if self.shared is None:
            return self.app.membership.apply(specs, source=source)
        with self.shared.local():
            return self.app.membership.apply(specs, source=source)

    @property
    def url(self) -> str:
        return listen_url(self.server.host, self.server.port, tls=self.server.tls)

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()
        await self.server.close()
        await self.app.close()

    async def shutdown(self, grace: float, timeout: float) -> None:
        """Graceful shutdown (call :meth:`close` after it).

        ``/ready`` turns 503 at once and every response closes its connection; the
        listener keeps accepting for ``grace`` seconds (a load balancer needs that long to
        notice); then it closes, so do idle connections, new requests on open ones get 503,
        and in-flight ones may finish until ``timeout`` seconds after the call. What is left
        is ended as well as it can be: 503 before the commit point, an in-band error and
        ``[DONE]`` on a committed stream.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        app, server = self.app, self.server
        app.shutting_down = True
        server.end_keep_alive()
        log.info("shutting down: /ready is 503; new connections accepted for %.1f s", grace)
        await asyncio.sleep(max(0.0, min(grace, timeout)))
        server.stop_accepting()
        server.close_idle()
        app.pipeline.close_admission()
        busy = server.busy()
        log.info("listener closed; %d request(s) in flight, up to %.1f s to finish", len(busy),
                 max(0.0, end - loop.time()))

        def finished() -> bool:
            server.close_idle()  # e.g. a connection whose request was answered in the meantime
            return not server.busy()

        await _wait_until(finished, end)
        busy = server.busy()
        if busy:
            log.warning("shutdown timeout: ending %d request(s) still in flight", len(busy))
            app.pipeline.stopping = True
            for task in busy:
                task.cancel()
            await asyncio.wait(busy, timeout=2.0)

    async def __aenter__(self) -> "RunningProxy":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def listen_url(host: str, port: int, *, tls: bool = False) -> str:
    """The URL of a listening address; an IPv6 address goes in brackets (RFC 3986)."""
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


class ListenError(Exception):
    """The listener could not be opened (the port is in use, the address is not local, ...): one
    line for the operator, not a traceback."""


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


async def start_proxy(config: ProxyConfig, host: str = "127.0.0.1", port: int = 0, *,
                      backlog: int = 4096, reuse_port: bool = False) -> RunningProxy:
    tls = tls_context(config)
    app = ProxyApp(config)
    await app.start()
    handler = log_requests(app) if config.log_requests else app
    try:
        server = await HttpServer(handler, error_body=error_body, limits=server_limits(config),
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
    app.metrics.front_door = server
    proxy = RunningProxy(app, server)
    if config.discover:
        proxy.discovery = DnsDiscovery(proxy.apply_roster, interval=config.dns_interval, server=config.dns_server)
        proxy.discovery.set_targets(config.discover)
        app.metrics.discovery = proxy.discovery
    return proxy


def apply_config(proxy: RunningProxy, config: ProxyConfig) -> None:
    """A reloaded cluster file's instances into the roster, as one diff (requests in
    flight on an instance that leaves finish), and its DNS names into discovery."""
    proxy.apply_roster([*config.encode, *config.prefill, *config.decode], source="static")
    if config.discover and proxy.discovery is None:
        proxy.discovery = DnsDiscovery(proxy.apply_roster, interval=config.dns_interval, server=config.dns_server)
        proxy.app.metrics.discovery = proxy.discovery
    if proxy.discovery is not None:
        proxy.discovery.set_targets(config.discover)


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


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit, as servers commonly do at
    start-up (the soft default, often 1,024, is what a few hundred idle clients
    exhaust). Returns the soft limit in force afterwards."""
    if resource is None:  # pragma: no cover
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:  # e.g. an infinite hard limit the kernel caps
            log.warning("could not raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return fd_limit()


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


async def _wait_until(done, deadline: float, interval: float = 0.05) -> None:
    """Poll ``done()`` until it holds or the loop's clock passes ``deadline`` (shutdown only)."""
    loop = asyncio.get_running_loop()
    while not done() and loop.time() < deadline:
        await asyncio.sleep(min(interval, max(0.0, deadline - loop.time())))


def config_for_cluster(cluster, config: ProxyConfig | None = None) -> ProxyConfig:
    """The proxy configuration for a simulated cluster: its instances, with each
    prefill's identity (for push connectors), and its KV connector."""
    encode = [InstanceSpec(u, "encode") for u in cluster.urls("encode")]
    prefill = [InstanceSpec(i["url"], "prefill", engine_id=i["engine_id"], kv_host=i["kv_host"],
                            kv_port=i["kv_port"], tp=i["tp"], pp=i["pp"], bootstrap_port=i.get("bootstrap_port"))
               for i in cluster.prefill_identities()]
    decode = [InstanceSpec(u, "decode") for u in cluster.urls("decode") + cluster.urls("pd")]
    base = config or ProxyConfig()
    return base.replace(encode=encode, prefill=prefill, decode=decode, kv_connector=cluster.config.kv_connector)


async def _serve_forever(config: ProxyConfig, host: str, port: int, *, reuse_port: bool,
                         simulate: str | None, announce: bool, worker: bool = False, settings=None,
                         link: PeerLink | None = None, watch: bool = True,
                         siblings: SiblingChannel | None = None) -> None:
    """Serve until a signal, then shut down gracefully; SIGHUP reloads (reload.py).

    Alone, SIGTERM or SIGINT starts the graceful shutdown and a second one exits at once.
    As a ``--workers`` worker, SIGTERM starts it (again and again: a service manager that
    signals the whole group must not count twice) and SIGQUIT, which the parent sends on
    a second signal, exits at once.
    """
    cluster = None
    if simulate:
        from epd_proxy.sim import SimCluster

        cluster = SimCluster.from_spec(simulate)
        await cluster.start()
        config = config_for_cluster(cluster, config)
    try:
        proxy = await start_proxy(config, host, port, reuse_port=reuse_port)
    except BaseException:
        if cluster is not None:
            await cluster.stop()
        raise
    if link is not None:
        proxy.shared = SharedRoster(proxy.app.membership, link)
    reloader = Reloader(settings, lambda cfg: apply_config(proxy, cfg),
                        args=settings.started if settings is not None else None, watch=watch)
    reloader.start()
    proxy.reloader = reloader  # other reloadable things: proxy.reloader.on_reload(hook)
    if config.api_key_file:
        reloader.on_reload(proxy.app.reload)  # the client key file (client_auth.py)
    proxy.app.metrics.reloader = reloader
    if _EARLY_SIGHUP:  # a reload asked for while this worker was starting
        _EARLY_SIGHUP.clear()
        reloader.request()
    if siblings is not None:
        siblings.parent = link  # counters kept, the supervisor's view (workers.py)
        await siblings.start(proxy.app.answer_sibling)
        proxy.app.siblings = siblings
        proxy.app.metrics.worker = siblings.index
        if link is not None:
            link.serving()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGQUIT or (stop.is_set() and not worker):
            log.warning("%s: exiting at once", name)
            os._exit(1)
        if not stop.is_set():
            log.info("%s: shutting down gracefully (a second signal exits at once)", name)
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGQUIT) if worker else (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError):  # pragma: no cover
            pass
    if announce:
        _announce(proxy, cluster)
    try:
        await stop.wait()
        await proxy.shutdown(config.shutdown_grace, config.shutdown_timeout)
    finally:
        if siblings is not None:
            await siblings.close()
        await reloader.close()
        if link is not None:
            link.close()
        await proxy.close()
        if cluster is not None:
            await cluster.stop()


def _announce(proxy: RunningProxy, cluster) -> None:
    app = proxy.app
    topology = app.topology + (" pinned" if app.config.topology != "auto" else "")
    if app.topology == "none":
        topology = ("no instances yet: resolving DNS names" if app.config.discover
                    else "no instances yet: waiting for registrations (POST /instances)")
    lines = [f"epd-proxy listening on {proxy.url} ({topology}"
             + (f", kv-connector {app.config.kv_connector})" if app.pools["prefill"] else ")")]
    for role, pool in app.pools.items():
        if pool.instances:
            lines.append(f"  {role:7s} " + ", ".join(i.url for i in pool.instances))
    for spec in app.config.discover:
        lines.append(f"  {spec.role:7s} dns+{spec.url} (every address it resolves to)")
    if app.admin.access.registration_on:
        lines.append("  registration: on (POST /instances)")
    if cluster is not None:
        lines.append("  (simulated vLLM instances in this process)")
        lines.append("")
        lines.append("Try:")
        lines.append(f"  curl -sN {proxy.url}/v1/chat/completions -H 'Content-Type: application/json' \\")
        lines.append("    -d '{\"model\": \"sim-model\", \"stream\": true, \"max_tokens\": 16, \"messages\": "
                     "[{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"What is in this "
                     "image?\"}, {\"type\": \"image_url\", \"image_url\": {\"url\": "
                     "\"https://example.com/cat.png\"}}]}]}'")
    print("\n".join(lines), flush=True)


def tune_gc() -> None:
    """Move start-up objects out of the collector's sight and collect the young
    generation less often: per-request garbage is short-lived and acyclic, and
    full collections over long-lived state showed up as latency tails."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


_EARLY_SIGHUP: list[int] = []


def _early_sighup(signum, _frame) -> None:
    _EARLY_SIGHUP.append(signum)


def serve(config: ProxyConfig, host: str, port: int, *, workers: int = 1, simulate: str | None = None,
          settings=None) -> int:
    """Run until SIGINT/SIGTERM; SIGHUP reloads. ``settings`` (serve_command.ServeSettings) is
    where a reload re-reads the cluster file. Returns the exit status."""
    tune_gc()
    raise_fd_limit()
    if workers <= 1:
        signal.signal(signal.SIGHUP, _early_sighup)  # until the loop handles it (a reload)
        try:
            event_loop.run(_serve_forever(config, host, port, reuse_port=False, simulate=simulate, announce=True,
                                       settings=settings))
        except ListenError as exc:
            print(f"epd-proxy: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0
    if simulate:
        raise ValueError("--workers > 1 cannot be combined with --simulate")
    signal.signal(signal.SIGHUP, _early_sighup)  # a reload asked for before the parent supervises
    # Where the workers' sockets for each other live (siblings.py); removed when they are gone.
    channel_dir = tempfile.mkdtemp(prefix="epd-proxy-workers-")

    def run_worker(index: int, channel, carry: Carry) -> None:
        """A worker process's life (forked by ``supervise``): never returns."""
        # The parent turns SIGINT and SIGTERM into a SIGTERM for each worker, and a second
        # one into SIGQUIT (a Ctrl-C reaches the whole process group: ignored here).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, _early_sighup)  # until its loop handles it (a reload)
        _EARLY_SIGHUP.clear()  # the parent's, if any, is the parent's to pass on
        if carry.replacement and settings is not None:
            _EARLY_SIGHUP.append(signal.SIGHUP)  # the cluster file as it is now, not as it was at start
        code = 1
        try:
            event_loop.run(_serve_forever(config, host, port, reuse_port=True, simulate=None,
                                          announce=index == 0 and not carry.replacement, worker=True,
                                          settings=settings, link=PeerLink(channel, carry.roster), watch=False,
                                          siblings=SiblingChannel(channel_dir, index, workers,
                                                                  carried=carry.counters)))
            code = 0
        except ListenError as exc:
            if index == 0:  # every worker fails alike: one line is enough
                print(f"epd-proxy: {exc}", file=sys.stderr, flush=True)
        except BaseException:
            log.exception("worker %d failed", index)  # said here: os._exit skips the interpreter's report
        finally:
            os._exit(code)

    try:
        return supervise(workers, run_worker, settings.path if settings is not None else None,
                         reload_now=bool(_EARLY_SIGHUP))
    finally:
        shutil.rmtree(channel_dir, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m epd_proxy serve ...")
