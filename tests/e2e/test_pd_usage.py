"""The client's usage through P/D against real vLLM (both run with --enable-prompt-tokens-details):
``prompt_tokens_details.cached_tokens`` is what the prefill found in its prefix cache, as a single
instance reports it, not the prompt tokens whose KV decode received over NIXL.

A repeated prefix longer than a few CPU KV blocks (128 tokens each) makes the prefill hit its
prefix cache on the second request; the prefill's own count is read from its
``vllm:prefix_cache_hits_total`` counter, which grows by exactly the tokens it found cached.
"""

from __future__ import annotations

import pytest
import vllm_e2e as E

CLUSTER = "pd"
ORDER = 15  # after test_pd_nixl (which keeps prefix caches out of its way), before the failures
pytestmark = pytest.mark.vllm

PREFIX_HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def proxy(pd, start_proxy):
    return start_proxy("pd-usage", prefill=[pd.prefill.url], decode=[pd.decode.url])


def _final_usage(resp: E.Response, stream: bool) -> dict:
    if not stream:
        return resp.json()["usage"]
    usage = [ev["usage"] for ev in resp.events() if isinstance(ev, dict) and ev.get("usage")]
    assert usage, E.describe(resp, 4000)
    return usage[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_cached_tokens_are_the_prefills_prefix_hits(pd, proxy, endpoint, stream):
    prefix = E.unique_prompt(words=400)  # several 128-token blocks, shared by no earlier request
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    first = E.text_body(endpoint, prefix + " First question.", max_tokens=8, stream=stream, **extra)
    second = E.text_body(endpoint, prefix + " Another question.", max_tokens=8, stream=stream, **extra)

    r1 = E.post(proxy.url, E.endpoint_path(endpoint), first)
    E.assert_ok(r1, stream)
    p0 = pd.prefill.metrics()
    r2 = E.post(proxy.url, E.endpoint_path(endpoint), second)
    E.assert_ok(r2, stream)

    usage = _final_usage(r2, stream)
    prompt_tokens = usage["prompt_tokens"]
    hits = E.delta(pd.prefill, PREFIX_HITS, p0, 128)  # the prefill's own prefix-cache hits
    assert hits >= 128, f"the prefill found {hits} cached tokens; expected the shared prefix's blocks"
    # Decode's own count would be its local prefix hits (the blocks it received for the first
    # request) plus the tokens it loaded over NIXL: the whole prompt, give or take its last block.
    assert hits < prompt_tokens
    details = usage.get("prompt_tokens_details") or {}
    assert details.get("cached_tokens") == hits, E.describe(r2, 4000)
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == prompt_tokens + 8


def test_no_prefix_hit_reports_no_cached_tokens(pd, proxy):
    """A prompt nobody sent before: a single instance reports no prompt_tokens_details."""
    body = E.text_body("completions", E.unique_prompt(words=400), max_tokens=4)
    p0 = pd.prefill.metrics()
    resp = E.post(proxy.url, "/v1/completions", body)
    E.assert_ok(resp, False)
    assert pd.prefill.metrics().get(PREFIX_HITS) == p0.get(PREFIX_HITS)
    assert not (resp.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"), E.describe(resp)


def _ending(resp: E.Response) -> tuple:
    """How a stream ends, apart from what one generation's text and ids make differ: the last
    event's keys in order, its fields other than the text and ids, and its choices' endings."""
    events = resp.events()
    assert events[-1] == "[DONE]"
    last = events[-2]
    return (list(last), {k: v for k, v in last.items() if k not in ("id", "created", "choices")},
            [c.get("finish_reason") for c in last["choices"]])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_stream_without_usage_is_counted_and_reaches_the_client_as_decode_sends_it(pd, proxy, endpoint):
    """The proxy asks decode for the usage event and takes it out again: the client's events are
    decode's own answer to the request without the option (the fingerprint where vLLM puts it
    then: on the last event), and the tokens are counted."""
    body = E.text_body(endpoint, E.unique_prompt(words=40), max_tokens=8, stream=True)
    before = E.Metrics.scrape(proxy.url)
    r = E.post(proxy.url, E.endpoint_path(endpoint), body)
    E.assert_ok(r, True)
    assert not any(isinstance(ev, dict) and "usage" in ev for ev in r.events()), E.describe(r, 4000)
    after = E.Metrics.scrape(proxy.url)
    model = {"model": body["model"]}
    assert after.get("epd_proxy_completion_tokens_total", **model) \
        - before.get("epd_proxy_completion_tokens_total", **model) == 8
    assert after.get("epd_proxy_prompt_tokens_total", **model) > before.get("epd_proxy_prompt_tokens_total", **model)
    direct = E.post(pd.decode.url, E.endpoint_path(endpoint), body)
    E.assert_ok(direct, True)
    # The text may differ (a KV computed elsewhere, on CPU); how the stream ends may not.
    assert _ending(r) == _ending(direct), (E.describe(r, 4000), E.describe(direct, 4000))
    assert "system_fingerprint" in r.events()[-2]
