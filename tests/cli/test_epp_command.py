"""``epd-proxy epp``'s command line: ``serve``'s flags and cluster file, its own ports."""

from __future__ import annotations

from epd_proxy.cli import build_parser, main
from epd_proxy.cli.epp import serve_argv


def test_it_takes_serves_flags_and_its_own_ports():
    args = build_parser().parse_args(["epp", "--decode", "http://10.0.0.1:8000", "--kv-events-port", "5557"])
    assert (args.port, args.grpc_port, args.grpc_host, args.endpoints) == (9090, 9002, "0.0.0.0", 3)
    assert args.decode == ["http://10.0.0.1:8000"] and args.kv_events_port == 5557


def test_a_cluster_file_yields_to_the_flags_given_as_for_serve():
    argv = ["epp", "--grpc-port", "7000", "--decode", "http://d:1", "--endpoints=2", "--grpc-host", "::"]
    assert serve_argv(argv) == ["serve", "--decode", "http://d:1"]


def test_workers_simulation_and_an_empty_list_are_refused(capsys):
    assert main(["epp", "--workers", "2", "--decode", "http://127.0.0.1:1"]) == 2
    assert "one process per replica" in capsys.readouterr().err
    assert main(["epp", "--endpoints", "0", "--decode", "http://127.0.0.1:1"]) == 2
    assert main(["epp"]) == 2  # no instance at all: serve's own check
    assert "--decode" in capsys.readouterr().err
