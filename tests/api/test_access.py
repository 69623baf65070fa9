"""Who may change the roster and look at it: the policy (pure: header and peer in, verdict out),
and what a running proxy shows under each key setting (real child processes)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epd_proxy.api.access import ADMIN, READ, REGISTER, AccessPolicy, peer_ip

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))


def status(policy: AccessPolicy, action: str, key: bytes | None, peer: str | None = "10.1.2.3"):
    err = policy.check(action, key, peer)
    return None if err is None else err.status


@pytest.mark.parametrize("action", [REGISTER, ADMIN, READ])
def test_with_an_admin_key(action):
    p = AccessPolicy("s3cret")
    assert status(p, action, b"s3cret") is None
    assert status(p, action, None) == 401  # no key sent: a key would help
    assert status(p, action, b"wrong") == 403
    assert status(p, action, b"") == 403


def test_without_a_key_changes_are_off_and_views_open():
    p = AccessPolicy(None)
    assert not p.registration_on
    assert status(p, REGISTER, None) == 403
    assert status(p, REGISTER, b"anything") == 403
    assert status(p, ADMIN, None) == 403
    assert status(p, READ, None) is None
    assert "no admin API key" in p.check(REGISTER, None, "10.1.2.3").message


def test_keyless_registration_from_listed_networks_only():
    p = AccessPolicy(None, ["10.0.0.0/8", "fd00::/8"])
    assert p.registration_on
    assert status(p, REGISTER, None, "10.9.9.9") is None
    assert status(p, REGISTER, None, "::ffff:10.9.9.9") is None  # IPv4-mapped
    assert status(p, REGISTER, None, "fd00::5") is None
    assert status(p, REGISTER, None, "192.168.1.1") == 403
    assert status(p, REGISTER, None, None) == 403
    assert status(p, ADMIN, None, "10.9.9.9") == 403  # profiling needs the key


def test_listed_networks_beside_a_key():
    p = AccessPolicy("k", ["127.0.0.0/8"])
    assert status(p, REGISTER, None, "127.0.0.1") is None
    assert status(p, REGISTER, None, "10.0.0.1") == 401
    assert status(p, REGISTER, b"bad", "127.0.0.1") == 403  # a wrong key is never waved through
    assert status(p, READ, None, "127.0.0.1") == 401


def test_rejections_use_the_envelope():
    err = AccessPolicy("k").check(REGISTER, b"x", "1.2.3.4")
    env = err.envelope()["error"]
    assert env["type"] == "PermissionDeniedError" and env["code"] == 403


def test_peer_ip():
    assert peer_ip(("10.0.0.1", 5000)) == "10.0.0.1"
    assert peer_ip(("::1", 5000, 0, 0)) == "::1"
    assert peer_ip(None) is None


def test_client_keys_without_an_admin_key_close_the_views_to_everyone():
    p = AccessPolicy(None, ["127.0.0.0/8"], client_keys=True)
    err = p.check(READ, None, "127.0.0.1")
    assert err.status == 403 and "--admin-api-key" in err.message
    assert status(p, READ, b"a-client-key", "127.0.0.1") == 403
    assert status(p, REGISTER, None, "127.0.0.1") is None  # keyless registration is its own rule
    assert status(AccessPolicy("k", client_keys=True), READ, b"k") is None


# -- the roster's visibility, as a running proxy answers (real child processes) --------------------

VIEWS = ("/instances", "/status", "/metrics", "/console/api/state")  # the console's JSON: api/console.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@contextlib.contextmanager
def _proxy(*flags: str):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "epd_proxy", "serve", "--port", str(port), "--shutdown-grace",
                             "0", "--simulate", "prefill=1,decode=1", "--log-level", "error", *flags],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
            try:
                if _get(port, "/health", {})[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < end, "the proxy did not start"
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


ADMIN_X = {"X-API-Key": "adm"}
ADMIN_BEARER = {"Authorization": "Bearer adm"}
CLIENT = {"Authorization": "Bearer cli"}


@pytest.mark.parametrize("flags, expect", [
    # (headers, status) for each of the views
    ((), [({}, 200), (CLIENT, 200)]),
    (("--api-key", "cli"), [({}, 403), (CLIENT, 403), (ADMIN_X, 403), (ADMIN_BEARER, 403)]),
    (("--admin-api-key", "adm"), [({}, 401), (CLIENT, 403), (ADMIN_X, 200), (ADMIN_BEARER, 200)]),
    (("--api-key", "cli", "--admin-api-key", "adm"), [({}, 401), (CLIENT, 403), (ADMIN_X, 200),
                                                      (ADMIN_BEARER, 200)]),
], ids=["no-key", "client-key-only", "admin-key-only", "both"])
def test_who_sees_the_roster(flags, expect):
    with _proxy(*flags) as port:
        for headers, want in expect:
            for path in VIEWS:
                status = want
                if path == "/metrics" and want == 403 and "--admin-api-key" in flags:
                    status = 401  # a wrong key on the scrape: 401 with its Bearer challenge, as before
                got, body = _get(port, path, headers)
                assert got == status, (path, headers, body)
                if status == 200:
                    assert b"127.0.0.1" in body  # the views do list the instances' addresses
                else:
                    err = json.loads(body)["error"]
                    assert set(err) == {"message", "type", "param", "code"}, body
                    assert b"127.0.0.1" not in body
        # The probes and the console's page (its data is the JSON above) stay open and never list an address.
        for path in ("/health", "/ready", "/console"):
            got, body = _get(port, path, {})
            assert got == 200 and b"127.0.0.1" not in body and b"http" not in body, (path, body)


def test_profiling_refusal_speaks_of_profiling_not_the_roster():
    err = AccessPolicy().check(ADMIN, None, "10.0.0.1")
    assert err is not None and err.status == 403
    assert "profiling" in err.message and "roster" not in err.message


def test_the_admin_refusal_names_lora_loads_too():
    """The same key guards POST /v1/load_lora_adapter: its refusal must not speak of profiling alone."""
    err = AccessPolicy().check(ADMIN, None, "10.0.0.1")
    assert err is not None and "LoRA adapter loads and unloads" in err.message
