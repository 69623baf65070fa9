"""The cluster file: parsing (pure), flags over the file, and ``epd-proxy check-config``."""

import subprocess
import sys

import pytest

from epd_proxy.cli import build_parser, main
from epd_proxy.cli.cluster_file import ClusterFileError, read_cluster_file
from epd_proxy.cli.serve import ServeSettings, file_options

OPTIONS = file_options()

CLUSTER = """
port = 9100
kv-connector = "nixl-push"
decode_retries = 2
no_rewrite = true
forward_header = ["x-tenant"]
probe_interval = 1

encode = ["http://e1:8001", "http://e2:8002"]

[[prefill]]
url = "http://p1:8100"
engine_id = "prefill-0"
kv_host = "10.0.0.1"
kv_port = 5600

[[decode]]
url = "http://d1:8200"

[[decode]]
url = "dns+http://decode.ns.svc.cluster.local:8200"
tp = 2
"""


def test_the_file_holds_flags_and_instances_with_attributes():
    values = read_cluster_file(CLUSTER, OPTIONS)
    assert values["port"] == 9100 and values["kv_connector"] == "nixl-push" and values["no_rewrite"] is True
    assert values["probe_interval"] == 1.0 and isinstance(values["probe_interval"], float)
    assert values["forward_header"] == ["x-tenant"]
    assert values["prefill"] == ["http://p1:8100;engine_id=prefill-0;kv_host=10.0.0.1;kv_port=5600"]
    assert values["decode"] == ["http://d1:8200", "dns+http://decode.ns.svc.cluster.local:8200;tp=2"]


def test_a_comma_separated_flag_takes_a_list_too():
    assert read_cluster_file('allowed_media_schemes = ["https", "data"]', OPTIONS) == {
        "allowed_media_schemes": "https,data"}
    assert read_cluster_file('ec_consumer_zmq_addrs = "tcp://a:1,tcp://b:2"', OPTIONS) == {
        "ec_consumer_zmq_addrs": "tcp://a:1,tcp://b:2"}


def test_a_flag_with_its_own_parser_reads_the_same_text_in_the_file():
    assert read_cluster_file('max_body_size = "64M"\nmax_buffered_bytes = 1024', OPTIONS) == {
        "max_body_size": 64 << 20, "max_buffered_bytes": 1024}
    with pytest.raises(ClusterFileError, match="max_body_size: not a size"):
        read_cluster_file('max_body_size = "lots"', OPTIONS)


@pytest.mark.parametrize("text, fragment", [
    ("port = ", "not valid TOML"),
    ("prot = 1", "unknown key 'prot' (did you mean 'port'?)"),
    ("port = \"8000\"", "port must be an integer"),
    ("no_rewrite = 1", "no_rewrite must be true or false"),
    ("routing = \"random\"", "routing must be one of round-robin, least-loaded, load-aware, power-of-two, "
                             "cache-aware"),
    ("[[decode]]\nengine_id = \"d\"", "decode #1 has no 'url'"),
    ("decode = [1]", "decode #1 must be a URL string"),
    ("[[prefill]]\nurl = \"http://p:1\"\ntp = 1.5", "tp must be a string or an integer"),
])
def test_a_bad_file_is_one_line_naming_the_key(text, fragment):
    with pytest.raises(ClusterFileError) as info:
        read_cluster_file(text, OPTIONS, source="c.toml")
    msg = str(info.value)
    assert fragment in msg and msg.startswith("c.toml: ") and "\n" not in msg


def _settings(tmp_path, text, *flags):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    argv = ["serve", "--config", str(path), *flags]
    return ServeSettings(argv, build_parser().parse_args(argv))


def test_flags_override_the_file(tmp_path):
    settings = _settings(tmp_path, CLUSTER, "--port", "8000", "--decode", "http://flag:1",
                         "--kv-connector", "nixl")
    args = settings.load()
    cfg = settings.config(args)
    # Given on the command line (even with the default value): the flag wins, and a role's
    # instances are replaced, not merged.
    assert args.port == 8000 and cfg.kv_connector == "nixl"
    assert [s.url for s in cfg.decode] == ["http://flag:1"] and cfg.discover == []
    # Not given: the file's.
    assert cfg.decode_retries == 2 and cfg.rewrite is False and [s.url for s in cfg.encode] == [
        "http://e1:8001", "http://e2:8002"]
    assert "x-tenant" in cfg.forward_headers


def test_dns_instances_are_templates(tmp_path):
    cfg = _settings(tmp_path, CLUSTER).config()
    assert [s.url for s in cfg.decode] == ["http://d1:8200"]
    (tmpl,) = cfg.discover
    assert (tmpl.role, tmpl.url, tmpl.tp) == ("decode", "http://decode.ns.svc.cluster.local:8200", 2)
    assert cfg.prefill[0].engine_id == "prefill-0"


def test_a_dns_name_cannot_carry_one_instances_identity(tmp_path):
    settings = _settings(tmp_path, 'decode = ["http://d:1"]\nprefill = ["dns+http://p.test:1;engine_id=p0"]')
    with pytest.raises(ValueError, match="a DNS name stands for several"):
        settings.config()


def test_check_config_prints_the_resolved_topology(tmp_path, capsys):
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER)
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "topology E+P+D, kv-connector nixl-push" in out
    assert "listen 127.0.0.1:9100" in out
    assert "prefill http://p1:8100;engine_id=prefill-0;kv_host=10.0.0.1;kv_port=5600" in out
    assert "decode  http://decode.ns.svc.cluster.local:8200;tp=2 (every address of decode.ns.svc.cluster.local" \
        in out


@pytest.mark.parametrize("text, fragment", [
    ("port = [", "not valid TOML"),
    ('decode = ["http://d:1"]\nprefill = ["http://p:1"]\nkv_connector = "nixl-push"', "needs each prefill"),
    ('encode = ["http://e:1"]', "at least one --decode"),
    ('decode = ["dns+http://d.test:1"]\ndns_server = "ns.example"', "--dns-server 'ns.example': expected IP:PORT"),
])
def test_check_config_rejects_a_bad_file_with_one_line_and_status_2(tmp_path, text, fragment):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "epd_proxy", "check-config", str(path)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and str(path) in lines[0], proc.stderr
    assert proc.stdout == ""


def test_serve_with_a_bad_file_is_one_line_and_status_2(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text("decode = [\"http://d:1\"]\nworkers = \"two\"\n")
    proc = subprocess.run([sys.executable, "-m", "epd_proxy", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"epd-proxy serve: {path}: workers must be an integer, got 'two'"
