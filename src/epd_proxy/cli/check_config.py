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
    kv_connector = cfg.kv_connector
    simulated = []
    if args.simulate:  # the simulator's instances replace the file's (serve's config_for_addresses)
        from epd_proxy.sim.cluster import SimCluster

        cluster = SimCluster.from_spec(args.simulate)  # checked by ServeSettings.config
        roles = [r for r in ROLES if cluster.instances(r) or (r == "decode" and cluster.instances("pd"))]
        kv_connector = cluster.config.kv_connector
        simulated = [f"  simulated: {args.simulate} ("
                     + ", ".join(f"{len(cluster.instances(r))} {r}" for r in ("encode", "prefill", "decode", "pd")
                                 if cluster.instances(r))
                     + ("; the file's instances are not used)" if any(getattr(cfg, r) for r in ROLES)
                        or cfg.discover else ")")]
    topology = infer_topology(roles, cfg.topology)
    lines = [f"topology {topology}" + (f", kv-connector {kv_connector}" if "prefill" in roles else ""),
             f"listen {args.host}:{args.port}, workers {args.workers}", *simulated]
    for role in ROLES if not simulated else ():
        for spec in getattr(cfg, role):
            lines.append(f"  {role:7s} {spec_text(spec)}")
        for spec in cfg.discover:
            if spec.role == role:
                lines.append(f"  {role:7s} {spec_text(spec)} (every address of {spec.host}, re-resolved "
                             f"at most every {cfg.dns_interval:g} s via "
                             f"{cfg.dns_server or 'the system resolver'})")
    return "\n".join(lines + tenant_lines(cfg))


def tenant_lines(cfg: ProxyConfig) -> list[str]:
    """The tenants' tables as they will apply: each key's limits and class, the aliases."""
    from epd_proxy.tenants.limiter import read_config

    table, aliases = read_config(cfg)
    lines = []
    if table is not None:
        # As build_tenants chooses: the table's store, else the replicas' state store, else this process.
        # A URL's user and password are not shown.
        store = (f"in {_no_secret(table.store)} (tenants.store)" if table.store
                 else f"in the shared state store {_no_secret(cfg.state_store)} (--state-store)"
                 if cfg.state_store else "in-process")
        lines.append(f"tenants: counters {store}, store failure {table.store_failure}")
        for name, policy in [("(default)", table.default), *table.keys.items()]:
            limits = ", ".join(f"{k}={v}" for k, v in policy.limits.items()) or "no limits"
            models = f"; models {', '.join(sorted(policy.models))}" if policy.models is not None else ""
            lines.append(f"  {name}: {limits}; class {policy.traffic.name}, weight {policy.weight:g}{models}")
    if aliases is not None:
        lines.append("model aliases: " + (", ".join(f"{a} -> {t}" for a, t in aliases.names.items()) or "none")
                     + (f"; unknown names -> {aliases.default}" if aliases.default else "")
                     + f"; /v1/models lists {aliases.listed}")
    return lines


def _no_secret(url: str) -> str:
    """A store's URL without its user and password."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rpartition("@")[2]


def spec_text(spec: InstanceSpec) -> str:
    """An instance as its flag would give it: the URL and the attributes that are not defaults."""
    default = InstanceSpec(spec.url, spec.role)
    attrs = [f"{f}={getattr(spec, f)}" for f in spec.__slots__
             if f not in ("url", "role") and getattr(spec, f) != getattr(default, f)]
    return ";".join([spec.url, *attrs])
