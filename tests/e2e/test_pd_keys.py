"""Client keys against real vLLM: with --api-key-file every path the proxy forwards or
generates on needs a key (not /v1 only, as vLLM's own check), and a key presented on a routed
endpoint is that key: its limits and its models apply there as on chat."""

from __future__ import annotations

import pytest
import vllm_e2e as E

from epd_proxy.routing.endpoints import ROUTED

CLUSTER = "pd"
ORDER = 14  # with test_routed_endpoints: asks nothing that changes the instances
pytestmark = pytest.mark.vllm

KEYS = "team-a:secret-a\nspent:secret-s\nnarrow:secret-n\n"
TENANTS = """
[[tenants.keys]]
name = "spent"
requests_per_minute = 1

[[tenants.keys]]
name = "narrow"
models = ["another-model"]
"""
GENERATED = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/inference/v1/generate")


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture(scope="module")
def proxy(pd, start_proxy, tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    (d / "keys").write_text(KEYS)
    (d / "cluster.toml").write_text(TENANTS)
    return start_proxy("pd-keys", prefill=[pd.prefill.url], decode=[pd.decode.url],
                       extra=["--api-key-file", str(d / "keys"), "--config", str(d / "cluster.toml")])


def test_every_forwarded_path_needs_a_key(pd, proxy):
    body = {"model": E.MODEL_NAME, "prompt": "keys everywhere", "input": "keys everywhere", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    for path in sorted(set(ROUTED) | set(GENERATED) | {"/load", "/v1/models", "/not-a-route"}):
        method = ROUTED[path].method if path in ROUTED else "GET" if path in ("/load", "/v1/models") else "POST"
        reply = E.request(proxy.url, method, path, body if method == "POST" else None)
        assert reply.status == 401, (path, E.describe(reply))
    for path in ("/health", "/ready"):
        assert E.request(proxy.url, "GET", path).status == 200, path
    # With a key: the instance's own answers.
    tokenize = {"model": E.MODEL_NAME, "prompt": "a key on a routed endpoint"}
    through = E.post(proxy.url, "/tokenize", tokenize, headers=bearer("secret-a"))
    assert through.status == 200, E.describe(through)
    assert through.body == E.post(pd.decode.url, "/tokenize", tokenize).body
    version = E.request(proxy.url, "GET", "/version", headers=bearer("secret-a"))
    assert version.status == 200 and version.body == E.request(pd.decode.url, "GET", "/version").body


def test_a_key_on_a_routed_endpoint_is_that_key(pd, proxy):
    tokenize = {"model": E.MODEL_NAME, "prompt": "whose key is this"}
    # A key limited to another model: 403 on /tokenize as on chat, before its limits.
    for path, body in (("/tokenize", tokenize),
                       ("/v1/chat/completions", {"model": E.MODEL_NAME, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]})):
        refused = E.post(proxy.url, path, body, headers=bearer("secret-n"))
        assert refused.status == 403 and refused.json()["error"]["code"] == "model_not_allowed", E.describe(refused)
    # A key with one request a minute: spent on /tokenize, then refused there and on chat.
    first = E.post(proxy.url, "/tokenize", tokenize, headers=bearer("secret-s"))
    assert first.status == 200, E.describe(first)
    again = E.post(proxy.url, "/tokenize", tokenize, headers=bearer("secret-s"))
    assert again.status == 429 and again.headers.get("x-ratelimit-limit-requests") == "1", E.describe(again)
    chat = E.post(proxy.url, "/v1/chat/completions", {"model": E.MODEL_NAME, "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]},
                  headers=bearer("secret-s"))
    assert chat.status == 429, E.describe(chat)
