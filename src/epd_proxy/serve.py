"""Running the proxy: one event loop per process, optionally several processes.

With ``workers > 1`` each worker process binds the same port with
``SO_REUSEPORT`` and the kernel spreads connections over them. Each worker
has its own pools, cursors and metrics (documented in docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys

from .app import ProxyApp, log_requests
from .config import InstanceSpec, ProxyConfig
from .http.server import HttpServer

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

    async def __aenter__(self) -> "RunningProxy":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def start_proxy(config: ProxyConfig, host: str = "127.0.0.1", port: int = 0, *,
                      backlog: int = 4096, reuse_port: bool = False) -> RunningProxy:
    app = ProxyApp(config)
    await app.start()
    handler = log_requests(app) if config.log_requests else app
    server = await HttpServer(handler).start(host, port, backlog=backlog, reuse_port=reuse_port)
    return RunningProxy(app, server)


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
                         simulate: str | None, announce: bool) -> None:
    cluster = None
    if simulate:
        from .sim import SimCluster

        cluster = SimCluster.from_spec(simulate)
        await cluster.start()
        config = config_for_cluster(cluster, config)
    proxy = await start_proxy(config, host, port, reuse_port=reuse_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover
            pass
    if announce:
        _announce(proxy, cluster)
    try:
        await stop.wait()
    finally:
        await proxy.close()
        if cluster is not None:
            await cluster.stop()


def _announce(proxy: RunningProxy, cluster) -> None:
    app = proxy.app
    topology = app.topology + (" pinned" if app.config.topology != "auto" else "")
    if app.topology == "none":
        topology = "no instances yet: waiting for registrations (POST /instances)"
    lines = [f"epd-proxy listening on {proxy.url} ({topology}"
             + (f", kv-connector {app.config.kv_connector})" if app.pools["prefill"] else ")")]
    for role, pool in app.pools.items():
        if pool.instances:
            lines.append(f"  {role:7s} " + ", ".join(i.url for i in pool.instances))
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


def serve(config: ProxyConfig, host: str, port: int, *, workers: int = 1, simulate: str | None = None) -> int:
    """Run until SIGINT/SIGTERM. Returns the exit status."""
    tune_gc()
    if workers <= 1:
        install_uvloop()
        asyncio.run(_serve_forever(config, host, port, reuse_port=False, simulate=simulate, announce=True))
        return 0
    if simulate:
        raise ValueError("--workers > 1 cannot be combined with --simulate")
    children: list[int] = []
    for index in range(workers):
        pid = os.fork()
        if pid == 0:  # worker
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            install_uvloop()
            try:
                asyncio.run(_serve_forever(config, host, port, reuse_port=True, simulate=None,
                                           announce=index == 0))
            finally:
                os._exit(0)
        children.append(pid)
    log.info("started %d workers: %s", workers, children)

    def forward(signum, _frame):
        for child in children:
            try:
                os.kill(child, signal.SIGTERM)
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
    return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m epd_proxy serve ...")
