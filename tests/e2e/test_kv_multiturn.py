"""Decisions on vLLM's KV events against real vLLM: a prefill and a decode with bidirectional
KV transfer, each publishing its KV cache events (block size 32). A conversation's next turn,
past the time the proxy waits for a kept turn's events, is found held by the decode's own
events and reads it (the index agrees with what vLLM keeps: no ``decode_dropped``); a prompt
the decode holds (computed there without the proxy) goes to the decode alone.
"""

from __future__ import annotations

import time

import pytest
import vllm_e2e as E

CLUSTER = "mtkv"
ORDER = 1
pytestmark = pytest.mark.vllm

BLOCK = 32


def kv_multiturn_cluster(log_dir: str) -> E.Cluster:
    """1 prefill + 1 decode, tiny Llama, NIXL pull with bidirectional transfer, KV events on."""
    bidir = {"bidirectional_kv_xfer": True}
    events = ["--block-size", str(BLOCK)]
    return E.Cluster(CLUSTER, {
        "prefill": E.Vllm("mtkv-prefill", "tiny-model", 0, max_model_len=2048, kv_events=True,
                          args=["--kv-transfer-config", E.nixl_config("kv_producer", extra=bidir), *events]),
        "decode": E.Vllm("mtkv-decode", "tiny-model", 1, max_model_len=2048, kv_events=True,
                         args=["--kv-transfer-config", E.nixl_config("kv_consumer", extra=bidir), *events]),
    }, log_dir)


# This module's own cluster, run after the others (the manager starts one cluster at a time).
E.CLUSTERS.setdefault(CLUSTER, kv_multiturn_cluster)
if CLUSTER not in E.CLUSTER_ORDER:
    E.CLUSTER_ORDER.append(CLUSTER)


@pytest.fixture(scope="module")
def mtkv(clusters):
    return clusters.get(CLUSTER)


def _metric(proxy, name: str, **labels: str) -> float:
    return E.Metrics.scrape(proxy.url).get(name, **labels)


def _live(proxy, urls) -> bool:
    m = E.Metrics.scrape(proxy.url)
    return all(m.get("epd_proxy_kv_events_connected", url=u) == 1.0 for u in urls)


def _blocks(proxy, url: str) -> int:
    return E.request(proxy.url, "GET", "/status").json()["kv_events"]["instances"][url][0]["blocks"]


def _chat(proxy, messages: list, max_tokens: int = 32) -> str:
    r = E.post(proxy.url, "/v1/chat/completions", {"model": E.MODEL_NAME, "messages": messages,
                                                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    E.assert_ok(r, False)
    return r.json()["choices"][0]["message"]["content"]


def test_a_kept_turn_is_found_held_by_the_decodes_events_and_read(mtkv, start_proxy):
    proxy = start_proxy("mtkv-reuse", prefill=[mtkv.prefill.events_spec()], decode=[mtkv.decode.events_spec()],
                        extra=["--local-prefill-max-tokens", "0"])
    assert E.wait_for(lambda: _live(proxy, [mtkv.prefill.url, mtkv.decode.url]), 60)
    _chat(proxy, [{"role": "user", "content": "Hello there."}], 8)  # the first answer: reuse turns on
    for n in range(2):
        messages = [{"role": "user", "content": E.unique_prompt(words=200)}]
        text = _chat(proxy, messages)
        time.sleep(4.5)  # past the 3 s a kept turn's events are waited for: the index judges it
        reused0 = _metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="reused")
        _chat(proxy, messages + [{"role": "assistant", "content": text},
                                 {"role": "user", "content": E.unique_prompt(words=60)}])
        dropped = _metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="decode_dropped")
        assert dropped == 0, f"turn {n}: the index said decode no longer held what vLLM keeps"
        assert _metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="reused") == reused0 + 1, n


def test_a_prompt_the_decode_holds_is_computed_there_alone(mtkv, start_proxy):
    proxy = start_proxy("mtkv-alone", prefill=[mtkv.prefill.events_spec()], decode=[mtkv.decode.events_spec()],
                        extra=["--no-kv-reuse"])
    assert E.wait_for(lambda: _live(proxy, [mtkv.prefill.url, mtkv.decode.url]), 60)
    prompt = E.unique_prompt(words=200)
    held = _blocks(proxy, mtkv.decode.url)
    # Straight to the decode (another client, another proxy): it computes the prompt itself.
    r = E.post(mtkv.decode.url, "/v1/completions", E.text_body("completions", prompt, max_tokens=1))
    E.assert_ok(r, False)
    assert E.wait_for(lambda: _blocks(proxy, mtkv.decode.url) > held, 20), "no BlockStored reached the proxy"
    before = mtkv.prefill.metrics()
    cached0 = _metric(proxy, "epd_proxy_not_disaggregated_total", reason="cached")
    r = E.post(proxy.url, "/v1/completions", E.text_body("completions", prompt + " And then?", max_tokens=4))
    E.assert_ok(r, False)
    assert _metric(proxy, "epd_proxy_not_disaggregated_total", reason="cached") == cached0 + 1
    after = mtkv.prefill.metrics()
    assert after.get("vllm:prompt_tokens_total") == before.get("vllm:prompt_tokens_total")  # no prefill ran
