"""epd-proxy: a fast, failure-aware proxy for disaggregated vLLM serving.

The public API is small: build a :class:`ProxyConfig` (its instances are
:class:`InstanceSpec`\\ s, e.g. from :func:`parse_instance`; its bounds a
:class:`StageTimeouts`), then either run it with :func:`serve` (blocking, the
command line's path) or start it inside an event loop with :func:`start_proxy`
(tests, embedding), which returns a :class:`RunningProxy`. Everything else is
internal and may change.

The configuration names are a leaf and load at once; the serving names load the
whole proxy and do so on first use, so that ``import epd_proxy.sim`` or
``import epd_proxy.http.client`` loads only what those use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epd_proxy.config import InstanceSpec, ProxyConfig, StageTimeouts, parse_instance

if TYPE_CHECKING:  # pragma: no cover
    from epd_proxy.runtime.serve import RunningProxy, serve, start_proxy

__all__ = ["InstanceSpec", "ProxyConfig", "RunningProxy", "StageTimeouts", "parse_instance", "serve", "start_proxy"]
__version__ = "0.1.0"

_LAZY = frozenset({"RunningProxy", "serve", "start_proxy"})


def __getattr__(name: str):
    if name in _LAZY:
        from epd_proxy.runtime import serve as _serve

        return getattr(_serve, name)
    raise AttributeError(f"module 'epd_proxy' has no attribute {name!r}")
