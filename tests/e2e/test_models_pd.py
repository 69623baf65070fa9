"""Two models behind one proxy against real vLLM: two plain (PD) instances started with
different ``--served-model-name``s. The proxy learns what each serves from its /v1/models;
every request lands on the instance serving its model (vLLM's own success counter, labelled
with the served name, grows there only), its greedy answer is that instance's own, an unknown
model is the proxy's 404 before any upstream call, and /v1/models is the union."""

from __future__ import annotations

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
