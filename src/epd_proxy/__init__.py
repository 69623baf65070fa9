"""epd-proxy: a fast, failure-aware proxy for disaggregated vLLM serving.

The public API is small: build a :class:`ProxyConfig` (its instances are
:class:`InstanceSpec`\\ s, e.g. from :func:`parse_instance`; its bounds a
:class:`StageTimeouts`), then either run it with :func:`serve` (blocking, the
command line's path) or start it inside an event loop with :func:`start_proxy`
(tests, embedding), which returns a :class:`RunningProxy`. Everything else is
internal and may change.
"""

from .config import InstanceSpec, ProxyConfig, StageTimeouts, parse_instance
from .serve import RunningProxy, serve, start_proxy

__all__ = ["InstanceSpec", "ProxyConfig", "RunningProxy", "StageTimeouts", "parse_instance", "serve", "start_proxy"]
__version__ = "0.1.0"
