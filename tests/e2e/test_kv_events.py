"""vLLM's KV cache events against real vLLM: two prefills and a decode started with
``--kv-events-config`` (ZMQ, block size 32); the proxy subscribes to each. Its metrics show
events from every instance, and a prompt whose prefix one prefill holds (placed there by a
request that never passed the proxy) is routed to that prefill, where vLLM's own
``vllm:prefix_cache_hits_total`` grows. Approximate routing cannot know where those
prefixes are: with two prefills, four prompts land on their holder by chance once in 16.
"""

from __future__ import annotations

import pytest
import vllm_e2e as E

CLUSTER = "kv"
ORDER = 1
pytestmark = pytest.mark.vllm

HITS = "vllm:prefix_cache_hits_total"
BLOCK = 32
PROMPTS = 4


@pytest.fixture(scope="module")
def proxy(kv, start_proxy):
    return start_proxy("kv-events", prefill=[kv.prefill.events_spec(), kv.prefill_b.events_spec()],
                       decode=[kv.decode.events_spec()])


def _connected(proxy) -> dict[str, float]:
    m = E.Metrics.scrape(proxy.url)
    return {lab["url"]: v for n, lab, v in m.samples if n == "epd_proxy_kv_events_connected"}


def _prefill_requests(proxy) -> dict[str, int]:
    status = E.request(proxy.url, "GET", "/status").json()
    return {i["url"]: i["requests"] for i in status["pools"]["prefill"]}


def _held(proxy, url: str) -> int:
    status = E.request(proxy.url, "GET", "/status").json()
    return status["kv_events"]["instances"][url][0]["blocks"]


def test_a_prefix_one_prefill_holds_is_routed_there(kv, proxy):
    urls = [kv.prefill.url, kv.prefill_b.url, kv.decode.url]
    assert E.wait_for(lambda: _connected(proxy) == dict.fromkeys(urls, 1.0), 60), _connected(proxy)
    holders = [kv.prefill, kv.prefill_b]
    for n in range(PROMPTS):
        holder = holders[n % 2]
        prompt = E.unique_prompt(words=200)  # several 32-token blocks no earlier request shared
        held = _held(proxy, holder.url)
        # Straight to the prefill, as another client or another proxy replica would.
        r = E.post(holder.url, "/v1/completions", E.text_body("completions", prompt, max_tokens=1))
        E.assert_ok(r, False)
        assert E.wait_for(lambda h=holder, b=held: _held(proxy, h.url) > b, 20), "no BlockStored reached the proxy"
        before = holder.metrics()
        requests = _prefill_requests(proxy)
        r = E.post(proxy.url, "/v1/completions",
                   E.text_body("completions", prompt + " And one more thing.", max_tokens=4))
        E.assert_ok(r, False)
        after = _prefill_requests(proxy)
        assert after[holder.url] == requests[holder.url] + 1, (n, holder.url, requests, after)
        hits = E.delta(holder, HITS, before, 2 * BLOCK)
        assert hits >= 2 * BLOCK, f"prompt {n}: {hits} cached tokens on {holder.url}"
    m = E.Metrics.scrape(proxy.url)
    received = {lab["url"]: v for name, lab, v in m.samples if name == "epd_proxy_kv_events_received_total"}
    assert all(received.get(u, 0) > 0 for u in urls), received
    assert m.get("epd_proxy_routing_exact_total", role="prefill") >= PROMPTS
    # Through the live socket, not only the heartbeat's replays.
    streams = E.request(proxy.url, "GET", "/status").json()["kv_events"]["instances"]
    assert all(streams[u][0]["live_received"] > 0 for u in urls), streams


def test_a_chat_prefix_is_found_through_the_instances_tokenizer(kv, proxy):
    """Chat: the proxy's /tokenize call applies the model's chat template as the generation
    request will, so the next turn of a conversation opened on one prefill (directly) finds it."""
    holders = [kv.prefill_b, kv.prefill]
    for n in range(2):
        holder = holders[n % 2]
        first = [{"role": "user", "content": E.unique_prompt(words=200)}]
        held = _held(proxy, holder.url)
        r = E.post(holder.url, "/v1/chat/completions", {"model": E.MODEL_NAME, "messages": first, "max_tokens": 1})
        E.assert_ok(r, False)
        assert E.wait_for(lambda h=holder, b=held: _held(proxy, h.url) > b, 20), "no BlockStored reached the proxy"
        before = holder.metrics()
        requests = _prefill_requests(proxy)
        turn = first + [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Go on."}]
        r = E.post(proxy.url, "/v1/chat/completions", {"model": E.MODEL_NAME, "messages": turn, "max_tokens": 4})
        E.assert_ok(r, False)
        after = _prefill_requests(proxy)
        assert after[holder.url] == requests[holder.url] + 1, (n, holder.url, requests, after)
        hits = E.delta(holder, HITS, before, 2 * BLOCK)
        assert hits >= 2 * BLOCK, f"chat {n}: {hits} cached tokens on {holder.url}"
