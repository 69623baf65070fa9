"""epd-proxy: a fast, failure-aware proxy for disaggregated vLLM serving.

The public API is small: build a :class:`ProxyConfig`, then either run it
with :func:`serve` (blocking, the command line's path) or start it inside an
event loop with :func:`start_proxy` (tests, embedding).
"""

from .app import ProxyApp
from .config import InstanceSpec, ProxyConfig, StageTimeouts, parse_instance
from .connectors import CONNECTORS, KVConnector
from .errors import ProxyError
from .pipeline import Pipeline
from .pool import Instance, InstancePool
from .serve import RunningProxy, serve, start_proxy
from .stages import DecodeStage, EncoderFanout, PrefillStage

__all__ = [
    "CONNECTORS", "DecodeStage", "EncoderFanout", "Instance", "InstancePool", "InstanceSpec",
    "KVConnector", "Pipeline", "PrefillStage", "ProxyApp", "ProxyConfig", "ProxyError", "RunningProxy",
    "StageTimeouts", "parse_instance", "serve", "start_proxy",
]
__version__ = "0.1.0"
