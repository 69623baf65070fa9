"""A started proxy: what ``start_proxy`` (``build.py``) returns, and its graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import TYPE_CHECKING

from epd_proxy.api.app import ProxyApp
from epd_proxy.config import InstanceSpec
from epd_proxy.http.server import HttpServer
from epd_proxy.instances.discovery import DnsDiscovery
from epd_proxy.instances.shared import SharedRoster
from epd_proxy.instances.sources import RosterSources
from epd_proxy.runtime.reload import Reloader

if TYPE_CHECKING:
    from epd_proxy.gateway.grpc_server import GrpcListener

log = logging.getLogger("epd_proxy")


class RunningProxy:
    """A started proxy (app + listening server), for tests and embedding."""

    def __init__(self, app: ProxyApp, server: HttpServer, sources: RosterSources, *,
                 reloader: Reloader | None = None) -> None:
        self.app = app
        self.server = server
        self.sources = sources  # the cluster file's and DNS names' instances
        self.reloader = reloader  # SIGHUP (serve's processes only)

    @property
    def discovery(self) -> DnsDiscovery | None:
        """Following the config's dns+ instances, if any."""
        return self.sources.discovery

    @property
    def shared(self) -> SharedRoster | None:
        """--workers: the roster shared with the other workers."""
        return self.sources.shared

    def apply_roster(self, specs: list[InstanceSpec], source: str):
        """``Membership.apply`` for changes every worker makes by itself (reload, DNS)."""
        return self.sources.apply_roster(specs, source)

    @property
    def url(self) -> str:
        return listen_url(self.server.host, self.server.port, tls=self.server.tls)

    async def close(self) -> None:
        await self.sources.close()
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
        app.gate.close()
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


class RunningEpp:
    """A started endpoint picker: the proxy's runtime (its HTTP port serving the operator's
    surface) and the gRPC listener (``gateway/grpc_server.py``)."""

    def __init__(self, proxy: RunningProxy, listener: GrpcListener) -> None:
        self.proxy = proxy
        self.listener = listener

    @property
    def app(self) -> ProxyApp:
        return self.proxy.app

    @property
    def grpc_port(self) -> int:
        return self.listener.port

    async def shutdown(self, grace: float, timeout: float) -> None:
        """Not ready at once (gRPC health and ``/ready``), then the proxy's graceful shutdown (the
        gRPC listener still answers meanwhile); the gRPC streams in flight then get what is left
        of ``timeout`` to end."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        await self.listener.shutting_down()
        await self.proxy.shutdown(grace, timeout)
        await self.listener.close(max(0.0, end - loop.time()))

    async def close(self) -> None:
        await self.listener.close()
        await self.proxy.close()


def listen_url(host: str, port: int, *, tls: bool = False) -> str:
    """The URL of a listening address; an IPv6 address goes in brackets (RFC 3986)."""
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"


class ListenError(Exception):
    """The listener could not be opened (the port is in use, the address is not local, ...): one
    line for the operator, not a traceback."""


async def _wait_until(done, deadline: float, interval: float = 0.05) -> None:
    """Poll ``done()`` until it holds or the loop's clock passes ``deadline`` (shutdown only)."""
    loop = asyncio.get_running_loop()
    while not done() and loop.time() < deadline:
        await asyncio.sleep(min(interval, max(0.0, deadline - loop.time())))


def stop_on_signals(logger: logging.Logger) -> asyncio.Event:
    """An event the first SIGINT or SIGTERM sets (a graceful shutdown: the caller drains); a
    second exits at once, for an operator who will not wait."""
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            logger.warning("%s: exiting at once", signal.Signals(signum).name)
            os._exit(1)
        logger.info("%s: shutting down gracefully (a second signal exits at once)", signal.Signals(signum).name)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    return stop
