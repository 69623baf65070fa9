"""P/D pull over NIXL through epd-proxy, against real vLLM: 1 prefill + 1 decode (tiny Llama).

The reference ("single-instance") answer for each request is the same greedy request sent straight
to the decode instance without `kv_transfer_params`. That is the ordinary non-disaggregated path:
NIXL does not enforce `kv_role`, and with no `kv_transfer_params` the connector does nothing, so
the decode instance prefills locally and decodes, as a plain `vllm serve` of the same weights,
dtype and max-model-len would. It saves starting a third instance. (The research behind this
suite also compared against a separate plain instance: identical text.) Prompts are unique and
shorter than one CPU KV block (128 tokens), so no prefix cache on either side can hide a transfer.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import vllm_e2e as E

CLUSTER = "pd"
ORDER = 10
pytestmark = pytest.mark.vllm

ENDPOINTS = ["completions", "chat"]
STREAMS = [False, True]
PULL_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def proxy(pd, start_proxy):
    return start_proxy("pd", prefill=[pd.prefill.url], decode=[pd.decode.url])


# --- the environment itself, without the proxy: tells a broken vLLM setup from a proxy bug ----


def test_vllm_direct_pull_roundtrip(pd):
    """The toy-proxy sequence by hand: P (max_tokens=1, do_remote_decode) then D with P's params."""
    prompt = E.unique_prompt()
    body = E.text_body("completions", prompt)
    ref = E.reference(pd, "completions", body)
    m0 = pd.decode.metrics()
    pre = dict(body, max_tokens=1, kv_transfer_params=PULL_REQUEST)
    r1 = E.post(pd.prefill.url, "/v1/completions", pre, headers={"X-Request-Id": "e2e-direct-1"})
    assert r1.status == 200, E.describe(r1)
    ktp = r1.json()["kv_transfer_params"]
    for key in ("do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host",
                "remote_port", "remote_request_id", "tp_size"):
        assert key in ktp, ktp
    assert ktp["do_remote_prefill"] is True and ktp["remote_host"] == "127.0.0.1"
    assert ktp["remote_port"] == pd.prefill.side_channel_port
    assert ktp["remote_request_id"].startswith("cmpl-e2e-direct-1-"), ktp
    r2 = E.post(pd.decode.url, "/v1/completions", dict(body, kv_transfer_params=ktp))
    assert r2.status == 200, E.describe(r2)
    assert E.text_of(r2, "completions") == E.text_of(ref, "completions")
    assert E.delta(pd.decode, E.NIXL_XFERS, m0, 1) == 1
    n = ref.json()["usage"]["prompt_tokens"]
    assert E.delta(pd.decode, E.EXT_HITS, m0, n) == n


# --- through the proxy ----------------------------------------------------------------------


def test_proxy_health_and_models(proxy):
    r = E.request(proxy.url, "GET", "/health")
    assert r.status == 200, E.describe(r)
    r = E.request(proxy.url, "GET", "/v1/models")
    assert r.status == 200, E.describe(r)
    assert E.MODEL_NAME in [m["id"] for m in r.json()["data"]], E.describe(r)


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_pd_text_equals_single_instance(pd, proxy, endpoint, stream):
    body = E.text_body(endpoint, E.unique_prompt(), max_tokens=16, stream=stream)
    ref = E.reference(pd, endpoint, body)
    prompt_tokens = ref.json()["usage"]["prompt_tokens"]
    d0, p0 = pd.decode.metrics(), pd.prefill.metrics()

    resp = E.post(proxy.url, E.endpoint_path(endpoint), body)

    E.assert_ok(resp, stream)
    assert E.text_of(resp, endpoint) == E.text_of(ref, endpoint)
    if not stream:
        assert resp.json()["usage"]["completion_tokens"] == 16, E.describe(resp)
    # Exactly one NIXL transfer into decode, covering the whole prompt, and nothing failed.
    assert E.delta(pd.decode, E.NIXL_XFERS, d0, 1) == 1
    assert E.delta(pd.decode, E.EXT_HITS, d0, prompt_tokens) == prompt_tokens
    assert pd.decode.metrics().get(E.NIXL_FAILED) == d0.get(E.NIXL_FAILED)
    # The prefill leg generated one token (max_tokens=1), decode generated the rest.
    assert E.delta(pd.prefill, "vllm:generation_tokens_total", p0, 1) == 1
    assert E.delta(pd.prefill, "vllm:prompt_tokens_total", p0, prompt_tokens) == prompt_tokens


@pytest.mark.parametrize("stream", STREAMS, ids=["nonstream", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_pd_prefill_body_is_sanitised(pd, proxy, endpoint, stream):
    """Client fields that vLLM would reject on the 1-token prefill leg (min_tokens > 1,
    stream_options with stream=false) and max_completion_tokens (which beats max_tokens on chat)
    must not reach P as is: the request succeeds and P generates exactly one token."""
    extra: dict = {"min_tokens": 4}
    if stream:
        extra["stream_options"] = {"include_usage": True}
    body = E.text_body(endpoint, E.unique_prompt(), max_tokens=12, stream=stream, **extra)
    if endpoint == "chat":
        del body["max_tokens"]
        body["max_completion_tokens"] = 12
    ref = E.reference(pd, endpoint, {k: v for k, v in body.items() if k != "stream_options"})
    p0 = pd.prefill.metrics()

    resp = E.post(proxy.url, E.endpoint_path(endpoint), body)

    E.assert_ok(resp, stream)
    assert E.text_of(resp, endpoint) == E.text_of(ref, endpoint)
    if stream:
        usage = [ev["usage"] for ev in resp.events() if isinstance(ev, dict) and ev.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == 12, E.describe(resp, 4000)
    else:
        assert resp.json()["usage"]["completion_tokens"] == 12
    assert E.delta(pd.prefill, "vllm:generation_tokens_total", p0, 1) == 1


def test_pd_32_concurrent_requests(pd, proxy):
    n = 32
    jobs = []
    for i in range(n):
        endpoint = ENDPOINTS[i % 2]
        stream = bool((i // 2) % 2)
        jobs.append((endpoint, stream, E.text_body(endpoint, E.unique_prompt(), max_tokens=8,
                                                   stream=stream)))
    d0 = pd.decode.metrics()
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(
            lambda job: E.post(proxy.url, E.endpoint_path(job[0]), job[2]), jobs))
    elapsed = time.monotonic() - t0
    failures = [(job[0], job[1], E.describe(r)) for job, r in zip(jobs, results)
                if r.status != 200 or not E.text_of(r, job[0])]
    assert not failures, f"{len(failures)}/{n} failed: {failures[:3]}"
    for (_, stream, _), r in zip(jobs, results):
        E.assert_ok(r, stream)
        if not stream:
            assert r.json()["usage"]["completion_tokens"] == 8
    assert E.delta(pd.decode, E.NIXL_XFERS, d0, n) == n
    assert pd.decode.metrics().get(E.NIXL_FAILED) == d0.get(E.NIXL_FAILED)
    print(f"\n[e2e] {n} concurrent P/D requests through the proxy in {elapsed:.2f}s")


# Push mode (NixlPushConnector, --kv-connector nixl-push) has its own cluster: test_pd_push.py.
