"""P/D through a proxy that starts with an empty roster: the real instances join through
`POST /instances` with vLLM's registrar's payloads (what `ProxyRegistrar` sends: role, url,
ec_zmq_addrs, dp_size), leave with its DELETE, and come back.

The registrar is not in vLLM 0.32, so the test announces the instances the way a launcher script
would. Runs last on the P/D cluster (ORDER 90).
"""

from __future__ import annotations

import pytest
import vllm_e2e as E

CLUSTER = "pd"
ORDER = 90
pytestmark = pytest.mark.vllm

KEY = {"X-API-Key": "e2e-admin"}


def announcement(role: str, url: str) -> dict:
    return {"role": role, "url": url, "ec_zmq_addrs": [], "dp_size": 1}


@pytest.fixture(scope="module")
def proxy(pd, start_proxy):
    return start_proxy("pd-registered", decode=[], extra=["--dynamic-registration", "--admin-api-key",
                                                          KEY["X-API-Key"], "--kv-connector", "nixl"])


def roster(proxy) -> dict:
    r = E.request(proxy.url, "GET", "/instances", headers=KEY)
    assert r.status == 200, E.describe(r)
    return r.json()


def test_empty_roster_is_not_ready(pd, proxy):
    ready = E.request(proxy.url, "GET", "/ready")
    assert ready.status == 503, E.describe(ready)
    body = E.text_body("completions", E.unique_prompt())
    r = E.post(proxy.url, "/v1/completions", body)
    assert r.status == 503 and r.headers.get("retry-after"), E.describe(r)
    assert r.json()["error"]["message"] == "no decode instance available"
    # The registrar sends no key; this proxy allows no keyless network: refused, nothing changes.
    r = E.post(proxy.url, "/instances", announcement("decode", pd.decode.url))
    assert r.status == 401, E.describe(r)
    assert roster(proxy)["decode"]["live"] == []


def test_registered_pd_serves(pd, proxy):
    for role, inst in (("prefill", pd.prefill), ("decode", pd.decode)):
        r = E.post(proxy.url, "/instances", announcement(role, inst.url), headers=KEY)
        assert (r.status, r.json()) == (200, {"registered": True}), E.describe(r)
        again = E.post(proxy.url, "/instances", announcement(role, inst.url), headers=KEY)  # re-announce
        assert again.json() == {"registered": False}, E.describe(again)
    assert E.request(proxy.url, "GET", "/ready").status == 200
    view = roster(proxy)
    assert view["prefill"]["live"] == [pd.prefill.url] and view["decode"]["live"] == [pd.decode.url]
    assert view["topology"] == "P+D"
    for endpoint in ("completions", "chat"):
        for stream in (False, True):
            body = E.text_body(endpoint, E.unique_prompt(), stream=stream)
            ref = E.reference(pd, endpoint, body)
            m0 = pd.decode.metrics()
            resp = E.post(proxy.url, E.endpoint_path(endpoint), body)
            E.assert_ok(resp, stream)
            assert E.text_of(resp, endpoint) == E.text_of(ref, endpoint)
            assert E.delta(pd.decode, E.NIXL_XFERS, m0, 1) == 1


def test_registrar_shutdown_then_rejoin(pd, proxy):
    """The registrar's DELETE carries its JSON body; the role is then unavailable until it
    announces itself again."""
    r = E.request(proxy.url, "DELETE", "/instances", announcement("decode", pd.decode.url), headers=KEY)
    assert (r.status, r.json()) == (200, {"removed": True}), E.describe(r)
    body = E.text_body("chat", E.unique_prompt())
    r = E.post(proxy.url, "/v1/chat/completions", body)
    assert r.status == 503, E.describe(r)
    r = E.post(proxy.url, "/instances", announcement("decode", pd.decode.url), headers=KEY)
    assert r.json() == {"registered": True}, E.describe(r)
    resp = E.post(proxy.url, "/v1/chat/completions", body)
    E.assert_ok(resp, False)
    assert E.text_of(resp, "chat") == E.text_of(E.reference(pd, "chat", body), "chat")


def test_drained_instance_leaves_when_idle(pd, proxy):
    r = E.post(proxy.url, "/instances/drain", {"url": pd.prefill.url}, headers=KEY)
    assert r.status == 200, E.describe(r)
    assert E.wait_for(lambda: pd.prefill.url not in str(roster(proxy)["instances"]), 10)
    # No prefill left: the roster is P/D no more; decode serves alone (inferred topology).
    assert roster(proxy)["topology"] == "PD"
    body = E.text_body("completions", E.unique_prompt())
    resp = E.post(proxy.url, "/v1/completions", body)
    E.assert_ok(resp, False)
    r = E.post(proxy.url, "/instances", announcement("prefill", pd.prefill.url), headers=KEY)
    assert r.json() == {"registered": True}, E.describe(r)
