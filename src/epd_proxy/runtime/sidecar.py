"""``epd-proxy sidecar``: the proxy over its pod's one decode instance, whose prefill and
encoders the gateway's endpoint picker names per request (``placement/steered.py``)."""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from epd_proxy.api.app import ProxyApp
from epd_proxy.api.decode_metrics import SIDECAR_METRICS, DecodeMetrics
from epd_proxy.config import ProxyConfig
from epd_proxy.http import event_loop
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.steered import DEFAULT_ALLOWED, Steering
from epd_proxy.runtime.build import start_proxy
from epd_proxy.runtime.running import ListenError, RunningProxy, stop_on_signals

log = logging.getLogger("epd_proxy.sidecar")


def steered(allowed: Sequence[str]):
    """What makes a proxy's app a sidecar's: its pipeline steered by the picker's headers to
    prefills and encoders in ``allowed`` (CIDR blocks), learnt into its prefill and encode pools,
    and a placement that names no prefill of its own (the gateway does); ``/metrics`` its decode's
    (what the picker scrapes at the pod's port: ``api/decode_metrics.py``), its own at
    ``SIDECAR_METRICS``."""
    def adapt(app: ProxyApp) -> None:
        pipeline = app.pipeline
        known = pipeline.known
        pipeline.steering = Steering(app.pools["prefill"], app.pools["encode"], allowed, connector=known.connector,
                                     check=type(app.connector).check_instances)
        known.prefill = InstancePool("prefill", ())
        known.prefill_needed = False
        app.add_route("GET", SIDECAR_METRICS, app.own_metrics, keyless=True)  # it checks the admin key
        app.add_route("GET", "/metrics", DecodeMetrics(app.pools["decode"], app.config.probe_timeout), keyless=True)
    return adapt


async def start_sidecar(config: ProxyConfig, host: str = "127.0.0.1", port: int = 0, *,
                        allowed: Sequence[str] = DEFAULT_ALLOWED, reloads: bool = False,
                        settings=None) -> RunningProxy:
    """A started sidecar: the proxy over ``config``'s decode, steered by the picker's headers."""
    return await start_proxy(config, host, port, reloads=reloads, settings=settings, adapt=steered(allowed))


def serve_sidecar(config: ProxyConfig, host: str, port: int, *, allowed: Sequence[str], settings=None) -> int:
    """``epd-proxy sidecar`` until SIGINT/SIGTERM (a second one exits at once)."""
    try:
        event_loop.run(_forever(config, host, port, allowed, settings))
    except ListenError as exc:
        print(f"epd-proxy sidecar: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _forever(config: ProxyConfig, host: str, port: int, allowed: Sequence[str], settings) -> None:
    proxy = await start_sidecar(config, host, port, allowed=allowed, reloads=settings is not None,
                                settings=settings)
    stop = stop_on_signals(log)
    decode = ", ".join(i.url for i in proxy.app.pools["decode"].instances)
    print(f"epd-proxy sidecar on {proxy.url} for {decode} (prefills and encoders allowed in "
          f"{', '.join(allowed)})", flush=True)
    try:
        await stop.wait()
        await proxy.shutdown(config.shutdown_grace, config.shutdown_timeout)
    finally:
        if proxy.reloader is not None:
            await proxy.reloader.close()
        await proxy.close()
