"""``epd-proxy serve``: the reference proxy's flags, and starting with an empty roster."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from helpers import Client, chat_body
from procs import free_port

import epd_proxy
from epd_proxy.cli import COMMANDS, build_parser
from epd_proxy.cli.serve import config_from_args
from epd_proxy.sim import SimCluster, SimConfig


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", *argv]))


def test_reference_proxy_flags_are_aliases():
    """disagg_epd_proxy.py's command line works with the command name changed."""
    cfg = parse("--encode-servers-urls", "http://e1:8001,http://e2:8001", "--prefill-servers-urls", "disable",
                "--decode-servers-urls", "http://d1:8005", "--ec-consumer-zmq-addrs", "tcp://d1:7000",
                "--ec-consumer-dp-size", "1", "--decode-retries", "2", "--no-rewrite", "--log-requests",
                "--probe-interval", "3", "--probe-timeout", "1", "--fail-threshold", "4", "--evicted-ttl", "60")
    assert [s.url for s in cfg.encode] == ["http://e1:8001", "http://e2:8001"]
    assert cfg.prefill == [] and [s.url for s in cfg.decode] == ["http://d1:8005"]
    assert cfg.ec_consumer_zmq_addrs == ["tcp://d1:7000"] and cfg.decode_retries == 2 and not cfg.rewrite
    assert (cfg.probe_interval, cfg.probe_timeout, cfg.fail_threshold, cfg.evicted_ttl) == (3, 1, 4, 60)
    assert cfg.log_requests
    assert parse("--decode", "d:1", "--prefill-servers-urls", "none").prefill == []


def test_membership_flags_and_defaults(monkeypatch):
    cfg = parse("--dynamic-registration", "--admin-api-key", "K", "--registration-allow", "10.0.0.0/8",
                "--registration-allow", "192.168.0.0/16", "--topology", "P/D")
    assert cfg.dynamic_registration and cfg.admin_api_key == "K"
    assert cfg.registration_allow == ("10.0.0.0/8", "192.168.0.0/16") and cfg.topology == "P+D"
    cfg.validate()
    d = parse("--decode", "d:1")
    assert (d.evicted_ttl, d.topology, d.admin_api_key, d.dynamic_registration) == (900.0, "auto", None, False)
    monkeypatch.setenv("ADMIN_API_KEY", "from-env")
    assert parse("--decode", "d:1").admin_api_key == "from-env"


def test_access_log_and_token_metric_flags():
    cfg = parse("--decode", "d:1", "--trusted-proxies", "10.0.0.0/8, 192.168.0.0/16", "--trusted-proxies", "::1",
                "--metrics-max-models", "5")
    assert cfg.trusted_proxies == ("10.0.0.0/8", "192.168.0.0/16", "::1") and cfg.metrics_max_models == 5
    cfg.validate()
    d = parse("--decode", "d:1")
    assert (d.trusted_proxies, d.metrics_max_models) == ((), 32)


def test_encode_stage_flags():
    d = parse("--decode", "d:1")
    assert (d.encoder_max_outstanding, d.encoder_fallback) == (64, "none")
    cfg = parse("--decode", "d:1", "--encoder-max-outstanding", "8", "--encoder-fallback", "local")
    assert (cfg.encoder_max_outstanding, cfg.encoder_fallback) == (8, "local")
    assert parse("--decode", "d:1", "--encoder-max-outstanding", "0").encoder_max_outstanding == 0


@pytest.mark.parametrize("argv, message", [
    (["--dynamic-registration"], "needs --admin-api-key"),
    ([], "at least one --decode"),
    (["--dynamic-registration", "--registration-allow", "nonsense"], "not a network"),
    (["--decode", "d:1", "--evicted-ttl", "-1"], "--evicted-ttl"),
    (["--decode", "d:1", "--trusted-proxies", "10.0.0.0/8,nonsense"], "--trusted-proxies 'nonsense': not a network"),
    (["--decode", "d:1", "--metrics-max-models", "0"], "--metrics-max-models must be >= 1"),
    (["--decode", "d:1", "--prefill", "p:1", "--topology", "E+PD"], "pinned to E+PD"),
    (["--decode", "d:1", "--encoder-max-outstanding", "-1"], "--encoder-max-outstanding"),
    (["--decode", "d:1", "--encoder-fallback", "remote"], "--encoder-fallback"),
])
def test_unusable_command_lines(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("ADMIN_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exc:
        epd_proxy.cli.main(["serve", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


async def test_serve_starts_empty_and_fills_by_registration():
    """`epd-proxy serve --dynamic-registration` with no URLs: it starts, says it waits
    for registrations, is not ready, and serves once instances have registered."""
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        src = str(Path(epd_proxy.__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        env.pop("ADMIN_API_KEY", None)
        port = free_port()
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epd_proxy", "serve", "--port", str(port), "--dynamic-registration",
            "--admin-api-key", "K", "--log-level", "warning", stdout=asyncio.subprocess.PIPE, env=env)
        client = Client(f"http://127.0.0.1:{port}")
        try:
            line = await asyncio.wait_for(child.stdout.readline(), 20)
            assert b"waiting for registrations" in line, line
            assert (await client.request("GET", "/ready")).status == 503
            key = [(b"x-api-key", b"K")]
            for role in ("prefill", "decode"):
                body = {"role": role, "url": cluster.urls(role)[0], "ec_zmq_addrs": [], "dp_size": 1}
                assert (await client.post("/instances", body, key)).status == 200
            assert (await client.request("GET", "/ready")).status == 200
            assert (await client.chat(chat_body())).status == 200
            status = (await client.request("GET", "/status", headers=key)).json()
            assert status["topology"] == "P+D"
        finally:
            await client.close()
            child.terminate()
            try:
                await asyncio.wait_for(child.wait(), 10)
            except TimeoutError:
                child.kill()
                await child.wait()


def test_every_command_module_offers_add_arguments_and_run():
    for name, (module, _) in COMMANDS.items():
        assert callable(module.add_arguments) and callable(module.run), name
    assert set(build_parser().parse_args(["check-config", "x.toml"]).__dict__) == {"command", "file"}
