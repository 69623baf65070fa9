"""Running the proxy: one event loop per process, optionally several processes.

With ``workers > 1`` each worker process binds the same port with
``SO_REUSEPORT`` and the kernel spreads connections over them. Each worker
has its own pools, cursors and metrics (documented in docs/architecture.md);
``/metrics``, ``/status`` and ``/ready`` answer for all of them (``siblings.py``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile

try:
    import resource
except ImportError:  # pragma: no cover - not POSIX
    resource = None

from .app import ProxyApp
from .config import InstanceSpec, ProxyConfig
from .http.heap import trim_heap
from .http.server import HttpServer, ServerLimits
from .siblings import SiblingChannel

log = logging.getLogger("epd_proxy")


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


class RunningProxy:
    """A started proxy (app + listening server), for tests and embedding."""

    def __init__(self, app: ProxyApp, server: HttpServer) -> None:
        self.app = app
        self.server = server

    @property
    def url(self) -> str:
        return f"http://{self.server.host}:{self.server.port}"

    async def close(self) -> None:
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
        app.draining = True
        server.drain()
        log.info("draining: /ready is 503; new connections accepted for %.1f s", grace)
        await asyncio.sleep(max(0.0, min(grace, timeout)))
        server.stop_accepting()
        server.close_idle()
        app.pipeline.close_admission()
        busy = server.busy()
        log.info("listener closed; %d request(s) in flight, up to %.1f s to finish", len(busy),
                 max(0.0, end - loop.time()))

        def drained() -> bool:
            server.close_idle()  # e.g. a connection whose request was answered in the meantime
            return not server.busy()

        await _wait_until(drained, end)
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


async def start_proxy(config: ProxyConfig, host: str = "127.0.0.1", port: int = 0, *,
                      backlog: int = 4096, reuse_port: bool = False) -> RunningProxy:
    app = ProxyApp(config)
    await app.start()
    server = await HttpServer(app, limits=server_limits(config), on_large_release=trim_heap).start(
        host, port, backlog=backlog, reuse_port=reuse_port)
    app.metrics.front_door = server
    return RunningProxy(app, server)


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
                         simulate: str | None, announce: bool, worker: bool = False,
                         siblings: SiblingChannel | None = None) -> None:
    """Serve until a signal, then shut down gracefully.

    Alone, SIGTERM or SIGINT starts the graceful shutdown and a second one exits at once.
    As a ``--workers`` worker, SIGTERM starts it (again and again: a service manager that
    signals the whole group must not count twice) and SIGQUIT, which the parent sends on
    a second signal, exits at once.
    """
    cluster = None
    if simulate:
        from .sim import SimCluster

        cluster = SimCluster.from_spec(simulate)
        await cluster.start()
        config = config_for_cluster(cluster, config)
    proxy = await start_proxy(config, host, port, reuse_port=reuse_port)
    if siblings is not None:
        await siblings.start(proxy.app.answer_sibling)
        proxy.app.siblings = siblings
        proxy.app.metrics.worker = siblings.index
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
        await proxy.close()
        if cluster is not None:
            await cluster.stop()


def _announce(proxy: RunningProxy, cluster) -> None:
    app = proxy.app
    lines = [f"epd-proxy listening on {proxy.url} ({app.topology}"
             + (f", kv-connector {app.config.kv_connector})" if "prefill" in app.pools else ")")]
    for role, pool in app.pools.items():
        lines.append(f"  {role:7s} " + ", ".join(i.url for i in pool.instances))
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


def serve(config: ProxyConfig, host: str, port: int, *, workers: int = 1, simulate: str | None = None) -> int:
    """Run until SIGINT/SIGTERM. Returns the exit status."""
    tune_gc()
    raise_fd_limit()
    if workers <= 1:
        install_uvloop()
        asyncio.run(_serve_forever(config, host, port, reuse_port=False, simulate=simulate, announce=True))
        return 0
    if simulate:
        raise ValueError("--workers > 1 cannot be combined with --simulate")
    children: list[int] = []
    # Where the workers' sockets for each other live (siblings.py); removed when they are gone.
    channel_dir = tempfile.mkdtemp(prefix="epd-proxy-workers-")
    for index in range(workers):
        pid = os.fork()
        if pid == 0:  # worker
            # The parent turns SIGINT and SIGTERM into a SIGTERM for each worker, and a second
            # one into SIGQUIT (a Ctrl-C reaches the whole process group: ignored here).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            install_uvloop()
            code = 1
            try:
                asyncio.run(_serve_forever(config, host, port, reuse_port=True, simulate=None,
                                           announce=index == 0, worker=True,
                                           siblings=SiblingChannel(channel_dir, index, workers)))
                code = 0
            except BaseException:
                log.exception("worker %d failed", index)  # said here: os._exit skips the interpreter's report
            finally:
                os._exit(code)
        children.append(pid)
    log.info("started %d workers: %s", workers, children)

    received = []

    def forward(signum, _frame):
        received.append(signum)
        for child in children:
            try:
                os.kill(child, signal.SIGTERM if len(received) == 1 else signal.SIGQUIT)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    status = 0
    for child in children:
        while True:
            try:
                _, code = os.waitpid(child, 0)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                code = 0
                break
        if code:
            status = 1
    shutil.rmtree(channel_dir, ignore_errors=True)
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m epd_proxy serve ...")
