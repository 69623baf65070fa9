"""``epd-proxy sidecar``: beside a decode (or PD) vLLM in its pod, behind a gateway whose endpoint
picker names the prefill and the encoders in llm-d's ``x-prefiller-host-port`` and
``x-encoder-hosts-ports`` headers.

It takes every ``serve`` flag for the local instance (``--decode``), the KV connector, the
timeouts, client keys and TLS, one process; ``--prefill``/``--encode`` only give the identity
of instances the picker may name (what NIXL push and Mooncake need), never one it did not.
Its own flag: ``--allowed-targets``, the CIDR blocks a named prefill or encoder must be in
(``placement/steered.py``).
"""

from __future__ import annotations

import argparse
import sys

from epd_proxy.cli import serve as serve_command
from epd_proxy.placement.steered import DEFAULT_ALLOWED, parse_networks

# The port the vLLM container's clients reach the pod on (llm-d's routing sidecar's too).
PORT = 8000
_OWN = {"--allowed-targets"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve_command.add_arguments(p)
    p.set_defaults(port=PORT)
    g = p.add_argument_group("sidecar")
    g.add_argument("--allowed-targets", default=",".join(DEFAULT_ALLOWED), metavar="CIDR[,CIDR...]",
                   help="the networks a prefill (x-prefiller-host-port) or an encoder (x-encoder-hosts-ports) "
                        "the gateway names must be in; a request naming any other is refused with 403 "
                        "(default: loopback and the private ranges, %(default)s)")


def serve_argv(argv: list[str]) -> list[str]:
    """The command line as ``serve`` reads it (the sidecar's own flags taken out)."""
    return serve_command.argv_for_serve(argv, "sidecar", _OWN)


def run(args: argparse.Namespace) -> int:
    allowed = [b.strip() for b in args.allowed_targets.split(",") if b.strip()]
    try:
        parse_networks(allowed)
    except ValueError as exc:
        print(f"epd-proxy sidecar: --allowed-targets: {exc}", file=sys.stderr)
        return 2
    settings = serve_command.ServeSettings(serve_argv(args.argv), args)
    settled = serve_command.load_for("sidecar", settings)
    if settled is None:
        return 2
    loaded, cfg = settled
    if loaded.workers != 1 or loaded.simulate or len(cfg.decode) != 1 or cfg.discover:
        print("epd-proxy sidecar: one --decode (the pod's own instance), one process (no --workers, no "
              "--simulate), no discovery (the gateway names the prefill and encoders)", file=sys.stderr)
        return 2
    from epd_proxy.runtime.sidecar import serve_sidecar

    return serve_sidecar(cfg, loaded.host, loaded.port, allowed=allowed, settings=settings if settings.path else None)
