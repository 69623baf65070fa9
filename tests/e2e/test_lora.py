"""LoRA adapters behind the proxy against real vLLM (tiny Llama, tiny peft adapters built by
e2e/setup_vllm.sh): two instances with the static adapter lora-a and runtime updating on.

* As two plain instances: an adapter request's greedy answer is the one of the instance that
  served it (vLLM's success counter says which), and differs from the base model's; lora-b,
  loaded at run time through the proxy (admin key) on one of them only, is answered there.
* As P/D over NIXL: lora-a on both legs gives a single instance's greedy answer; lora-c, which
  no instance has, is loaded on demand from ``--lora-source`` on both legs first.
"""

from __future__ import annotations

import os

import pytest
import vllm_e2e as E

CLUSTER = "lora"
pytestmark = pytest.mark.vllm

SUCCESS = "vllm:request_success_total"
ADMIN_KEY = "e2e-lora-admin"
ADMIN = {"X-API-Key": ADMIN_KEY}


def _known(p: E.Proxy, *names: str) -> bool:
    ids = {m["id"] for m in E.request(p.url, "GET", "/v1/models").json()["data"]}
    return set(names) <= ids


@pytest.fixture(scope="module")
def plain(lora, start_proxy):
    p = start_proxy("lora-plain", decode=[lora.prefill.url, lora.decode.url],
                    extra=["--probe-interval", "1", "--admin-api-key", ADMIN_KEY])
    assert E.wait_for(lambda: _known(p, E.MODEL_NAME, "lora-a"), 30)
    return p


@pytest.fixture(scope="module")
def disagg(lora, start_proxy):
    p = start_proxy("lora-pd", prefill=[lora.prefill.url], decode=[lora.decode.url],
                    extra=["--probe-interval", "1", "--lora-source",
                           f"lora-c={os.path.join(E.LORAS, 'lora-c')}"])
    assert E.wait_for(lambda: _known(p, E.MODEL_NAME, "lora-a"), 30)
    return p


def _served_by(lora, before: dict) -> str:
    """Which instance's success counter grew (LoRA requests are counted under the base's name)."""
    grown = [k for k, inst in (("prefill", lora.prefill), ("decode", lora.decode))
             if E.delta(inst, SUCCESS, before[k], 1, timeout=3) >= 1]
    assert len(grown) == 1, grown
    return grown[0]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_static_adapter_answer_is_its_instances(lora, plain, endpoint):
    path = E.endpoint_path(endpoint)
    for n in range(2):
        body = E.text_body(endpoint, E.unique_prompt(), max_tokens=12, stream=bool(n), model="lora-a")
        before = {"prefill": lora.prefill.metrics(), "decode": lora.decode.metrics()}
        r = E.post(plain.url, path, body)
        E.assert_ok(r, bool(n))
        inst = getattr(lora, _served_by(lora, before))
        direct = E.post(inst.url, path, dict(body, stream=False))
        E.assert_ok(direct, False)
        assert E.text_of(r, endpoint) == E.text_of(direct, endpoint)
        base = E.post(inst.url, path, dict(body, stream=False, model=E.MODEL_NAME))
        assert E.text_of(base, endpoint) != E.text_of(direct, endpoint)  # the adapter changes the answer


def test_adapter_loaded_at_run_time_through_the_proxy(lora, plain):
    load = {"lora_name": "lora-b", "lora_path": os.path.join(E.LORAS, "lora-b"), "instances": [lora.decode.url]}
    r = E.post(plain.url, "/v1/load_lora_adapter", load)
    assert r.status == 401, E.describe(r)
    r = E.post(plain.url, "/v1/load_lora_adapter", load, headers=ADMIN)
    assert r.status == 200 and r.body == b"Success: LoRA adapter 'lora-b' added successfully.", E.describe(r)
    try:
        assert _known(plain, "lora-b")  # learned right after the load, not at the next probe
        for n in range(3):
            body = E.text_body("completions", E.unique_prompt(), max_tokens=12, stream=bool(n % 2), model="lora-b")
            before = lora.decode.metrics()
            r = E.post(plain.url, "/v1/completions", body)
            E.assert_ok(r, bool(n % 2))
            assert E.delta(lora.decode, SUCCESS, before, 1) == 1
            direct = E.post(lora.decode.url, "/v1/completions", dict(body, stream=False))
            assert E.text_of(r, "completions") == E.text_of(direct, "completions")
            assert E.post(lora.prefill.url, "/v1/completions", dict(body, stream=False)).status == 404
    finally:
        r = E.post(plain.url, "/v1/unload_lora_adapter", {"lora_name": "lora-b"}, headers=ADMIN)
        assert r.status == 200, E.describe(r)
    r = E.post(plain.url, "/v1/completions", E.text_body("completions", "Hello", model="lora-b"))
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_p_d_with_the_adapter_on_both_legs_equals_one_instance(lora, disagg, endpoint):
    path = E.endpoint_path(endpoint)
    for n in range(2):
        body = E.text_body(endpoint, E.unique_prompt(), max_tokens=12, stream=bool(n), model="lora-a")
        before_p, before_d = lora.prefill.metrics(), lora.decode.metrics()
        r = E.post(disagg.url, path, body)
        E.assert_ok(r, bool(n))
        assert E.delta(lora.prefill, SUCCESS, before_p, 1) == 1
        assert E.delta(lora.decode, E.NIXL_XFERS, before_d, 1) >= 1  # decode read prefill's KV
        direct = E.post(lora.decode.url, path, dict(body, stream=False))
        E.assert_ok(direct, False)
        assert E.text_of(r, endpoint) == E.text_of(direct, endpoint)


def test_p_d_adapter_loaded_on_demand_on_both_legs(lora, disagg):
    for inst in (lora.prefill, lora.decode):
        assert "lora-c" not in {m["id"] for m in E.request(inst.url, "GET", "/v1/models").json()["data"]}
    body = E.text_body("chat", E.unique_prompt(), max_tokens=12, model="lora-c")
    r = E.post(disagg.url, "/v1/chat/completions", body)
    E.assert_ok(r, False)
    try:
        for inst in (lora.prefill, lora.decode):
            cards = {m["id"]: m for m in E.request(inst.url, "GET", "/v1/models").json()["data"]}
            assert cards["lora-c"]["parent"] == E.MODEL_NAME
        direct = E.post(lora.decode.url, "/v1/chat/completions", body)
        assert E.text_of(r, "chat") == E.text_of(direct, "chat")
    finally:
        for inst in (lora.prefill, lora.decode):
            E.post(inst.url, "/v1/unload_lora_adapter", {"lora_name": "lora-c"})
