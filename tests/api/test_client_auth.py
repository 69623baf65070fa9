"""Who may call the proxy: client keys (pure parts), and the 401s over real sockets."""

from __future__ import annotations

import msgspec
import pytest
from helpers import chat_body, stack

from epd_proxy.api.client_auth import ClientKeys, admin_key_presented, bearer_token, read_key_file
from epd_proxy.config import InstanceSpec, ProxyConfig


def allows(keys: ClientKeys, authorization: bytes | None) -> bool:
    """Whether an ``Authorization`` header carries one of the keys."""
    return keys.identify(authorization) is not None


def test_bearer_token_takes_the_scheme_in_any_case():
    assert bearer_token(b"Bearer abc") == b"abc"
    assert bearer_token(b"bearer  abc ") == b"abc"
    assert bearer_token(b"Basic abc") is None
    assert bearer_token(b"Bearer ") is None
    assert bearer_token(None) is None


def test_keys_from_the_flag_and_the_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# rotated monthly\nfile-key-1\n\n  file-key-2  \n")
    keys = ClientKeys(("flag-key",), str(f))
    assert len(keys) == 3
    for k in (b"flag-key", b"file-key-1", b"file-key-2"):
        assert allows(keys, b"Bearer " + k)
    assert not allows(keys, b"Bearer file-key")  # a prefix is not a key
    assert not allows(keys, b"Bearer # rotated monthly")
    assert not allows(keys, b"flag-key")  # no scheme
    assert not allows(keys, None)


def test_a_key_with_whitespace_is_refused(tmp_path):
    f = tmp_path / "keys"
    f.write_text("two words\n")
    with pytest.raises(ValueError, match="whitespace"):
        read_key_file(str(f))


def test_reload_replaces_the_file_keys_and_keeps_the_flag_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("old\n")
    keys = ClientKeys(("fixed",), str(f))
    f.write_text("new\n")
    keys.reload()
    assert allows(keys, b"Bearer new") and allows(keys, b"Bearer fixed") and not allows(keys, b"Bearer old")
    f.write_text("")  # every file key revoked
    keys.reload()
    assert not allows(keys, b"Bearer new") and allows(keys, b"Bearer fixed")


def test_an_unreadable_file_at_reload_keeps_the_keys_in_force(tmp_path):
    f = tmp_path / "keys"
    f.write_text("current\n")
    keys = ClientKeys((), str(f))
    f.unlink()
    with pytest.raises(ValueError, match="cannot read it .*the keys in force stay"):
        keys.reload()
    assert allows(keys, b"Bearer current")


def test_no_keys_configured_means_an_open_api_and_a_missing_file_is_a_config_error(tmp_path):
    assert ClientKeys.from_config(ProxyConfig()) is None
    with pytest.raises(ValueError, match="cannot read .*no such file"):
        ClientKeys.from_config(ProxyConfig(api_key_file=str(tmp_path / "absent")))


def test_admin_key_as_x_api_key_or_bearer():
    assert admin_key_presented({b"x-api-key": b"adm"}, b"adm")
    assert admin_key_presented({b"authorization": b"Bearer adm"}, b"adm")
    assert not admin_key_presented({b"x-api-key": b"nope"}, b"adm")
    assert not admin_key_presented({}, b"adm")


def test_protect_metrics_needs_an_admin_key():
    with pytest.raises(ValueError, match="--protect-metrics needs --admin-api-key"):
        ProxyConfig(decode=[InstanceSpec("http://d:1", "decode")], protect_metrics=True).validate()


def _assert_401(reply, code="invalid_api_key"):
    assert reply.status == 401
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert reply.headers[b"www-authenticate"].startswith(b"Bearer")


async def test_api_key_gives_401_for_missing_or_wrong_keys_and_200_for_a_right_one():
    async with stack(api_keys=("k-one", "k-two")) as (cluster, proxy, client):
        missing = await client.chat(chat_body())
        _assert_401(missing)
        assert "missing" in missing.json()["error"]["message"]
        wrong = await client.chat(chat_body(), headers=[(b"authorization", b"Bearer k-three")])
        _assert_401(wrong)
        assert wrong.json()["error"]["message"] == "invalid API key"
        assert cluster.records() == []  # nothing reached a backend
        for key in (b"k-one", b"k-two"):
            ok = await client.chat(chat_body(), headers=[(b"authorization", b"Bearer " + key)])
            assert ok.status == 200, ok.body
        stream = await client.chat(chat_body(stream=True), headers=[(b"authorization", b"Bearer k-two")])
        assert stream.status == 200 and stream.body.endswith(b"data: [DONE]\n\n")
        # Every /v1/ path, routed or not, asks for the key first.
        _assert_401(await client.request("GET", "/v1/models"))
        _assert_401(await client.request("GET", "/v1/nothing-here"))
        assert (await client.request("GET", "/v1/models", headers=[(b"authorization", b"Bearer k-one")])
                ).status == 200
        # The probes stay open; the scrape shows instance URLs and there is no admin key: refused.
        for path in ("/health", "/ready"):
            assert (await client.request("GET", path)).status == 200, path
        assert (await client.request("GET", "/metrics")).status == 403


async def test_the_client_key_is_not_forwarded_upstream():
    async with stack(api_keys=("secret-key",)) as (cluster, proxy, client):
        ok = await client.chat(chat_body(), headers=[(b"authorization", b"Bearer secret-key")])
        assert ok.status == 200
        records = cluster.records()
        assert len(cluster.records("prefill")) == len(cluster.records("decode")) == 1
        for rec in records:
            assert "x-request-id" in rec.headers  # the record holds the headers received
            assert "authorization" not in {k.lower() for k in rec.headers}


async def test_protect_metrics_wants_the_admin_key():
    async with stack(admin_api_key="adm-key", protect_metrics=True) as (cluster, proxy, client):
        _assert_401(await client.request("GET", "/metrics"))
        _assert_401(await client.request("GET", "/metrics", headers=[(b"x-api-key", b"wrong")]))
        ok = await client.request("GET", "/metrics", headers=[(b"x-api-key", b"adm-key")])
        assert ok.status == 200 and b"epd_proxy_" in ok.body
        ok = await client.request("GET", "/metrics", headers=[(b"authorization", b"Bearer adm-key")])
        assert ok.status == 200
        assert (await client.request("GET", "/health")).status == 200
        # No client key configured: the API stays open.
        assert (await client.chat(chat_body())).status == 200


async def test_head_on_health_and_ready():
    async with stack() as (cluster, proxy, client):
        for path in ("/health", "/ready"):
            reply = await client.request("HEAD", path)
            assert reply.status == 200, path
            assert reply.body == b""
            assert int(reply.headers[b"content-length"]) == len((await client.request("GET", path)).body)


def test_error_envelope_is_json():
    from epd_proxy.api.client_auth import MISSING_KEY_BODY

    assert msgspec.json.decode(MISSING_KEY_BODY)["error"]["type"] == "invalid_request_error"


def test_keys_have_names_the_key_never_shows(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# comment\nteam-a:sk-aaa\nsk-plain\nteam-b:sk:with:colons\nsk-flag\n")
    keys = ClientKeys(("sk-flag", "sk-flag-2"), str(f))
    assert [keys.identify(b"Bearer " + k) for k in (b"sk-aaa", b"sk-plain", b"sk:with:colons", b"sk-flag",
                                                     b"sk-flag-2", b"team-a", b"nope")] == \
        ["team-a", "line3", "team-b", "key1", "key2", None, None]  # a key listed twice keeps its first name
    assert keys.identify(None) is None
    f.write_text(":sk-nameless\n")
    with pytest.raises(ValueError, match="line 1: 'name:key' needs both"):
        read_key_file(str(f))
    f.write_text("team-a:\n")
    with pytest.raises(ValueError, match="needs both"):
        read_key_file(str(f))


def test_x_api_key_is_a_client_key_too_and_authorization_wins():
    keys = ClientKeys(("k1", "k2"))
    assert keys.identify(None, b"k2") == "key2"
    assert keys.identify(b"Bearer k1", b"k2") == "key1"
    assert keys.identify(b"Bearer nope", b"k2") is None
    assert keys.identify(None, b"nope") is None and keys.identify(None, None) is None
