"""Cache-aware routing against real vLLM: two plain (PD) instances behind the proxy, two-turn
conversations whose second turn carries the first (a long opening message and its answer).
Each conversation's turns must land on one instance, where vLLM's
own ``vllm:prefix_cache_hits_total`` grows by the shared prefix's blocks, and the answers must be
the ones a single instance gives for the same request.

The pd cluster's two instances serve here as two PD instances: a request without
``kv_transfer_params`` runs start to finish on either (NIXL does not enforce ``kv_role``). The
same test with ``--routing round-robin`` sends every second turn to the other instance and fails
(no prefix hit there), so it cannot pass by luck of placement.
"""

from __future__ import annotations

import pytest
import vllm_e2e as E

CLUSTER = "pd"
ORDER = 16  # after test_pd_usage, before the failures (which stop instances)
pytestmark = pytest.mark.vllm

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
BLOCK = 128  # vLLM's CPU KV block size: hits come in whole blocks
CONVERSATIONS = 4


@pytest.fixture(scope="module")
def proxy(pd, start_proxy):
    # No --prefill: both instances are the PD role; the policy is the proxy's default for it.
    return start_proxy("pd-routing", decode=[pd.prefill.url, pd.decode.url])


def _requests_by_url(proxy) -> dict[str, int]:
    status = E.request(proxy.url, "GET", "/status").json()
    return {i["url"]: i["requests"] for i in status["pools"]["decode"]}


def _text(resp: E.Response, endpoint: str) -> str:
    choice = resp.json()["choices"][0]
    return choice["text"] if endpoint == "completions" else choice["message"]["content"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_each_conversation_stays_where_its_prefix_is_cached(pd, proxy, endpoint):
    assert E.request(proxy.url, "GET", "/status").json()["routing"]["decode"] == "cache-aware"
    instances = {pd.prefill.url: pd.prefill, pd.decode.url: pd.decode}
    path = E.endpoint_path(endpoint)
    placed = []
    for n in range(CONVERSATIONS):
        opening = E.unique_prompt(words=400)  # several 128-token blocks, shared by no earlier request
        body = E.text_body(endpoint, opening + f" First question of conversation {n}.", max_tokens=8)
        served = []
        for k in range(2):
            before_requests = _requests_by_url(proxy)
            before = {url: inst.metrics() for url, inst in instances.items()}
            r = E.post(proxy.url, path, body)
            E.assert_ok(r, False)
            after_requests = _requests_by_url(proxy)
            chosen = [u for u in instances if after_requests[u] == before_requests[u] + 1]
            assert len(chosen) == 1, (before_requests, after_requests)
            url = chosen[0]
            served.append(url)
            other = next(u for u in instances if u != url)
            # The prompt was looked up in the chosen instance's prefix cache, not in the other's.
            assert E.delta(instances[url], QUERIES, before[url], 1) > 0
            assert instances[other].metrics().get(QUERIES) == before[other].get(QUERIES)
            if k == 1:
                hits = E.delta(instances[url], HITS, before[url], 2 * BLOCK)
                assert hits >= 2 * BLOCK, f"turn 2 found {hits} cached tokens on {url}"
            # The answer is the one the serving instance gives for the request on its own.
            direct = E.post(url, path, body)
            E.assert_ok(direct, False)
            answer = _text(r, endpoint)
            assert answer == _text(direct, endpoint)
            # The next turn carries the conversation so far, as a chat client sends it.
            question = f" Second question of conversation {n}."
            if endpoint == "completions":
                body = dict(body, prompt=body["prompt"] + answer + question)
            else:
                body = dict(body, messages=body["messages"] + [{"role": "assistant", "content": answer},
                                                               {"role": "user", "content": question}])
        assert served[0] == served[1], f"conversation {n}: turns went to {served}"
        placed.append(served[0])
    # Affinity is per conversation, not one instance for everything: with four unrelated
    # conversations, rendezvous hashing over two instances places them on both (1 in 8
    # that all four share one; the prefixes are random, so a rerun draws new ones).
    print(f"\n[e2e] conversations placed on: {placed}")
