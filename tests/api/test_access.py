"""Who may change the roster and look at it (pure: header and peer in, verdict out)."""

from __future__ import annotations

import pytest

from epd_proxy.api.access import ADMIN, READ, REGISTER, AccessPolicy, peer_ip


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
