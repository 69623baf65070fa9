"""The proxy's own version, for the surfaces that tell it: ``/status`` (``proxy.version``) and
``/metrics`` (``epd_proxy_build_info``). ``GET /version`` answers an instance's (vLLM clients
read it to learn vLLM's), so the proxy's is never put there; ``epd-proxy --version`` prints the
package's ``__version__``, which a test keeps equal to this."""

from __future__ import annotations

VERSION = "0.1.0"
