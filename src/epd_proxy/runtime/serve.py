"""Running the proxy: one event loop per process (event_loop.py), optionally several processes.

With ``workers > 1`` each worker process binds the same port with
``SO_REUSEPORT`` and the kernel spreads connections over them. Each worker
has its own pools, cursors and metrics (built by build.py); the roster is shared
and the parent supervises (workers.py). SIGHUP reloads (reload.py). ``/metrics``,
``/status`` and ``/ready`` answer for all the workers (siblings.py).
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
    resource = None  # type: ignore[assignment]

from epd_proxy.api.siblings import SiblingChannel
from epd_proxy.config import ProxyConfig
from epd_proxy.http import event_loop

# The wiring's names, also importable from here as before.
from epd_proxy.runtime.build import (  # noqa: F401
    apply_config,
    connection_cap,
    fd_limit,
    server_limits,
    start_epp,
    start_proxy,
    tls_context,
)
from epd_proxy.runtime.running import ListenError, RunningProxy, listen_url, stop_on_signals  # noqa: F401
from epd_proxy.runtime.simulated import SimulatorProcess, addresses_of, config_for_addresses
from epd_proxy.runtime.workers import Carry, PeerLink, supervise

log = logging.getLogger("epd_proxy")


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


def config_for_cluster(cluster, config: ProxyConfig | None = None) -> ProxyConfig:
    """The proxy configuration for a simulated cluster: its instances, with each
    prefill's identity (for push connectors), and its KV connector."""
    return config_for_addresses(addresses_of(cluster), config)


async def _serve_forever(config: ProxyConfig, host: str, port: int, *, reuse_port: bool,
                         simulate: str | None, announce: bool, worker: bool = False, settings=None,
                         link: PeerLink | None = None, watch: bool = True,
                         siblings: SiblingChannel | None = None, simulated: str | None = None,
                         sim_addresses: dict | None = None) -> None:
    """Serve until a signal, then shut down gracefully; SIGHUP reloads (reload.py).

    Alone, SIGTERM or SIGINT starts the graceful shutdown and a second one exits at once.
    As a ``--workers`` worker, SIGTERM starts it (again and again: a service manager that
    signals the whole group must not count twice) and SIGQUIT, which the parent sends on
    a second signal, exits at once. ``simulated``: where the simulated instances run when
    another process runs them (``--workers``), for the announcement, and ``sim_addresses``
    their addresses, which every reload keeps as the roster.
    """
    cluster = None
    if simulate:
        from epd_proxy.sim import SimCluster

        cluster = SimCluster.from_spec(simulate)
        await cluster.start()
        sim_addresses = addresses_of(cluster)
        config = config_for_addresses(sim_addresses, config)
    try:
        proxy = await start_proxy(config, host, port, reuse_port=reuse_port, link=link, siblings=siblings,
                                  reloads=True, settings=settings, watch=watch)
    except BaseException:
        if cluster is not None:
            await cluster.stop()
        raise
    reloader = proxy.reloader  # other reloadable things: proxy.reloader.on_reload(hook)
    assert reloader is not None
    reloader.simulated = sim_addresses  # a reload keeps the simulated instances
    if _EARLY_SIGHUP:  # a reload asked for while this worker was starting
        _EARLY_SIGHUP.clear()
        reloader.request()
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
        _announce(proxy, "in this process" if cluster is not None else simulated)
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


def _announce(proxy: RunningProxy, simulated: str | None) -> None:
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
    lines.append(f"  console: open {proxy.url}/console in a browser"
                 + (" (the admin API key unlocks it)" if app.config.admin_api_key
                    else " (needs --admin-api-key: client keys are set)" if app.client_keys is not None else ""))
    if simulated is not None:
        lines.append(f"  (simulated vLLM instances {simulated})")
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
    simulator = None
    if simulate:  # one cluster for every worker, started before any fork (simulated.py)
        try:
            simulator = SimulatorProcess.start(simulate)
        except ValueError as exc:
            print(f"epd-proxy: {exc}", file=sys.stderr, flush=True)
            return 1
        config = config_for_addresses(simulator.addresses, config)
    simulated = None if simulator is None else f"in process {simulator.pid}"
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
                                                                  carried=carry.counters), simulated=simulated,
                                          sim_addresses=simulator.addresses if simulator is not None else None))
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
        if simulator is not None:  # after every worker: their requests in flight end first
            simulator.stop()


def serve_epp(config: ProxyConfig, host: str, port: int, *, grpc_host: str, grpc_port: int, endpoints: int,
              settings=None) -> int:
    """``epd-proxy epp`` until SIGINT/SIGTERM (a second one exits at once); SIGHUP reloads.
    One process: replicas, not workers, scale it (they share the state store)."""
    tune_gc()
    raise_fd_limit()
    signal.signal(signal.SIGHUP, _early_sighup)
    try:
        event_loop.run(_epp_forever(config, host, port, grpc_host, grpc_port, endpoints, settings))
    except (ListenError, OSError) as exc:
        print(f"epd-proxy epp: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _epp_forever(config: ProxyConfig, host: str, port: int, grpc_host: str, grpc_port: int, endpoints: int,
                       settings) -> None:
    epp = await start_epp(config, host, port, grpc_host=grpc_host, grpc_port=grpc_port, endpoints=endpoints,
                          settings=settings)
    reloader = epp.proxy.reloader
    if _EARLY_SIGHUP and reloader is not None:
        _EARLY_SIGHUP.clear()
        reloader.request()
    stop = stop_on_signals(log)
    print(f"epd-proxy epp: gRPC (ext_proc) on {grpc_host}:{epp.grpc_port}, "
          f"operator surface on {epp.proxy.url} ({len(epp.app.pools['decode'].instances)} serving instances)",
          flush=True)
    try:
        await stop.wait()
        await epp.shutdown(config.shutdown_grace, config.shutdown_timeout)
    finally:
        if reloader is not None:
            await reloader.close()
        await epp.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m epd_proxy serve ...")
