"""``epd-proxy sidecar``'s command line: ``serve``'s flags for its one decode, its allow-list."""

from __future__ import annotations

from epd_proxy.cli import build_parser, main
from epd_proxy.cli.sidecar import serve_argv
from epd_proxy.placement.steered import DEFAULT_ALLOWED


def test_it_takes_serves_flags_on_the_pods_served_port_and_its_allow_list():
    args = build_parser().parse_args(["sidecar", "--decode", "http://127.0.0.1:8200", "--kv-connector", "nixl"])
    assert args.port == 8000 and args.decode == ["http://127.0.0.1:8200"]
    assert args.allowed_targets.split(",") == list(DEFAULT_ALLOWED)


def test_a_cluster_file_yields_to_the_flags_given_as_for_serve():
    argv = ["sidecar", "--allowed-targets", "10.0.0.0/8", "--decode", "http://d:1", "--allowed-targets=10.1.0.0/16"]
    assert serve_argv(argv) == ["serve", "--decode", "http://d:1"]


def test_a_bad_allow_list_several_decodes_or_workers_are_refused(capsys):
    assert main(["sidecar", "--decode", "http://127.0.0.1:1", "--allowed-targets", "10.0.0.0/33"]) == 2
    assert "--allowed-targets" in capsys.readouterr().err
    for argv in (["--decode", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"],
                 ["--decode", "http://127.0.0.1:1", "--workers", "2"],
                 ["--decode", "http://127.0.0.1:1", "--decode", "dns+http://vllm.local:8000"]):
        assert main(["sidecar", *argv]) == 2
        assert "one --decode" in capsys.readouterr().err
