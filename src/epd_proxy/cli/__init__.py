"""The ``epd-proxy`` command line: ``serve``, ``epp``, ``sidecar``, ``check-config``, ``sim`` and ``bench``.

Each command is a module offering ``add_arguments(parser)`` and ``run(args) -> int``;
this one only registers them and hands the parsed command line to the right one.
"""

from __future__ import annotations

import sys

from epd_proxy.bench import cli as bench_command
from epd_proxy.cli import check_config
from epd_proxy.cli import epp as epp_command
from epd_proxy.cli import serve as serve_command
from epd_proxy.cli import sidecar as sidecar_command
from epd_proxy.cli.parser import Parser
from epd_proxy.sim import cli as sim_command

# name -> (module, one line for the command list)
COMMANDS = {
    "serve": (serve_command, "run the proxy"),
    "epp": (epp_command, "run the endpoint picker of a Gateway API inference extension InferencePool"),
    "sidecar": (sidecar_command, "run beside a decode vLLM: carry out the prefill a gateway's endpoint picker names"),
    "check-config": (check_config, "validate a cluster file and print the resolved topology"),
    "sim": (sim_command, "run simulated vLLM instances"),
    "bench": (bench_command, "benchmark an OpenAI-compatible endpoint (see docs/benchmarks.md)"),
}


def build_parser() -> Parser:
    from epd_proxy import __version__

    parser = Parser(prog="epd-proxy",
                                     description="A proxy for disaggregated (encode/prefill/decode) vLLM.")
    parser.add_argument("--version", action="version", version=f"epd-proxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)  # each a Parser (parser_class)
    for name, (module, summary) in COMMANDS.items():
        parser.commands[name] = sub.add_parser(name, help=summary)
        module.add_arguments(parser.commands[name])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's parser: its --help is the one to read
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = argv  # the command line as given: serve tells the flags given from the defaults by it
    module, _ = COMMANDS[args.command]
    return module.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
