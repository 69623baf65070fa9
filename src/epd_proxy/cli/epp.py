"""``epd-proxy epp``: the endpoint picker of a Gateway API inference extension ``InferencePool``.

It takes every ``serve`` flag (and the same cluster file): the instances and how they are
found, routing, KV events, tenants, aliases, the state store. ``--port`` is its operator
surface (``/metrics``, ``/status``, the console, registration); ``--grpc-port`` the external
processing service Envoy calls, and gRPC health.
"""

from __future__ import annotations

import argparse
import sys

from epd_proxy.cli import serve as serve_command
from epd_proxy.gateway.pick import DEFAULT_FALLBACKS

# The ports llm-d's and the inference extension's pickers use: gRPC 9002, metrics 9090.
GRPC_PORT = 9002
HTTP_PORT = 9090
_OWN = {"--grpc-host", "--grpc-port", "--endpoints"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve_command.add_arguments(p)
    p.set_defaults(port=HTTP_PORT)
    g = p.add_argument_group("endpoint picker")
    g.add_argument("--grpc-host", default="0.0.0.0", help="address of the gRPC listener (default %(default)s)")
    g.add_argument("--grpc-port", type=int, default=GRPC_PORT,
                   help="port of the ext_proc service and gRPC health (default %(default)s)")
    g.add_argument("--endpoints", type=int, default=DEFAULT_FALLBACKS, metavar="N",
                   help="endpoints named per request, best first: the gateway's retries walk them "
                        "(default %(default)s)")


def serve_argv(argv: list[str]) -> list[str]:
    """The command line as ``serve`` reads it (the picker's own flags taken out)."""
    return serve_command.argv_for_serve(argv, "epp", _OWN)


def run(args: argparse.Namespace) -> int:
    if args.workers != 1 or args.simulate:
        print("epd-proxy epp: one process per replica (no --workers, no --simulate): run replicas, "
              "they share limits and turns through --state-store", file=sys.stderr)
        return 2
    if args.endpoints < 1:
        print("epd-proxy epp: --endpoints must be at least 1", file=sys.stderr)
        return 2
    settings = serve_command.ServeSettings(serve_argv(args.argv), args)
    settled = serve_command.load_for("epp", settings)
    if settled is None:
        return 2
    loaded, cfg = settled
    from epd_proxy.runtime.serve import serve_epp

    return serve_epp(cfg, loaded.host, loaded.port, grpc_host=args.grpc_host, grpc_port=args.grpc_port,
                     endpoints=args.endpoints, settings=settings if settings.path else None)
