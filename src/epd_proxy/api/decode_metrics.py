"""The sidecar's ``/metrics``: its decode's own exposition, passed through.

llm-d's convention: the pod's served port is the sidecar's, and a scrape of the pod's
``/metrics`` (an endpoint picker's, Prometheus's) reaches vLLM's, with its ``vllm:`` queue,
KV-cache and LoRA gauges: the load an endpoint picker weighs. The sidecar's own families move
to ``SIDECAR_METRICS`` (``runtime/sidecar.py``) rather than being appended: vLLM's and the
sidecar's processes both export the ``process_*`` and ``python_*`` families, which one exposition
cannot hold twice, and a scraper asking for OpenMetrics gets vLLM's answer in that format, which
ends with ``# EOF``.

Passed through: the status, the content type and the body as vLLM sent them, and the scraper's
``Accept`` (content negotiation). Bounded: one fetch per scrape (scrapes are periodic, no
request waits on one), past the connection cap like the load scraper's, within
``--probe-timeout``; a decode that does not answer is a 502 (unreachable) or 504 (no answer in
time), never a wait, and the sidecar's own metrics do not depend on it. Open like vLLM's own
``/metrics``: its labels are the model's name and the engine's index, nothing of the roster, and
the pickers that scrape it present no key.
"""

from __future__ import annotations

import asyncio

from epd_proxy.http.response import Request, ResponseWriter
from epd_proxy.http.transport import TransportTimeouts, UpstreamError
from epd_proxy.instances.pool import InstancePool
from epd_proxy.wire.errors import ProxyError

SIDECAR_METRICS = "/sidecar/metrics"  # the sidecar's own families (epd_proxy_*, process_*, python_*)
_TEXT = b"text/plain; version=0.0.4; charset=utf-8"


class DecodeMetrics:
    """``GET /metrics`` answered by the pool's one instance (the sidecar's decode)."""

    def __init__(self, pool: InstancePool, timeout: float) -> None:
        self.pool = pool
        self.timeout = timeout
        self.timeouts = TransportTimeouts(connect=timeout, headers=timeout, idle=timeout)

    async def __call__(self, req: Request, writer: ResponseWriter) -> None:
        instances = self.pool.instances
        if not instances:  # pragma: no cover - a sidecar's decode is given on its command line
            err = ProxyError(503, "no decode instance to read /metrics from")
            writer.send(err.status, err.body())
            return
        accept = req.headers.get(b"accept")
        try:
            async with asyncio.timeout(self.timeout):
                status, content_type, body = await instances[0].connections.fetch(
                    "GET", "/metrics", headers=[(b"accept", accept)] if accept else None, timeouts=self.timeouts,
                    queue=False)
        except (TimeoutError, UpstreamError, OSError) as exc:
            timed_out = isinstance(exc, TimeoutError) or getattr(exc, "kind", None) == "timeout"
            why = f"no answer within {self.timeout:g} s" if timed_out else (str(exc) or type(exc).__name__)
            err = ProxyError(504 if timed_out else 502, f"the decode's /metrics ({instances[0].url}): {why}")
            writer.send(err.status, err.body())
            return
        writer.send(status, body, content_type or _TEXT)
