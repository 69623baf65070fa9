"""``epd-proxy check-config FILE``: read a cluster file as ``serve`` would, and say what it means."""

from __future__ import annotations

import argparse
import sys

from epd_proxy.cli.serve import ServeSettings, error_text, serve_parser
from epd_proxy.config import ROLES, InstanceSpec, ProxyConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE")


def run(args: argparse.Namespace) -> int:
    path = args.file
    argv = ["serve", "--config", path]
    settings = ServeSettings(argv, serve_parser().parse_args(argv[1:]))
    try:
        serve_args = settings.load()
        cfg = settings.config(serve_args)
        from epd_proxy.runtime.serve import tls_context

        tls_context(cfg)  # as serve does: the certificate and key load
    except ValueError as exc:
        print(f"epd-proxy check-config: {error_text(exc, path)}", file=sys.stderr)
        return 2
    print(f"{path}: OK")
    print(describe(cfg, serve_args))
    return 0


def describe(cfg: ProxyConfig, args: argparse.Namespace) -> str:
    """The resolved topology and settings, as ``check-config`` prints them."""
    from epd_proxy.instances.roster import infer_topology

    roles = [r for r in ROLES if getattr(cfg, r) or any(s.role == r for s in cfg.discover)]
    topology = infer_topology(roles, cfg.topology)
    lines = [f"topology {topology}" + (f", kv-connector {cfg.kv_connector}" if "prefill" in roles else ""),
             f"listen {args.host}:{args.port}, workers {args.workers}"]
    for role in ROLES:
        for spec in getattr(cfg, role):
            lines.append(f"  {role:7s} {spec_text(spec)}")
        for spec in cfg.discover:
            if spec.role == role:
                lines.append(f"  {role:7s} {spec_text(spec)} (every address of {spec.host}, re-resolved "
                             f"at most every {cfg.dns_interval:g} s via "
                             f"{cfg.dns_server or 'the system resolver'})")
    return "\n".join(lines)


def spec_text(spec: InstanceSpec) -> str:
    """An instance as its flag would give it: the URL and the attributes that are not defaults."""
    default = InstanceSpec(spec.url, spec.role)
    attrs = [f"{f}={getattr(spec, f)}" for f in spec.__slots__
             if f not in ("url", "role") and getattr(spec, f) != getattr(default, f)]
    return ";".join([spec.url, *attrs])
