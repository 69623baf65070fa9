"""With client keys, what two keys send under the same name stays apart on the instances
(what the simulated instances received is what a real engine would act on): a client media
``uuid`` is namespaced by the key's scope, so two tenants sending the same uuid never share an
encoder-cache entry, and an ``*_embeds`` part carrying only a uuid reaches only its own key's
items; with ``--cache-salt-per-key``, vLLM's ``cache_salt`` keeps each key's prefix cache apart."""

from __future__ import annotations

import pytest
from blake3 import blake3
from helpers import chat_body, stack

from epd_proxy.config import InstanceSpec, ProxyConfig
from epd_proxy.tenants.key_scope import key_scope

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210"
A = [(b"authorization", f"Bearer {KEY_A}".encode())]
B = [(b"authorization", f"Bearer {KEY_B}".encode())]
SCOPE_A, SCOPE_B = key_scope("key1", KEY_A.encode()), key_scope("key2", KEY_B.encode())


def client_key(uuid: str, scope: bytes = b"") -> str:
    """What an engine is sent for a client's ``uuid`` (multimodal.client_key), spelled out."""
    return "client-" + blake3(scope + uuid.encode()).hexdigest()


def _media_body(*parts) -> dict:
    return {"model": "sim-model", "max_tokens": 6,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]}


def _img(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def _uuids(rec) -> list:
    return [p.get("uuid") for m in rec.json["messages"] if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") != "text"]


async def test_two_keys_sending_the_same_uuid_never_share_an_encoder_cache_entry():
    async with stack(encode=1, api_keys=(KEY_A, KEY_B)) as (cluster, proxy, client):
        a = await client.chat(_media_body(_img("https://a.example/secret.png", uuid="shared-id")), A)
        assert a.status == 200, a.body
        stored_a = _uuids(cluster.records("encode")[-1])
        b = await client.chat(_media_body(_img("https://b.example/planted.png", uuid="shared-id")), B)
        assert b.status == 200, b.body
        stored_b = _uuids(cluster.records("encode")[-1])
        assert stored_a != stored_b and client_key("shared-id") not in stored_a + stored_b
        assert stored_a == [client_key("shared-id", SCOPE_A)] and stored_b == [client_key("shared-id", SCOPE_B)]
        # Each key's consumer references its own key's entry only.
        assert _uuids(cluster.records("prefill")[-1]) == stored_b


async def test_an_embeds_part_with_only_a_uuid_reaches_only_its_own_keys_items():
    async with stack(prefill=0, decode=0, pd=1, api_keys=(KEY_A, KEY_B)) as (cluster, proxy, client):
        a = await client.chat(_media_body(_img("https://a.example/secret.png", uuid="shared-id")), A)
        assert a.status == 200, a.body
        held_by_a = _uuids(cluster.records("pd")[-1])
        # B names A's uuid on a part without data (vLLM would look the item up by it).
        await client.chat(_media_body({"type": "image_embeds", "uuid": "shared-id"}), B)
        sent = [r for r in cluster.records("pd") if r.path == "/v1/chat/completions"][-1]
        assert not set(_uuids(sent)) & set(held_by_a)
        assert _uuids(sent) == [client_key("shared-id", SCOPE_B)]


async def test_cache_salt_per_key_salts_every_leg_with_the_keys_scope():
    async with stack(api_keys=(KEY_A, KEY_B), cache_salt_per_key=True) as (cluster, proxy, client):
        assert (await client.chat(chat_body(max_tokens=3), A)).status == 200
        assert {r.json.get("cache_salt") for r in cluster.records()} == {SCOPE_A.hex()}
        assert (await client.chat(chat_body(max_tokens=3, cache_salt="mine"), B)).status == 200
        salts = {r.json.get("cache_salt") for r in cluster.records()[-2:]}
        assert salts == {SCOPE_B.hex() + ".mine"}
        r = await client.post("/v1/completions", {"model": "sim-model", "prompt": "hello", "max_tokens": 3}, A)
        assert r.status == 200, r.body
        assert {r.json.get("cache_salt") for r in cluster.records()[-2:]} == {SCOPE_A.hex()}


async def test_without_the_option_no_salt_is_added():
    async with stack(api_keys=(KEY_A,)) as (cluster, proxy, client):
        assert (await client.chat(chat_body(max_tokens=3), A)).status == 200
        assert all("cache_salt" not in r.json for r in cluster.records())


def test_a_scope_is_the_name_the_operator_gave_else_the_key():
    assert key_scope("team-a", b"k1") == key_scope("team-a", b"k2")  # a rotated key of one tenant
    assert key_scope("line2", b"k1") != key_scope("line2", b"k2")  # a position is no tenant
    assert key_scope("key1", b"k1") != key_scope("key1", b"k2")
    assert key_scope("team-a", b"k1") != key_scope("team-b", b"k1") and len(key_scope("x", b"y")) == 16


def test_cache_salt_per_key_needs_client_keys():
    with pytest.raises(ValueError, match="--cache-salt-per-key needs client keys"):
        ProxyConfig(decode=[InstanceSpec("http://d:1", "decode")], cache_salt_per_key=True).validate()
    ProxyConfig(decode=[InstanceSpec("http://d:1", "decode")], cache_salt_per_key=True, api_keys=("k",)).validate()
