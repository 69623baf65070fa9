"""Multi-turn KV reuse through epd-proxy against real vLLM: 1 prefill + 1 decode over NIXL with
``bidirectional_kv_xfer`` on both (docs/protocol.md §2.10).

Turn N's decode keeps its blocks and answers with ``kv_transfer_params``; the proxy keeps them
for the conversation and gives them to turn N+1's prefill, which reads the previous answer's
KV from decode (``vllm:external_prefix_cache_hits_total`` on the prefill grows) instead of
computing it. Every answer must equal a single instance's: the same greedy request sent to
the decode instance alone with its own ``cache_salt``, so that no block from the
disaggregated path (which may carry KV prefill read from decode) can be found in its prefix
cache. No answer may carry kv_transfer_params. A short follow-up skips the prefill and is
served by the decode that holds the conversation.
"""

from __future__ import annotations

import uuid

import pytest
import vllm_e2e as E

CLUSTER = "mt"
ORDER = 10
pytestmark = pytest.mark.vllm

SYSTEM = ("You are a careful assistant. " * 24).strip()
ANSWER_TOKENS = 96  # above vLLM's 64-token kv_recompute_threshold: prefill reads, not recomputes


@pytest.fixture(scope="module")
def proxy(mt, start_proxy):
    p = start_proxy("mt", prefill=[mt.prefill.url], decode=[mt.decode.url],
                    extra=["--local-prefill-max-tokens", "64"])
    # The proxy learns from decode's first answer with parameters that decode keeps blocks;
    # from then on it asks decode for the token ids it checks next prompts against.
    r = E.post(p.url, "/v1/chat/completions", _body([{"role": "user", "content": _user(8)}]))
    assert r.status == 200, E.describe(r)
    assert r.json().get("kv_transfer_params") is None, E.describe(r)
    assert _proxy_metric(p, "epd_proxy_kv_reuse_fallbacks_total", reason="no_token_ids") == 1
    return p


def _user(words: int = 80) -> str:
    """A user turn of about ``words`` tokens (well above the local-prefill threshold)."""
    return E.unique_prompt(words)


def _body(messages: list, stream: bool = False) -> dict:
    return {"model": E.MODEL_NAME, "messages": messages, "max_tokens": ANSWER_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def _reference(mt, messages: list) -> str:
    ref = E.post(mt.decode.url, "/v1/chat/completions",
                 dict(_body(messages), cache_salt=f"ref-{uuid.uuid4().hex}"))
    assert ref.status == 200, E.describe(ref)
    return ref.json()["choices"][0]["message"]["content"]


def _turn(proxy, mt, messages: list, stream: bool = False) -> tuple[str, E.Response]:
    r = E.post(proxy.url, "/v1/chat/completions", _body(messages, stream))
    assert r.status == 200, E.describe(r)
    if stream:
        for ev in r.events():
            assert ev == "[DONE]" or not ev.get("kv_transfer_params"), ev
    else:
        doc = r.json()
        assert doc.get("kv_transfer_params") is None, E.describe(r)
        assert doc.get("prompt_token_ids") is None and doc["choices"][0].get("token_ids") is None, E.describe(r)
    return E.text_of(r, "chat"), r


def _proxy_metric(proxy, name: str, **labels: str) -> float:
    return E.Metrics.scrape(proxy.url).get(name, **labels)


def test_three_turns_read_the_previous_answer_from_decode(mt, proxy):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user()}]
    used0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="used")
    text, _ = _turn(proxy, mt, messages)
    assert text == _reference(mt, messages)
    for turn in (2, 3):
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": _user()}]
        p0 = mt.prefill.metrics()
        text, _ = _turn(proxy, mt, messages)
        # The prefill read the previous answer (and what of the prompt its own cache lacked) from decode.
        assert E.delta(mt.prefill, E.EXT_HITS, p0, ANSWER_TOKENS - 1) >= ANSWER_TOKENS - 1, f"turn {turn}"
        assert text == _reference(mt, messages), f"turn {turn}"
    assert _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="used") - used0 == 2
    # A stream turn: 0.32's decode stream carries no parameters, but the turn reads the last
    # non-streamed answer's blocks and answers the same.
    messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": _user()}]
    p0 = mt.prefill.metrics()
    streamed, _ = _turn(proxy, mt, messages, stream=True)
    assert E.delta(mt.prefill, E.EXT_HITS, p0, ANSWER_TOKENS - 1) >= ANSWER_TOKENS - 1
    assert streamed == _reference(mt, messages)


def test_retry_of_a_turn_does_not_reuse_twice(mt, proxy):
    """The same turn sent again (a client's retry) must not get the parameters a second time:
    vLLM would answer it wrongly. It falls back and still answers the same."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user()}]
    text, _ = _turn(proxy, mt, messages)
    messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": _user()}]
    first, _ = _turn(proxy, mt, messages)
    used0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_fallbacks_total", reason="used")
    again, _ = _turn(proxy, mt, messages)
    assert first == again == _reference(mt, messages)
    assert _proxy_metric(proxy, "epd_proxy_kv_reuse_fallbacks_total", reason="used") - used0 == 1


def test_short_follow_up_skips_the_prefill(mt, proxy):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user()}]
    text, _ = _turn(proxy, mt, messages)
    messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    p0, d0 = mt.prefill.metrics(), mt.decode.metrics()
    local0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="local_prefill")
    text, _ = _turn(proxy, mt, messages)
    assert E.delta(mt.decode, "vllm:request_success_total", d0, 1) == 1
    assert mt.prefill.metrics().get("vllm:request_success_total") == p0.get("vllm:request_success_total")
    assert _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="local_prefill") - local0 == 1
    # Decode found the conversation in its own prefix cache.
    assert E.delta(mt.decode, "vllm:prefix_cache_hits_total", d0, 128) >= 128
    assert text == _reference(mt, messages)
    # The locally prefilled turn kept its blocks too: the next turn reads them.
    messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": _user()}]
    p0 = mt.prefill.metrics()
    text, _ = _turn(proxy, mt, messages)
    assert E.delta(mt.prefill, E.EXT_HITS, p0, ANSWER_TOKENS - 1) >= ANSWER_TOKENS - 1
    assert text == _reference(mt, messages)
