"""Two models behind one proxy against real vLLM: two plain (PD) instances started with
different ``--served-model-name``s. The proxy learns what each serves from its /v1/models;
every request lands on the instance serving its model (vLLM's own success counter, labelled
with the served name, grows there only), its greedy answer is that instance's own, an unknown
model is the proxy's 404 before any upstream call, and /v1/models is the union."""

from __future__ import annotations

import time

import pytest
import vllm_e2e as E

CLUSTER = "models"
pytestmark = pytest.mark.vllm

SUCCESS = "vllm:request_success_total"


@pytest.fixture(scope="module")
def proxy(models, start_proxy):
    p = start_proxy("models", decode=[models.alpha.url, models.beta.url], extra=["--probe-interval", "1"])

    def known():
        pools = E.request(p.url, "GET", "/status").json()["pools"]["decode"]
        return all(i["models"] for i in pools)

    assert E.wait_for(known, 30), E.request(p.url, "GET", "/status").body
    return p


def test_models_union_in_vllms_shape(models, proxy):
    body = E.request(proxy.url, "GET", "/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["alpha", "beta"]
    own = E.request(models.alpha.url, "GET", "/v1/models").json()["data"][0]
    ours = body["data"][0]
    assert set(ours) == set(own)
    assert {k: ours[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")} == \
        {k: own[k] for k in ("id", "object", "owned_by", "root", "parent", "max_model_len")}
    assert E.request(proxy.url, "GET", "/v1/models/beta").json()["id"] == "beta"
    r = E.request(proxy.url, "GET", "/v1/models/gamma")
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_each_request_answered_by_an_instance_serving_its_model(models, proxy, endpoint):
    instances = {"alpha": models.alpha, "beta": models.beta}
    path = E.endpoint_path(endpoint)
    for n, name in enumerate(["alpha", "beta", "beta", "alpha"]):
        before = {k: v.metrics() for k, v in instances.items()}
        body = E.text_body(endpoint, E.unique_prompt(), max_tokens=12, stream=bool(n % 2), model=name)
        r = E.post(proxy.url, path, body)
        E.assert_ok(r, bool(n % 2))
        other = "beta" if name == "alpha" else "alpha"
        assert E.delta(instances[name], SUCCESS, before[name], 1, model_name=name) == 1
        assert instances[other].metrics().get(SUCCESS) == before[other].get(SUCCESS)
        direct = E.post(instances[name].url, path, dict(body, stream=False))
        E.assert_ok(direct, False)
        assert E.text_of(r, endpoint) == E.text_of(direct, endpoint)
        # The other instance does not serve it: vLLM's own 404, which the proxy never provokes.
        assert E.post(instances[other].url, path, dict(body, stream=False)).status == 404


def test_unknown_model_is_the_proxys_404_without_an_upstream_call(models, proxy):
    before = {k: v.metrics().get(SUCCESS) for k, v in (("alpha", models.alpha), ("beta", models.beta))}
    r = E.post(proxy.url, "/v1/completions", E.text_body("completions", "Hello", model="gamma"))
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"
    body = E.text_body("completions", "Hello")
    del body["model"]
    r = E.post(proxy.url, "/v1/completions", body)
    assert r.status == 400 and "alpha, beta" in r.json()["error"]["message"]
    assert {k: v.metrics().get(SUCCESS) for k, v in (("alpha", models.alpha), ("beta", models.beta))} == before


def _proxy_counts(proxy) -> dict[str, int]:
    """Per instance URL, the requests this proxy sent it (its /status)."""
    pools = E.request(proxy.url, "GET", "/status").json()["pools"]["decode"]
    return {i["url"]: i["requests"] for i in pools}


def test_routed_endpoints_reach_the_instance_serving_their_model(models, proxy):
    """/tokenize and /detokenize naming a model go to its instance: the other one would answer
    vLLM's own 404 for a name it does not serve, so every 200 (over more requests than the
    least-loaded rotation would keep on one instance by chance) says the routing held."""
    instances = {"alpha": models.alpha, "beta": models.beta}
    for name, inst in instances.items():
        other = instances["beta" if name == "alpha" else "alpha"]
        before = _proxy_counts(proxy)
        body = {"model": name, "prompt": f"Routed by model to {name}.", "return_token_strs": True}
        for _ in range(4):
            r = E.post(proxy.url, "/tokenize", body)
            assert r.status == 200, E.describe(r)
            assert r.body == E.post(inst.url, "/tokenize", body).body  # the instance's own answer
        back = E.post(proxy.url, "/detokenize", {"model": name, "tokens": r.json()["tokens"]})
        assert back.status == 200 and f"to {name}" in back.json()["prompt"]
        assert E.post(other.url, "/tokenize", body).status == 404  # what a wrong route would give
        after = _proxy_counts(proxy)
        assert after[inst.url] - before[inst.url] == 5 and after[other.url] == before[other.url]
    r = E.post(proxy.url, "/tokenize", {"model": "gamma", "prompt": "x"})
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found"


def test_the_operators_view_per_model(models, proxy):
    """/status says each model is ready on its own instance; the metrics count requests and
    latency per model and name what each instance serves; Server-Timing names the model; and
    the probes' answers, whose ``created`` and permission ids vLLM makes anew each time, are
    not taken for a change (no repeated 'serves' lines in the proxy's log)."""
    status = E.request(proxy.url, "GET", "/status").json()["models"]
    for name in ("alpha", "beta"):
        assert status[name]["ready"] and status[name]["roles"] == {"decode": {"in_rotation": 1, "out": 0}}
    body = E.text_body("completions", E.unique_prompt(), max_tokens=4, stream=True, model="beta")
    r = E.post(proxy.url, "/v1/completions", body)
    E.assert_ok(r, True)
    assert r.headers.get("server-timing", "").endswith('model;desc="beta"'), r.headers
    text = E.request(proxy.url, "GET", "/metrics").body.decode()
    assert 'epd_proxy_model_time_to_first_token_seconds_count{model="beta"}' in text
    assert 'epd_proxy_model_requests_total{model="beta",status="200"}' in text
    for name, inst in (("alpha", models.alpha), ("beta", models.beta)):
        assert f'epd_proxy_instance_model_info{{model="{name}",role="decode",url="{inst.url}"}} 1.0' in text
    time.sleep(2.5)  # two more probes (--probe-interval 1), each reading /v1/models again
    log = open(proxy.proc.log_path, encoding="utf-8", errors="replace").read()
    assert " serves " not in log, log[-2000:]


def test_a_lora_load_where_runtime_updating_is_off_names_the_variable(models, start_proxy):
    """These instances run without VLLM_ALLOW_RUNTIME_LORA_UPDATING: vLLM has no runtime LoRA
    routes, so FastAPI answers a bare 404; the proxy's answer says what is missing."""
    key = {"X-API-Key": "e2e-models-admin"}
    p = start_proxy("models-admin", decode=[models.alpha.url],
                    extra=["--probe-interval", "1", "--admin-api-key", key["X-API-Key"]])
    assert E.wait_for(lambda: "alpha" in E.request(p.url, "GET", "/status", headers=key).json()["models"], 30)
    body = {"lora_name": "lora-b", "lora_path": f"{E.LORAS}/lora-b", "base_model": "alpha"}
    own = E.request(models.alpha.url, "POST", "/v1/load_lora_adapter", body)
    assert own.status == 404 and own.json() == {"detail": "Not Found"}  # what vLLM itself answers
    r = E.request(p.url, "POST", "/v1/load_lora_adapter", body, headers=key)
    assert r.status == 404, r.body
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in r.json()["error"]["message"]
    # A mistyped model: the proxy's 404 naming what the cluster serves, at once.
    r = E.request(p.url, "POST", "/v1/completions", {"model": "gpt-4o", "prompt": "x", "max_tokens": 1})
    assert r.status == 404 and "This cluster serves: alpha (GET /v1/models lists them)" in r.json()["error"]["message"]
