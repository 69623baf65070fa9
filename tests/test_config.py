import pytest

from epd_proxy.api.app import validate_config
from epd_proxy.cli import build_parser
from epd_proxy.cli.serve import config_from_args
from epd_proxy.config import ProxyConfig, parse_instance, split_instances, url_mistake


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
    ("ftp://p1:8100", "the scheme 'ftp' is not http or https: write http://p1:8100"),
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
    cfg = ProxyConfig(prefill=[parse_instance("http://p:1", "prefill")],
                      decode=[parse_instance("http://d:2", "decode")], kv_connector="nixl-push")
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


# -- the trust boundary ------------------------------------------------------------------------------

def _cfg(**changes) -> ProxyConfig:
    return ProxyConfig(decode=[parse_instance("http://d:2", "decode")]).replace(**changes)


@pytest.mark.parametrize("name", ["content-length", "Host", "transfer-encoding", "connection", "keep-alive", "te",
                                  "trailer", "upgrade", "proxy-authorization", "content-type", "x-request-id",
                                  "content-encoding", "x-data-parallel-rank", "bad header", "x:y", ""])
def test_framing_hop_by_hop_and_proxy_set_headers_cannot_be_forwarded(name):
    with pytest.raises(ValueError, match="--forward-header"):
        validate_config(_cfg(forward_headers=("traceparent", name)))


def test_authorization_is_forwarded_only_without_an_upstream_key():
    validate_config(_cfg(forward_headers=("authorization", "x-tenant")))
    with pytest.raises(ValueError, match="two Authorization headers"):
        validate_config(_cfg(forward_headers=("Authorization",), upstream_api_key="k"))


def test_the_cli_refuses_a_framing_header_at_start_up(capsys, monkeypatch):
    import importlib

    from epd_proxy.cli import main

    def serve(*args, **kwargs):
        raise AssertionError("the proxy would have started")

    monkeypatch.setattr(importlib.import_module("epd_proxy.runtime.serve"), "serve", serve)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--decode", "http://d:2", "--forward-header", "content-length"])
    assert exc.value.code == 2
    assert "message framing" in capsys.readouterr().err


def test_upstream_api_key_never_comes_from_openai_api_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-backends")
    monkeypatch.delenv("EPD_PROXY_UPSTREAM_API_KEY", raising=False)
    cfg = config_from_args(build_parser().parse_args(["serve", "--decode", "http://d:2"]))
    assert cfg.upstream_api_key is None
    monkeypatch.setenv("EPD_PROXY_UPSTREAM_API_KEY", "backend-key")
    cfg = config_from_args(build_parser().parse_args(["serve", "--decode", "http://d:2"]))
    assert cfg.upstream_api_key == "backend-key"
    cfg = config_from_args(build_parser().parse_args(["serve", "--decode", "http://d:2",
                                                      "--upstream-api-key", "explicit"]))
    assert cfg.upstream_api_key == "explicit"


def test_trust_flags_default_to_the_config_defaults_and_parse():
    defaults = ProxyConfig()
    cfg = config_from_args(build_parser().parse_args(["serve", "--decode", "http://d:2"]))
    for field in ("ignore_client_uuids", "max_media_items", "max_upstream_connections", "allowed_media_schemes",
                  "allowed_media_hosts"):
        assert getattr(cfg, field) == getattr(defaults, field), field
    assert defaults.allowed_media_schemes == ("http", "https", "data") and defaults.max_media_items == 999
    cfg = config_from_args(build_parser().parse_args([
        "serve", "--decode", "http://d:2", "--ignore-client-uuids", "--max-media-items", "8",
        "--max-upstream-connections", "16", "--allowed-media-schemes", "https,data",
        "--allowed-media-hosts", "127.0.0.0/8,localhost", "--allowed-media-hosts", "fd00::/8"]))
    assert cfg.ignore_client_uuids is True and cfg.max_media_items == 8 and cfg.max_upstream_connections == 16
    assert cfg.allowed_media_schemes == ("https", "data")
    assert cfg.allowed_media_hosts == ("127.0.0.0/8", "localhost", "fd00::/8")
    validate_config(cfg)


@pytest.mark.parametrize("changes, fragment", [
    ({"max_media_items": -1}, "--max-media-items"),
    ({"max_upstream_connections": 0}, "--max-upstream-connections"),
    ({"allowed_media_hosts": ("10.0.0.0/99",)}, "--allowed-media-hosts"),
])
def test_invalid_trust_settings_fail_before_serving(changes, fragment):
    with pytest.raises(ValueError, match=fragment):
        validate_config(_cfg(**changes))


async def test_the_connection_cap_reaches_every_instance_pool():
    from epd_proxy.runtime.build import build_app

    app = build_app(_cfg(max_upstream_connections=7, encode=[parse_instance("http://e:1", "encode")]))
    try:
        assert {i.connections.max_connections for p in app.pools.values() for i in p.instances} == {7}
    finally:
        await app.close()

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



def test_routing_policies_per_role_with_routing_as_the_fallback():
    def cfg(*flags, prefill=True):
        argv = ["serve", "--decode", "http://d:1"] + (["--prefill", "http://p:1"] if prefill else []) + list(flags)
        return config_from_args(build_parser().parse_args(argv))

    default = cfg()
    assert [default.policy_for(r) for r in ("encode", "prefill", "decode")] == [
        "cache-aware", "cache-aware", "load-aware"]
    assert cfg(prefill=False).policy_for("decode") == "cache-aware"  # PD prefills
    legacy = cfg("--routing", "round-robin")
    assert {legacy.policy_for(r) for r in ("encode", "prefill", "decode")} == {"round-robin"}
    mixed = cfg("--routing", "least-loaded", "--decode-policy", "power-of-two")
    assert (mixed.policy_for("prefill"), mixed.policy_for("decode")) == ("least-loaded", "power-of-two")
    tuned = cfg("--balance-abs", "2", "--balance-rel", "1.2", "--scrape-interval", "0")
    assert (tuned.balance_abs, tuned.balance_rel, tuned.scrape_interval) == (2, 1.2, 0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--decode", "http://d:1", "--prefill-policy", "random"])


@pytest.mark.parametrize("changes, fragment", [
    ({"encode_policy": "random"}, "unknown routing policy 'random'"),
    ({"balance_rel": 0.5}, "--balance-rel"),
    ({"scrape_interval": -1}, "--scrape-interval"),
])
def test_invalid_routing_settings_fail_before_serving(changes, fragment):
    cfg = ProxyConfig(decode=[parse_instance("http://d:1", "decode")], **changes)
    with pytest.raises(ValueError, match=fragment):
        validate_config(cfg)


@pytest.mark.parametrize("text", ["http://d:1/v1", "http://d:1/v1/", "http://d:1?x=1", "http://d:1/#f"])
def test_an_instance_url_with_a_path_is_refused(text):
    with pytest.raises(ValueError, match="without a path"):
        parse_instance(text, "decode")
    assert parse_instance("http://d:1/", "decode").url == "http://d:1"


@pytest.mark.parametrize("text, message", [
    ("http//host:1", "no ':' after the scheme: write http://host:1"),
    ("HTTPS//host:1", "no ':' after the scheme: write https://host:1"),
    ("http:/host:1", "the scheme needs '://': write http://host:1"),
    ("http:host:1", "the scheme needs '://': write http://host:1"),
    ("http;//host:1;models=a", "';' where the scheme's ':' belongs: write http://host:1"),
    ("htp://host:1", "the scheme 'htp' is not http or https: write http://host:1"),
    ("://host:1", "no scheme before '://': write http://host:1"),
    ("http:///host:1", "no host after http://: write http://host:port"),
    ("http://:1", "no host after http://"),
    ("http://host:99999", "invalid port"),
])
def test_a_mistyped_instance_url_is_named_for_what_it_is(text, message):
    with pytest.raises(ValueError) as err:
        parse_instance(text, "decode")
    assert str(err.value) == f"decode instance {text!r}: {message}" or message in str(err.value)
    assert "http://http" not in str(err.value)  # not read as a host named "http" with a path


def test_a_registration_says_the_same_of_a_mistyped_url():
    from epd_proxy.instances.roster import RegistrationError, parse_registration

    with pytest.raises(RegistrationError, match="no ':' after the scheme: write http://h:1"):
        parse_registration(b'{"role": "decode", "url": "http//h:1"}')


@pytest.mark.parametrize("text, url", [("host:1", "http://host:1"), ("https://h:2/", "https://h:2"),
                                       ("[::1]:8000", "http://[::1]:8000"), ("http:8000", "http://http:8000")])
def test_plain_addresses_are_no_mistake(text, url):
    assert url_mistake(text) is None and parse_instance(text, "decode").url == url


def test_every_mistake_of_a_config_is_named_at_once():
    from epd_proxy.config import ConfigErrors

    cfg = _cfg(prefill=[parse_instance("http://d:2", "prefill")], fail_threshold=0, probe_timeout=float("nan"),
               kv_connector="nixl-push")
    with pytest.raises(ConfigErrors) as info:
        validate_config(cfg)
    assert info.value.errors == [
        "--probe-timeout must be a finite number, not nan",
        "--fail-threshold must be >= 1, not 0",
        "http://d:2 is given as both prefill and decode instance: an instance has one role (one that prefills "
        "and decodes is given as --decode only)",
        info.value.errors[3],
    ] and "--kv-connector nixl-push needs" in info.value.errors[3]


# -- the sections --------------------------------------------------------------------------------

def test_each_section_names_its_own_mistakes():
    """A section checks its values alone, each mistake naming its flag."""
    from epd_proxy.config import AccessConfig, HealthConfig, MultiTurnConfig, StateStoreConfig, UpstreamConfig

    assert MultiTurnConfig().problems() == []
    assert MultiTurnConfig(kv_reuse_ttl=0, local_prefill_max_streams=-1).problems() == [
        "--kv-reuse-ttl must be > 0, not 0", "--local-prefill-max-streams must be >= 0, not -1"]
    assert HealthConfig(ejection_time=20, max_ejection_time=10).problems() == [
        "--max-ejection-time must be >= --ejection-time (20), not 10"]
    assert AccessConfig(ssl_keyfile="k.pem").problems() == ["--ssl-keyfile needs --ssl-certfile"]
    assert StateStoreConfig(state_store="redis://:pw@h:6379/0").problems() == [
        "--state-store: no password in the URL; use --state-store-password-file or $EPD_PROXY_STATE_STORE_PASSWORD"]
    upstream = UpstreamConfig(upstream_api_key="k", forward_headers=("authorization",))
    assert upstream.problems()[0].startswith("--forward-header authorization cannot be combined")
    assert UpstreamConfig().timeouts.problems() == []


def test_a_config_is_built_and_read_by_the_flags_names_or_by_section():
    from epd_proxy.config import AdmissionConfig, MultiTurnConfig

    cfg = ProxyConfig(kv_reuse_ttl=60, multi_turn=MultiTurnConfig(kv_reuse=False))
    assert cfg.multi_turn == MultiTurnConfig(kv_reuse=False, kv_reuse_ttl=60)
    assert (cfg.kv_reuse, cfg.kv_reuse_ttl, cfg.timeouts) == (False, 60, cfg.upstream.timeouts)
    more = cfg.replace(max_inflight=3)
    assert more.admission == AdmissionConfig(max_inflight=3) and cfg.admission == AdmissionConfig()
    assert more.multi_turn is cfg.multi_turn  # the sections not named are shared, as the lists are
    assert more == cfg.replace(admission=AdmissionConfig(max_inflight=3)) != cfg
    with pytest.raises(TypeError, match="no_such_knob"):
        ProxyConfig(no_such_knob=1)
    with pytest.raises(TypeError, match="MultiTurnConfig"):
        ProxyConfig(multi_turn=AdmissionConfig())


def test_every_section_field_is_declared_once_with_its_type():
    """Each section field is a ``ProxyConfig`` attribute of its name (declared for the type
    checker), in exactly one section, and no top-level field or section shares its name."""
    import dataclasses

    from epd_proxy.config import SECTION_OF, SECTIONS
    from epd_proxy.config.proxy import _SectionFields

    fields = [(f.name, f.type) for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(SECTION_OF) == len(fields)
    assert _SectionFields.__annotations__ == dict(fields)
    assert not set(SECTION_OF) & {f.name for f in dataclasses.fields(ProxyConfig)}
    cfg = ProxyConfig()
    assert all(getattr(cfg, name) is getattr(getattr(cfg, SECTION_OF[name]), name) for name in SECTION_OF)
