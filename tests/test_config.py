import pytest

from epd_proxy.app import validate_config
from epd_proxy.cli import build_parser, config_from_args
from epd_proxy.config import ProxyConfig, parse_instance, split_instances


def test_instance_attributes_parse():
    spec = parse_instance("http://p1:8100;engine_id=prefill-0;kv_host=10.0.0.1;kv_port=5600;tp=2;pp_size=1",
                          "prefill")
    assert (spec.url, spec.engine_id, spec.kv_host, spec.kv_port, spec.tp, spec.pp) == (
        "http://p1:8100", "prefill-0", "10.0.0.1", 5600, 2, 1)
    assert spec.host == "p1"


def test_bare_host_port_gets_a_scheme():
    assert parse_instance("10.0.0.2:8200", "decode").url == "http://10.0.0.2:8200"


@pytest.mark.parametrize("text, fragment", [
    ("http://p1:8100;colour=blue", "unknown attribute"),
    ("http://p1:8100;kv_port=abc", "must be an integer"),
    ("ftp://p1:8100", "expected http"),
    ("http://p1:notaport", "invalid port"),
])
def test_bad_instances_are_explained(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_instance(text, "prefill")


def test_flags_are_repeatable_and_comma_separated():
    assert split_instances(["http://a:1,http://b:2", "http://c:3"]) == ["http://a:1", "http://b:2", "http://c:3"]
    assert split_instances(["disable"]) == []
    assert split_instances(None) == []


def test_cli_builds_the_operators_config():
    args = build_parser().parse_args([
        "serve", "--encode", "http://e1:1,http://e2:2", "--prefill", "http://p:3", "--decode", "http://d:4",
        "--decode-retries", "2", "--encoder-max-batch-size", "4", "--no-rewrite"])
    cfg = config_from_args(args)
    assert [s.url for s in cfg.encode] == ["http://e1:1", "http://e2:2"]
    assert cfg.decode_retries == 2 and cfg.encoder_max_batch_size == 4 and cfg.rewrite is False
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    validate_config(cfg)


def test_push_needs_each_prefills_identity():
    cfg = ProxyConfig(prefill=[parse_instance("http://p:1", "prefill")], decode=[parse_instance("http://d:2", "decode")],
                      kv_connector="nixl-push")
    with pytest.raises(ValueError, match="engine_id"):
        validate_config(cfg)
    ok = cfg.replace(prefill=[parse_instance("http://p:1;engine_id=p0;kv_port=5600", "prefill")])
    validate_config(ok)


@pytest.mark.parametrize("changes, fragment", [
    ({"decode": []}, "decode"),
    ({"decode_retries": -1}, "retries"),
    ({"kv_connector": "carrier-pigeon"}, "unknown --kv-connector"),
    ({"ec_consumer_zmq_addrs": ["tcp://a:1", "tcp://b:2"]}, "needs 1 addresses"),
])
def test_invalid_configs_fail_before_serving(changes, fragment):
    cfg = ProxyConfig(decode=[parse_instance("http://d:2", "decode")]).replace(**changes)
    with pytest.raises(ValueError, match=fragment):
        validate_config(cfg)


def test_front_door_flags_default_to_the_config_and_take_sizes():
    base = ["serve", "--decode", "http://d:4"]
    cfg = config_from_args(build_parser().parse_args(base))
    default = ProxyConfig()
    for name in ("max_body_size", "max_buffered_bytes", "max_connections", "header_timeout", "body_timeout"):
        assert getattr(cfg, name) == getattr(default, name)
    assert default.max_body_size == 64 << 20 and default.max_buffered_bytes == 512 << 20
    cfg = config_from_args(build_parser().parse_args(base + [
        "--max-body-size", "1M", "--max-buffered-bytes", "2g", "--max-connections", "100",
        "--header-timeout", "2.5", "--body-timeout", "30"]))
    assert (cfg.max_body_size, cfg.max_buffered_bytes, cfg.max_connections) == (1 << 20, 2 << 30, 100)
    assert (cfg.header_timeout, cfg.body_timeout) == (2.5, 30)
    assert config_from_args(build_parser().parse_args(base + ["--max-body-size", "1500"])).max_body_size == 1500
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--max-body-size", "lots"])
    with pytest.raises(ValueError, match="--header-timeout"):
        validate_config(cfg.replace(header_timeout=-1))
