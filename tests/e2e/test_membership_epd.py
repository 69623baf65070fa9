"""E+P+D and E+PD through proxies that start with an empty roster, the real instances joining
through `POST /instances` with the registrar's payloads.

Roles as vLLM's registrar would announce them: the encoder as `encode`, P (EC consumer, NIXL KV
producer) as `prefill`, D as `decode`. For E+PD, P is announced as `decode`, as a launcher does
for a plain instance (the registrar announces anything that is not a KV producer as decode).
Evidence as in test_epd.py: the encoder stored the item, the consumer loaded it, and the text
equals the single-instance answer. Runs last on the EPD cluster (ORDER 90).
"""

from __future__ import annotations

import pytest
import vllm_e2e as E
from test_epd import assert_consumer_loaded, ec_entries, ec_lookups_missed, new_entry, single_instance

CLUSTER = "epd"
ORDER = 90
pytestmark = pytest.mark.vllm

KEY = {"X-API-Key": "e2e-admin"}
ARGS = ["--dynamic-registration", "--admin-api-key", KEY["X-API-Key"], "--kv-connector", "nixl"]


def announce(proxy, role: str, url: str) -> None:
    r = E.post(proxy.url, "/instances", {"role": role, "url": url, "ec_zmq_addrs": [], "dp_size": 1},
               headers=KEY)
    assert (r.status, r.json()) == (200, {"registered": True}), E.describe(r)


@pytest.fixture(scope="module")
def proxies(epd, start_proxy):
    e_p_d = start_proxy("epd-registered", decode=[], extra=ARGS)
    e_pd = start_proxy("e-pd-registered", decode=[], extra=ARGS)
    for proxy in (e_p_d, e_pd):
        assert E.request(proxy.url, "GET", "/ready").status == 503
    announce(e_p_d, "encode", epd.encode.url)
    announce(e_p_d, "prefill", epd.prefill.url)
    announce(e_p_d, "decode", epd.decode.url)
    announce(e_pd, "encode", epd.encode.url)
    announce(e_pd, "decode", epd.prefill.url)
    return {"E+P+D": e_p_d, "E+PD": e_pd}


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("topology", ["E+P+D", "E+PD"])
def test_registered_epd_image_chat(epd, proxies, topology, stream):
    proxy = proxies[topology]
    assert E.request(proxy.url, "GET", "/ready").status == 200
    view = E.request(proxy.url, "GET", "/instances", headers=KEY).json()
    assert view["topology"] == topology
    body = E.image_chat_body(E.png_data_url(E.unique_color()), max_tokens=8, stream=stream)
    expected = single_instance(epd, body)
    before, missed = ec_entries(epd), ec_lookups_missed(epd)
    d0, p0 = epd.decode.metrics(), epd.prefill.metrics()

    resp = E.post(proxy.url, "/v1/chat/completions", body)

    E.assert_ok(resp, stream)
    assert E.text_of(resp, "chat") == expected
    mm_hash = new_entry(epd, before)
    assert_consumer_loaded(epd, mm_hash, missed)
    if topology == "E+P+D":
        assert E.delta(epd.decode, E.NIXL_XFERS, d0, 1) == 1, "no NIXL transfer into D"
    else:
        assert E.delta(epd.prefill, "vllm:generation_tokens_total", p0, 8) == 8
        assert epd.decode.metrics().get(E.NIXL_XFERS) == d0.get(E.NIXL_XFERS)


def test_registered_epd_text_only(epd, proxies):
    body = E.text_body("chat", E.unique_prompt(), max_tokens=8)
    ref = E.post(epd.decode.url, "/v1/chat/completions", body)
    assert ref.status == 200, E.describe(ref)
    resp = E.post(proxies["E+P+D"].url, "/v1/chat/completions", body)
    E.assert_ok(resp, False)
    assert E.text_of(resp, "chat") == E.text_of(ref, "chat")
