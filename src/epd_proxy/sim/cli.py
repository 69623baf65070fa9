"""``epd-proxy sim``: run a simulated cluster until interrupted.

The main CLI wires this in with :func:`add_arguments` and :func:`run`;
``python -m epd_proxy.sim`` runs it standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys

from epd_proxy.http import event_loop
from epd_proxy.sim.cluster import SimCluster
from epd_proxy.sim.config import EC_CONNECTORS, KV_CONNECTORS, SimConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("topology")
    g.add_argument("--encode", type=int, default=0, metavar="N", help="encoder instances (EC producers)")
    g.add_argument("--prefill", type=int, default=0, metavar="N", help="prefill instances (KV producers)")
    g.add_argument("--decode", type=int, default=0, metavar="N", help="decode instances (KV consumers)")
    g.add_argument("--pd", type=int, default=0, metavar="N", help="plain instances (EC consumers in E+PD)")
    g.add_argument("--spec", default=None, metavar="SPEC",
                   help="topology spec instead of the counts, e.g. 'encode=2,prefill=1,decode=2,kv=nixl-push'")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--base-port", type=int, default=None, metavar="N",
                   help="consecutive ports from N (encoders, prefills, decodes, pds); default: ephemeral")
    g.add_argument("--kv-connector", choices=KV_CONNECTORS, default=None)
    g.add_argument("--ec-connector", choices=EC_CONNECTORS, default=None,
                   help="what encoders report: nixl (metadata and handle, default) or example "
                        "(ECExampleConnector: empty metadata)")
    g.add_argument("--no-strict-roles", action="store_true",
                   help="accept plain requests on prefills and do_remote_decode on decodes, as vLLM does")
    g.add_argument("--model", default=None, help="served model name (default sim-model)")
    g.add_argument("--enable-scale-out", action="store_true",
                   help="serve /inference/v1/generate, as vllm serve --enable-scale-out (else 403)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME", dest="served_model_name",
                   help="every name the instances serve, as vLLM's flag (the first replaces --model)")
    lat = parser.add_argument_group("latency model")
    lat.add_argument("--ttft-ms", type=float, default=None, help="base time to first token")
    lat.add_argument("--ttft-per-token-ms", type=float, default=None, help="extra TTFT per prompt token")
    lat.add_argument("--itl-ms", type=float, default=None, help="inter-token latency (engine step)")
    lat.add_argument("--encode-ms", type=float, default=None, help="encoder time per media item")
    lat.add_argument("--max-num-seqs", type=int, default=None)
    lat.add_argument("--max-tokens", type=int, default=None, dest="default_max_tokens",
                     help="output tokens when a request sets no max")
    kv = parser.add_argument_group("KV transfer")
    kv.add_argument("--kv-abort-timeout", type=float, default=None, metavar="S")
    kv.add_argument("--push-registration-timeout", type=float, default=None, metavar="S")
    kv.add_argument("--kv-failure-delay-ms", type=float, default=None, metavar="MS",
                    help="a failed KV load answers after this long (real NIXL: its ~5 s handshake timeout)")
    f = parser.add_argument_group("faults")
    f.add_argument("--fault-rate", type=float, default=None, help="probability of a random fault per request")
    f.add_argument("--fault-seed", type=int, default=None)
    f.add_argument("--fault-kinds", default=None,
                   help="';'-separated fault specs to draw from, e.g. 'status=503;decode:reset-after=2'")
    parser.add_argument("--no-records", action="store_true", help="do not keep request records")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="any SimConfig field, e.g. --set decode.itl_ms=5 (repeatable)")


def config_from_args(args: argparse.Namespace, base: SimConfig | None = None) -> SimConfig:
    cfg = base or SimConfig()
    changes = {}
    mapping = {"model": "model", "ttft_ms": "ttft_ms", "ttft_per_token_ms": "ttft_per_token_ms",
               "itl_ms": "itl_ms", "encode_ms": "encode_ms_per_item", "max_num_seqs": "max_num_seqs",
               "default_max_tokens": "default_max_tokens", "kv_abort_timeout": "kv_abort_timeout",
               "push_registration_timeout": "push_registration_timeout", "fault_rate": "fault_rate",
               "fault_seed": "fault_seed", "kv_connector": "kv_connector", "ec_connector": "ec_connector",
               "kv_failure_delay_ms": "kv_failure_delay_ms"}
    for attr, field in mapping.items():
        v = getattr(args, attr, None)
        if v is not None:
            changes[field] = v
    if getattr(args, "fault_kinds", None):
        changes["fault_kinds"] = tuple(k for k in args.fault_kinds.split(";") if k.strip())
    if getattr(args, "no_records", False):
        changes["records"] = False
    if getattr(args, "no_strict_roles", False):
        changes["strict_roles"] = False
    if getattr(args, "enable_scale_out", False):
        changes["enable_scale_out"] = True
    if getattr(args, "served_model_name", None):
        changes["models"] = tuple(args.served_model_name)
    if changes:
        cfg = dataclasses.replace(cfg, **changes)
    return cfg


def cluster_from_args(args: argparse.Namespace) -> SimCluster:
    """The cluster the flags describe; a spec it cannot read is one line and exit status 2."""
    try:
        return _cluster_from_args(args)
    except ValueError as exc:
        print(f"epd-proxy sim: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _cluster_from_args(args: argparse.Namespace) -> SimCluster:
    cfg = config_from_args(args)
    extra = ",".join(getattr(args, "set", []) or [])
    if args.spec:
        spec = args.spec + ("," + extra if extra else "")
        kw = {"host": args.host}
        if args.base_port is not None:
            kw["base_port"] = args.base_port
        return SimCluster.from_spec(spec, config=cfg, **kw)
    counts = f"encode={args.encode},prefill={args.prefill},decode={args.decode},pd={args.pd}"
    if args.encode + args.prefill + args.decode + args.pd == 0:
        raise SystemExit("epd-proxy sim: no instances (give --encode/--prefill/--decode/--pd or --spec)")
    return SimCluster.from_spec(counts + ("," + extra if extra else ""), config=cfg, host=args.host,
                                base_port=args.base_port)


def run(args: argparse.Namespace) -> int:
    """``epd-proxy sim``: run the cluster until interrupted."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        event_loop.run(run_cluster(args))
    except KeyboardInterrupt:
        pass
    return 0


async def run_cluster(args: argparse.Namespace) -> None:
    """Start the cluster, print its URLs and prefill identities, run until cancelled."""
    cluster = cluster_from_args(args)
    async with cluster:
        print(cluster.describe(), flush=True)
        print("simulator running; Ctrl-C to stop", file=sys.stderr, flush=True)
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epd_proxy.sim", description="Simulated vLLM cluster",
                                     allow_abbrev=False)
    add_arguments(parser)
    return run(parser.parse_args(argv))
