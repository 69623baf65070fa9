"""What ``serve`` and ``check-config`` refuse, as an operator runs them (real child processes):
numbers out of range naming the flag, instance URLs that cannot work, and every mistake of a
file in one answer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
D = "http://127.0.0.1:9"  # nothing listens there: every case is refused before a connection


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epd_proxy", *argv], capture_output=True, text=True,
                          timeout=60, env=ENV)


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "--port must be in 1..65535, not 70000"),
    (["--port", "131072"], "--port must be in 1..65535, not 131072"),
    (["--port", "-1"], "--port must be in 1..65535, not -1"),
    (["--workers", "0"], "--workers must be >= 1, not 0"),
    (["--probe-timeout", "0"], "--probe-timeout must be > 0, not 0"),
    (["--connect-timeout", "nan"], "--connect-timeout must be a finite number, not nan"),
    (["--stream-idle-timeout", "-5"], "--stream-idle-timeout must be > 0, not -5"),
    (["--probe-interval", "-1"], "--probe-interval must be >= 0, not -1"),
    (["--upstream-keep-alive", "-1"], "--upstream-keep-alive must be >= 0, not -1"),
    (["--max-ejection-percent", "101"], "--max-ejection-percent must be in 0..100, not 101"),
    (["--balance-rel", "0.5"], "--balance-rel must be >= 1, not 0.5"),
    (["--queue-size", "-3"], "--queue-size must be >= 0, not -3"),
    (["--decode", "http://127.0.0.1:8102/v1"], "give the instance's root, http://127.0.0.1:8102, without a path"),
    (["--decode", "http://127.0.0.1:8102/?x=1"], "without a path"),
    (["--prefill", "http://127.0.0.1:8101;kv_port=70000"], "kv_port must be in 1..65535, not 70000"),
    (["--prefill", "http://127.0.0.1:9"], "http://127.0.0.1:9 is given as both prefill and decode instance"),
    (["--encode", "http://127.0.0.1:9"], "http://127.0.0.1:9 is given as both encode and decode instance"),
    (["--prefill", "http://127.0.0.1:8101", "--kv-connector", "nixl-push"], "--kv-connector nixl-push needs"),
])
def test_serve_refuses_what_cannot_work_naming_the_flag(flags, message):
    proc = _run("serve", "--decode", D, *flags)
    assert proc.returncode == 2, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("epd-proxy serve: error: ")]
    assert message in line, proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_names_every_wrong_flag_at_once():
    proc = _run("serve", "--decode", D, "--port", "70000", "--workers", "0", "--fail-threshold", "0")
    assert proc.returncode == 2
    assert "error: 3 mistakes:\n" in proc.stderr
    for line in ("  --port must be in 1..65535, not 70000", "  --workers must be >= 1, not 0",
                 "  --fail-threshold must be >= 1, not 0"):
        assert line in proc.stderr.splitlines(), proc.stderr


SEVERAL = """\
port = 70000
workers = 0
kv_connector = "mooncake"
prefill = ["http://127.0.0.1:8101"]
decode = ["http://127.0.0.1:8102/v1", "http://127.0.0.1:8101"]
"""
EXPECTED = [
    "  decode instance 'http://127.0.0.1:8102/v1': give the instance's root, http://127.0.0.1:8102, without a "
    "path (the proxy adds /v1/...)",
    "  --port must be in 1..65535, not 70000",
    "  --workers must be >= 1, not 0",
    "  http://127.0.0.1:8101 is given as both prefill and decode instance: an instance has one role (one that "
    "prefills and decodes is given as --decode only)",
    "  --kv-connector mooncake needs each prefill's bootstrap port, e.g. 'http://127.0.0.1:8101;bootstrap_port=8998' "
    "(VLLM_MOONCAKE_BOOTSTRAP_PORT)",
]


@pytest.mark.parametrize("command", ["check-config", "serve"])
def test_a_file_with_several_mistakes_reports_them_all(tmp_path, command):
    path = tmp_path / "cluster.toml"
    path.write_text(SEVERAL)
    proc = _run(command, str(path)) if command == "check-config" else _run("serve", "--config", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"epd-proxy {command}: {path}: 5 mistakes:", proc.stderr
    assert lines[1:] == EXPECTED
    assert proc.stdout == ""


@pytest.mark.parametrize("text, message", [
    ('decode = ["http://127.0.0.1:8102/v1"]', "decode instance 'http://127.0.0.1:8102/v1': give the instance's root"),
    ('decode = ["http://127.0.0.1:9"]\nprefill = ["http://127.0.0.1:9"]', "given as both prefill and decode"),
    ('decode = ["http://127.0.0.1:9"]\nworkers = 0', "--workers must be >= 1, not 0"),
    ('decode = ["http://127.0.0.1:9"]\nport = 70000', "--port must be in 1..65535, not 70000"),
    ('decode = ["http://127.0.0.1:9"]\nprobe_timeout = -1.0', "--probe-timeout must be > 0, not -1"),
    ('decode = ["http://127.0.0.1:9"]\nprefill = ["http://127.0.0.1:8101"]\nkv_connector = "nixl-push"',
     "--kv-connector nixl-push needs each prefill's identity"),
])
def test_check_config_refuses_each_alone_in_one_line(tmp_path, text, message):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    proc = _run("check-config", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"epd-proxy check-config: {path}: ") and message in lines[0], \
        proc.stderr


def test_a_files_type_mistakes_come_together(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('decode = ["http://127.0.0.1:9"]\nworkers = "two"\nprot = 1\n')
    proc = _run("check-config", str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"epd-proxy check-config: {path}: 2 mistakes:", "  workers must be an integer, got 'two'",
        "  unknown key 'prot' (did you mean 'port'?)"]


def test_a_pd_instance_given_as_decode_only_passes(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('decode = ["http://127.0.0.1:8102/"]\nport = 8000\nworkers = 2\n')
    proc = _run("check-config", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "decode  http://127.0.0.1:8102" in proc.stdout and "workers 2" in proc.stdout


TENANTS = """\
decode = ["http://127.0.0.1:9"]
api_key_file = "{keys}"
[tenants.default]
requests_per_minute = 100
[[tenants.keys]]
name = "{name}"
requests_per_minute = 1
"""


@pytest.mark.parametrize("command", ["check-config", "serve"])
def test_a_tenant_entry_naming_no_key_is_a_mistake_with_the_closest_name(tmp_path, command):
    keys = tmp_path / "keys"
    keys.write_text("team-a:sk-aaa\nteam-b:sk-bbb\n")
    path = tmp_path / "cluster.toml"
    path.write_text(TENANTS.format(keys=keys, name="team-aa"))
    proc = _run(command, str(path)) if command == "check-config" else _run("serve", "--config", str(path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"epd-proxy {command}: {path}: tenants.keys 'team-aa': no client key is named 'team-aa' (--api-key-file "
        f"{keys}; did you mean 'team-a'?): its limits would apply to no one"]
    path.write_text(TENANTS.format(keys=keys, name="team-a"))
    proc = _run("check-config", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "  team-a: requests_per_minute=1; class standard, weight 1" in proc.stdout


def test_with_tenants_every_key_of_the_key_file_needs_a_name(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# the gateway's clients\nteam-a:sk-aaa\nsk-unnamed\n")
    path = tmp_path / "cluster.toml"
    path.write_text(TENANTS.format(keys=keys, name="team-a"))
    proc = _run("check-config", str(path))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"epd-proxy check-config: {path}: --api-key-file {keys} line 3: a key without a name: with a [tenants] "
        "table every key needs one ('name:key'), or a line inserted above it would move another client's limits "
        "onto it"]
    # Without a [tenants] table such a key is named after its line, as before.
    path.write_text(f'decode = ["http://127.0.0.1:9"]\napi_key_file = "{keys}"\n')
    assert _run("check-config", str(path)).returncode == 0


def test_check_config_says_what_serve_will_do_shared_counters_and_a_simulated_topology(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text('simulate = "encode=1,prefill=1,decode=2"\nstate_store = "redis://:secret@10.0.0.5:6379/0"\n'
                    '[tenants.default]\nrequests_per_minute = 5\n')
    proc = _run("check-config", str(path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1] == "topology E+P+D, kv-connector nixl", proc.stdout
    assert "  simulated: encode=1,prefill=1,decode=2 (1 encode, 1 prefill, 2 decode)" in lines
    assert ("tenants: counters in the shared state store redis://10.0.0.5:6379/0 (--state-store), "
            "store failure open") in lines
    assert "secret" not in proc.stdout
    # The table's own store wins over --state-store, as serve's counters do.
    path.write_text('decode = ["http://127.0.0.1:9"]\nstate_store = "redis://10.0.0.5:6379/0"\n'
                    '[tenants]\nstore = "redis://10.0.0.6:6379/1"\n')
    assert "tenants: counters in redis://10.0.0.6:6379/1 (tenants.store), store failure open" in \
        _run("check-config", str(path)).stdout


@pytest.mark.parametrize("argv, first", [
    (["serve", "--simulate", "prefil=1"],
     "epd-proxy serve: error: --simulate 'prefil=1': unknown topology spec key 'prefil' (did you mean 'prefill'?); "
     "keys: encode, prefill, decode, pd (counts), kv, base_port, host, a simulator setting (e.g. itl_ms) or "
     "ROLE.setting"),
    (["serve", "--simulate", "decode=two"], "epd-proxy serve: error: --simulate 'decode=two': decode='two': a count "
                                            "of instances, e.g. decode=2"),
    (["serve", "--decode", D, "--no-kv-reus"], "epd-proxy serve: error: unrecognized arguments: --no-kv-reus"),
    (["serve", "--decode", D, "--port", "x"], "epd-proxy serve: error: argument --port: invalid int value: 'x'"),
    (["serve", "--decode", D, "--port=70000"], "epd-proxy serve: error: --port must be in 1..65535, not 70000"),
])
def test_a_command_line_mistake_is_the_error_and_a_hint(argv, first):
    """No traceback, no seventy lines of usage, no abbreviated flag taken for another."""
    proc = _run(*argv)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [first, "  (see 'epd-proxy serve --help')"], proc.stderr


def test_no_parser_takes_an_abbreviated_flag():
    from epd_proxy.cli import build_parser

    parser = build_parser()
    for sub in (parser, *parser.commands.values()):
        assert sub.allow_abbrev is False, sub.prog
    assert _run("check-config", "--hel").returncode == 2


def test_a_simulator_spec_mistake_is_one_line():
    proc = _run("sim", "--spec", "prefil=1")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "epd-proxy sim: unknown topology spec key 'prefil' (did you mean 'prefill'?); keys: encode, prefill, decode, "
        "pd (counts), kv, base_port, host, a simulator setting (e.g. itl_ms) or ROLE.setting"]
