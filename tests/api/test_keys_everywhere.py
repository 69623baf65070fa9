"""With client keys, every path the proxy answers needs one, and a key presented anywhere is
that key: its limits, its class, its name in the access log. The route table is walked, so a
path added later is covered without a test of its own."""

from __future__ import annotations

import io

import msgspec
import pytest
from helpers import chat_body, stack

from epd_proxy.api.app import OPEN_PATHS
from epd_proxy.observe.access_log import AccessLog
from epd_proxy.request.apis import GENERATION_APIS
from epd_proxy.routing.endpoints import ROUTED

# What stays open without a client key: docs/operations.md's table says the same.
DOCUMENTED_OPEN = {"/health", "/ready"}
KEYS = "team-a:secret-a\nspent:secret-s\n"
TENANTS = {"keys": [{"name": "spent", "requests_per_minute": 1}]}
# Paths matched by prefix rather than listed in the table.
PREFIXED = [("GET", "/v1/models/sim-model"), ("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
            ("POST", "/v1/responses/resp_x/cancel"), ("GET", "/v1/not-a-route"), ("POST", "/not-a-route"),
            ("GET", "/v2/anything"), ("POST", "/inference/v1/anything")]


def bearer(secret: str) -> list:
    return [(b"authorization", f"Bearer {secret}".encode())]


def _body_for(path: str) -> bytes:
    if path.startswith("/v1/audio/"):
        return b""  # a form would need its content type: an empty body is refused all the same
    return msgspec.json.encode(dict(chat_body(), model="sim-model", prompt="hi", input="hi", text="hi"))


def _every_route(app) -> list[tuple[str, str]]:
    routes = sorted(app._routes) + PREFIXED
    routes += [("POST", path) for path in GENERATION_APIS]
    return sorted(set(routes))


def test_only_the_documented_paths_are_open():
    assert OPEN_PATHS == DOCUMENTED_OPEN


async def test_every_path_but_the_open_ones_needs_a_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    async with stack(api_key_file=str(keys), tenants=TENANTS, admin_api_key="adm") as (cluster, proxy, client):
        app = proxy.app
        page = {path for (_, path), handler in app._routes.items()
                if app.console is not None and handler == app.console.page}
        checked = 0
        for method, path in _every_route(app):
            body = _body_for(path) if method == "POST" else b""
            reply = await client.request(method, path, body, [(b"content-type", b"application/json")])
            if path in DOCUMENTED_OPEN or path in page:
                assert reply.status == 200, (method, path, reply.status)
                continue
            # The API's paths: 401 before the route. The admin key's: 401 too (it is configured).
            assert reply.status == 401, (method, path, reply.status, reply.body[:200])
            checked += 1
        assert checked > 40
        assert cluster.records() == []  # nothing without a key reached an instance
        # A client key never opens what the admin key guards.
        for method, path in _every_route(app):
            if path in app._keyless and path not in DOCUMENTED_OPEN and path not in page:
                body = b"{}" if method == "POST" else b""
                with_key = await client.request(method, path, body, bearer("secret-a"))
                assert with_key.status in (401, 403), (method, path, with_key.status)


@pytest.mark.parametrize("path", sorted(set(ROUTED) | set(GENERATION_APIS) | {"/v1/chat/completions",
                                                                               "/v1/completions"}))
async def test_a_key_presented_on_any_path_is_that_key(tmp_path, path):
    """The key's limits apply (its one request a minute spent: 429) and the access log names it,
    on every path the proxy forwards or generates on."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    async with stack(api_key_file=str(keys), tenants=TENANTS) as (cluster, proxy, client):
        out = io.StringIO()
        proxy.app.pipeline.access_log = AccessLog("json", stream=out)
        assert (await client.chat(chat_body(), bearer("secret-s"))).status == 200  # its one request
        method = ROUTED[path].method if path in ROUTED else "POST"
        body = _body_for(path) if method == "POST" else b""
        headers = [(b"content-type", b"application/json")]
        limited = await client.request(method, path, body, headers + bearer("secret-s"))
        assert limited.status == 429, (path, limited.status, limited.body[:200])
        await client.request(method, path, body, headers + bearer("secret-a"))
        lines = [msgspec.json.decode(line) for line in out.getvalue().splitlines()]
        mine = [line for line in lines if line.get("path") == path]
        assert [line.get("key") for line in mine][-2:] == ["spent", "team-a"], mine


async def test_version_and_load_need_a_key_and_answer_with_one(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    async with stack(api_key_file=str(keys)) as (cluster, proxy, client):
        for path in ("/version", "/load"):
            assert (await client.request("GET", path)).status == 401, path
            assert (await client.request("GET", path, headers=bearer("secret-a"))).status == 200, path


@pytest.mark.parametrize("method,path", [("GET", "/v1/responses/resp_x"), ("POST", "/v1/responses/resp_x/cancel")])
async def test_a_stored_response_path_spends_its_keys_limits(tmp_path, method, path):
    """Reading or cancelling a stored response is a request of its key: its limits apply and the
    access log names it (an unknown id is then 404, as if it did not exist)."""
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    async with stack(api_key_file=str(keys), tenants=TENANTS) as (cluster, proxy, client):
        out = io.StringIO()
        proxy.app.pipeline.access_log = AccessLog("json", stream=out)
        assert (await client.chat(chat_body(), bearer("secret-s"))).status == 200  # its one request
        limited = await client.request(method, path, b"", bearer("secret-s"))
        assert limited.status == 429, (limited.status, limited.body[:200])
        assert (await client.request(method, path, b"", bearer("secret-a"))).status == 404
        lines = [msgspec.json.decode(line) for line in out.getvalue().splitlines()]
        assert [line.get("key") for line in lines if line.get("path") == path] == ["spent", "team-a"], lines
