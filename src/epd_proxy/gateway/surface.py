"""The endpoint picker's HTTP port: the proxy's operator surface, without generation.

``/metrics``, ``/status``, ``/health``, ``/ready``, the console, the roster (registration,
drain) and the adapters' admin routes answer as the proxy's do (the same app, the same keys);
a generation or forwarded request is answered 404 in its API's envelope: the picker places
requests, the gateway carries them.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from epd_proxy.http.response import Request, ResponseWriter
from epd_proxy.request.apis import speaks_anthropic
from epd_proxy.wire.errors import ProxyError

Handler = Callable[[Request, ResponseWriter], Awaitable[None]]

# The paths the picker's port answers (and everything under the ones ending in "/").
OPERATOR_PATHS = frozenset(("/health", "/ready", "/status", "/metrics", "/instances", "/instances/drain",
                            "/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/console"))
OPERATOR_PREFIXES = ("/console/", "/v1/models/")


def operator_surface(app: Handler) -> Handler:
    """``app`` answering only the operator's paths."""
    async def handle(req: Request, writer: ResponseWriter) -> None:
        path = req.path
        if path in OPERATOR_PATHS or path.startswith(OPERATOR_PREFIXES):
            await app(req, writer)
            return
        err = ProxyError(404, f"{path}: this is epd-proxy's endpoint picker; send requests through the gateway")
        writer.send(404, err.body(speaks_anthropic(path)), b"application/json")
    return handle
