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

import random
import time
import uuid

import pytest
import vllm_e2e as E

CLUSTER = "mt"
ORDER = 10
pytestmark = pytest.mark.vllm

SYSTEM = ("You are a careful assistant. " * 24).strip()
ANSWER_TOKENS = 96  # above vLLM's 64-token kv_recompute_threshold: prefill reads, not recomputes
# What a prefill reads at least when it reads (vLLM's kv_recompute_threshold). How much it reads
# depends on how far the answer's text re-tokenizes as decode generated it: the proxy lowers
# remote_num_tokens to the tokens the new prompt shares with decode's.
READ_MIN = 64


@pytest.fixture(scope="module")
def proxy(mt, start_proxy):
    p = start_proxy("mt", prefill=[mt.prefill.url], decode=[mt.decode.url],
                    extra=["--local-prefill-max-tokens", "64"])
    # The proxy asks a decode it has not heard from for the token ids of its first answer: that
    # answer comes with parameters (decode keeps blocks) and is kept like any other.
    r = E.post(p.url, "/v1/chat/completions", _body([{"role": "user", "content": _user("warm", 8)}]))
    assert r.status == 200, E.describe(r)
    assert r.json().get("kv_transfer_params") is None and r.json().get("prompt_token_ids") is None, E.describe(r)
    assert _proxy_metric(p, "epd_proxy_kv_reuse_answers_total", result="kept") == 1
    return p


def _user(seed: str, words: int = 80) -> str:
    """A user turn of about ``words`` tokens (well above the local-prefill threshold), the
    same text for the same seed: the greedy answers, hence how far their text re-tokenizes
    as decode generated it, are the same from run to run."""
    base = "The quick brown fox jumps over the lazy dog and runs far away".split()
    rnd = random.Random(seed)
    return f"Note {seed}: " + " ".join(rnd.choice(base) for _ in range(words))


def _ask_next(mt, messages: list, seed: str) -> list:
    """``messages`` and a new user message of about 80 words, sized so that the prompt ends
    72 to 112 tokens into a 128-token block (vLLM's CPU block size): the prefill's own cache
    then stops at least 72 tokens short of this prompt's end, so the next turn's prefill reads
    at least that much from decode even if the answer's text re-tokenizes differently from its
    first token on (the proxy reads only as far as the tokens match)."""
    for extra in range(0, 128):
        out = messages + [{"role": "user", "content": _user(seed, 80 + extra)}]
        r = E.post(mt.decode.url, "/tokenize", {"model": E.MODEL_NAME, "messages": out})
        assert r.status == 200, E.describe(r)
        if 72 <= r.json()["count"] % 128 <= 112:
            return out
    raise AssertionError("no size found")


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
    messages = _ask_next(mt, [{"role": "system", "content": SYSTEM}], "s1")
    used0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="reused")
    text, _ = _turn(proxy, mt, messages)
    assert text == _reference(mt, messages)
    for turn in (2, 3):
        messages = _ask_next(mt, messages + [{"role": "assistant", "content": text}], f"s2-{turn}")
        p0 = mt.prefill.metrics()
        text, _ = _turn(proxy, mt, messages)
        # The prefill read the previous answer (and what of the prompt its own cache lacked) from decode.
        assert E.delta(mt.prefill, E.EXT_HITS, p0, READ_MIN) >= READ_MIN, f"turn {turn}"
        assert text == _reference(mt, messages), f"turn {turn}"
    assert _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="reused") - used0 == 2
    # A stream turn: 0.32's decode stream carries no parameters, but the turn reads the last
    # non-streamed answer's blocks and answers the same.
    messages = _ask_next(mt, messages + [{"role": "assistant", "content": text}], "s3")
    p0 = mt.prefill.metrics()
    streamed, _ = _turn(proxy, mt, messages, stream=True)
    assert E.delta(mt.prefill, E.EXT_HITS, p0, READ_MIN) >= READ_MIN
    assert streamed == _reference(mt, messages)


def test_the_first_conversation_through_a_fresh_proxy_reads_on_turn_2(mt, proxy, start_proxy):
    """A proxy that has seen no answer yet asks decode for the token ids of its first one (it
    does not know yet whether decode keeps blocks): that conversation's second turn reads too."""
    fresh = start_proxy("mt-first", prefill=[mt.prefill.url], decode=[mt.decode.url],
                        extra=["--local-prefill-max-tokens", "0"])
    messages = _ask_next(mt, [{"role": "system", "content": SYSTEM}], "f1")
    text, _ = _turn(fresh, mt, messages)
    messages = _ask_next(mt, messages + [{"role": "assistant", "content": text}], "f2")
    p0 = mt.prefill.metrics()
    text, r = _turn(fresh, mt, messages)
    assert E.delta(mt.prefill, E.EXT_HITS, p0, READ_MIN) >= READ_MIN
    assert text == _reference(mt, messages)
    assert _proxy_metric(fresh, "epd_proxy_kv_reuse_turns_total", outcome="reused") == 1
    assert 'kv;desc="reused"' in r.headers.get("server-timing", ""), r.headers


def test_retry_of_a_turn_does_not_reuse_twice(mt, proxy):
    """The same turn sent again (a client's retry) must not get the parameters a second time:
    vLLM would answer it wrongly. It falls back and still answers the same."""
    messages = _ask_next(mt, [{"role": "system", "content": SYSTEM}], "s4")
    text, _ = _turn(proxy, mt, messages)
    messages = _ask_next(mt, messages + [{"role": "assistant", "content": text}], "s5")
    first, _ = _turn(proxy, mt, messages)
    used0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="already_used")
    again, _ = _turn(proxy, mt, messages)
    assert first == again == _reference(mt, messages)
    assert _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="already_used") - used0 == 1


def test_short_follow_up_skips_the_prefill(mt, proxy):
    messages = _ask_next(mt, [{"role": "system", "content": SYSTEM}], "s6")
    text, _ = _turn(proxy, mt, messages)
    messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    # Only a decode no other stream would wait on prefills locally (--local-prefill-max-streams
    # 0): vLLM publishes its running count a moment late, so the proxy's scrape of it may
    # still show the last turn.
    assert E.wait_for(lambda: _proxy_metric(proxy, "epd_proxy_instance_other_requests", role="decode") == 0, 10)
    p0, d0 = mt.prefill.metrics(), mt.decode.metrics()
    local0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="local_prefill")
    text, _ = _turn(proxy, mt, messages)
    assert E.delta(mt.decode, "vllm:request_success_total", d0, 1) == 1
    assert mt.prefill.metrics().get("vllm:request_success_total") == p0.get("vllm:request_success_total")
    assert _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="local_prefill") - local0 == 1
    # Decode found the conversation in its own prefix cache.
    assert E.delta(mt.decode, "vllm:prefix_cache_hits_total", d0, 128) >= 128
    assert text == _reference(mt, messages)
    # The locally prefilled turn kept its blocks too (decode answered with parameters): the
    # next turn's prefill gets them.
    messages = _ask_next(mt, messages + [{"role": "assistant", "content": text}], "s7")
    used0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="reused")
    text, _ = _turn(proxy, mt, messages)
    assert _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="reused") - used0 == 1
    assert text == _reference(mt, messages)


def test_measure_local_prefill_against_the_prefill_hop(mt, start_proxy, capsys):
    """Not a check: the time to a one-token answer for a follow-up of N new tokens, served by
    the holding decode alone against prefill (reading the history from decode) then decode.
    What ``--local-prefill-max-tokens``'s default was chosen from (docs/architecture.md)."""
    import statistics
    import time
    local = start_proxy("mt-local", prefill=[mt.prefill.url], decode=[mt.decode.url],
                        extra=["--local-prefill-max-tokens", "100000"])
    hop = start_proxy("mt-hop", prefill=[mt.prefill.url], decode=[mt.decode.url],
                      extra=["--local-prefill-max-tokens", "0"])
    for p in (local, hop):  # each learns that decode keeps blocks
        E.post(p.url, "/v1/chat/completions", _body([{"role": "user", "content": _user(f"w-{p.port}", 8)}]))
    rows = []
    for words in (8, 32, 64, 128, 256):
        times: dict[str, list[float]] = {"local": [], "hop": []}
        for rep in range(3):
            for name, p in (("local", local), ("hop", hop)):
                messages = [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": _user(f"m-{name}-{words}-{rep}")}]
                text, _ = _turn(p, mt, messages)
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": _user(f"n-{name}-{words}-{rep}", words)}]
                t0 = time.perf_counter()
                r = E.post(p.url, "/v1/chat/completions", dict(_body(messages), max_tokens=1))
                times[name].append(time.perf_counter() - t0)
                assert r.status == 200, E.describe(r)
        rows.append((words, statistics.median(times["local"]) * 1000, statistics.median(times["hop"]) * 1000))
    with capsys.disabled():
        print("\n[e2e] follow-up of N words, time to a 1-token answer (ms, median of 3): local prefill on "
              "decode / prefill hop reading from decode")
        for words, a, b in rows:
            print(f"[e2e]   {words:4d} words: {a:7.1f} / {b:7.1f}")


# -- /v1/completions: the next prompt is the previous prompt, its answer and something new ----


def _completion_body(prompt: str, **kw) -> dict:
    return {"model": E.MODEL_NAME, "prompt": prompt, "max_tokens": ANSWER_TOKENS, "temperature": 0,
            "ignore_eos": True, **kw}


def _next_prompt(mt, prompt: str, seed: str) -> str:
    """``prompt`` and a new part of about 80 words, sized as ``_ask_next`` sizes a chat turn."""
    for extra in range(0, 128):
        out = prompt + f"\n\nUser: {_user(seed, 80 + extra)}\nAssistant:"
        r = E.post(mt.decode.url, "/tokenize", {"model": E.MODEL_NAME, "prompt": out})
        assert r.status == 200, E.describe(r)
        if 72 <= r.json()["count"] % 128 <= 112:
            return out
    raise AssertionError("no size found")


def _complete(proxy, prompt: str) -> str:
    r = E.post(proxy.url, "/v1/completions", _completion_body(prompt))
    assert r.status == 200, E.describe(r)
    doc = r.json()
    assert doc.get("kv_transfer_params") is None, E.describe(r)
    ch = doc["choices"][0]
    assert ch.get("token_ids") is None and ch.get("prompt_token_ids") is None, E.describe(r)
    return ch["text"]


def _completion_reference(mt, prompt: str) -> str:
    ref = E.post(mt.decode.url, "/v1/completions", _completion_body(prompt, cache_salt=f"ref-{uuid.uuid4().hex}"))
    assert ref.status == 200, E.describe(ref)
    return ref.json()["choices"][0]["text"]


def test_completions_turns_read_the_previous_answer_from_decode(mt, proxy):
    prompt = _next_prompt(mt, SYSTEM, "c1")
    used0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="reused")
    text = _complete(proxy, prompt)
    assert text == _completion_reference(mt, prompt)
    for turn in (2, 3):
        prompt = _next_prompt(mt, prompt + text, f"c2-{turn}")
        p0 = mt.prefill.metrics()
        text = _complete(proxy, prompt)
        assert E.delta(mt.prefill, E.EXT_HITS, p0, READ_MIN) >= READ_MIN, f"turn {turn}"
        assert text == _completion_reference(mt, prompt), f"turn {turn}"
    assert _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="reused") - used0 == 2
    # The same turn again: the parameters were used; it falls back and answers the same.
    again = _complete(proxy, prompt)
    assert again == text


# -- /v1/messages and /v1/responses: not reused (no token ids to check by), never shown ----------


def test_messages_and_responses_never_show_the_parameters_and_let_the_blocks_go(mt, proxy):
    """vLLM 0.32 answers both with decode's parameters (Messages: the non-stream body;
    Responses: the non-stream body and the stream's response.completed event) but takes no
    return_token_ids there: the proxy takes them out and frees decode's blocks at once."""
    no_ids0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_answers_total", result="no_token_ids")
    freed0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_freed_total")
    user = _user("r1", 40)
    r = E.post(proxy.url, "/v1/messages", {"model": E.MODEL_NAME, "max_tokens": 16,
                                           "messages": [{"role": "user", "content": user}]})
    assert r.status == 200 and r.json().get("kv_transfer_params") is None, E.describe(r)
    r = E.post(proxy.url, "/v1/responses", {"model": E.MODEL_NAME, "input": user, "max_output_tokens": 16,
                                            "store": False})
    assert r.status == 200 and r.json().get("kv_transfer_params") is None, E.describe(r)
    r = E.post(proxy.url, "/v1/responses", {"model": E.MODEL_NAME, "input": user, "max_output_tokens": 16,
                                            "store": False, "stream": True})
    assert r.status == 200, E.describe(r)
    completed = [ev for ev in r.events() if isinstance(ev, dict) and ev.get("type") == "response.completed"]
    assert len(completed) == 1 and completed[0]["response"].get("kv_transfer_params") is None
    assert b"remote_block_ids" not in r.body
    # each of the three answers carried parameters on decode's side
    assert _proxy_metric(proxy, "epd_proxy_kv_reuse_answers_total", result="no_token_ids") - no_ids0 == 3
    deadline = time.monotonic() + 10
    while _proxy_metric(proxy, "epd_proxy_kv_reuse_freed_total") - freed0 < 3:
        assert time.monotonic() < deadline, "decode's blocks were not let go"
        time.sleep(0.2)


# -- /inference/v1/generate: token ids in and out; the check is a token-id prefix -----------------


def _generate(base: str, token_ids: list[int], **kw) -> list[int]:
    body = {"model": E.MODEL_NAME, "token_ids": token_ids,
            "sampling_params": {"max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True}, **kw}
    r = E.post(base, "/inference/v1/generate", body)
    assert r.status == 200, E.describe(r)
    return r.json()["choices"][0]["token_ids"]


def _padded(ids: list[int], pool: list[int]) -> list[int]:
    """``ids`` and as many of ``pool`` as end the prompt 90 tokens into a 128-token block (as
    ``_ask_next`` sizes a chat turn), and at least 60 of them."""
    n = 60
    while (len(ids) + n) % 128 != 90:
        n += 1
    return ids + pool[:n]


def test_generate_turns_read_the_previous_answer_from_decode(mt, proxy):
    words = E.post(mt.decode.url, "/tokenize", {"model": E.MODEL_NAME, "prompt": SYSTEM + " " + _user("g", 400)})
    assert words.status == 200, E.describe(words)
    pool = words.json()["tokens"]
    ids = _padded([], pool)
    used0 = _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="reused")
    for turn in (1, 2, 3):
        p0 = mt.prefill.metrics()
        r = E.post(proxy.url, "/inference/v1/generate", {
            "model": E.MODEL_NAME, "token_ids": ids,
            "sampling_params": {"max_tokens": ANSWER_TOKENS, "temperature": 0, "ignore_eos": True}})
        assert r.status == 200, E.describe(r)
        assert r.json().get("kv_transfer_params") is None, E.describe(r)
        out = r.json()["choices"][0]["token_ids"]
        if turn > 1:
            assert E.delta(mt.prefill, E.EXT_HITS, p0, READ_MIN) >= READ_MIN, f"turn {turn}"
        ref = _generate(mt.decode.url, ids, cache_salt=f"ref-{uuid.uuid4().hex}")
        assert out == ref, f"turn {turn}"
        ids = _padded(ids + out, pool[turn * 100:])
    assert _proxy_metric(proxy, "epd_proxy_kv_reuse_turns_total", outcome="reused") - used0 == 2


def test_a_plain_request_on_the_prefill_answers_and_pins_nothing(mt):
    """What the proxy sends a prefill when every decode stands still (docs/architecture.md,
    "Every decode standing still: the prefill answers alone"): a request without
    kv_transfer_params on the kv_producer with bidirectional transfer on generates like any
    instance (the decode's greedy answer, token for token) and pins nothing (vLLM 0.32's
    NixlConnector.request_finished: ``if not params: return False, None``): its KV usage is back
    where it was as soon as the answer is."""
    m = E.Metrics.scrape(mt.prefill.url)
    assert m.has("vllm:kv_cache_usage_perc") and m.has("vllm:num_requests_running")
    before = m.get("vllm:kv_cache_usage_perc")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _user("alone", 120)}]
    # Its own cache_salt, as the reference's: computed whole, as the reference is.
    r = E.post(mt.prefill.url, "/v1/chat/completions", dict(_body(messages), cache_salt=f"alone-{uuid.uuid4().hex}"))
    assert r.status == 200, E.describe(r)
    doc = r.json()
    assert doc.get("kv_transfer_params") is None, E.describe(r)  # nothing kept to name
    assert doc["usage"]["completion_tokens"] == ANSWER_TOKENS
    assert doc["choices"][0]["message"]["content"] == _reference(mt, messages)
    s = E.post(mt.prefill.url, "/v1/chat/completions",
               dict(_body(messages, stream=True), cache_salt=f"alone-{uuid.uuid4().hex}"))
    assert s.status == 200, E.describe(s)
    events = s.events()
    assert events[-1] == "[DONE]" and not any(isinstance(ev, dict) and ev.get("kv_transfer_params")
                                              for ev in events)
    assert E.text_of(s, "chat") == doc["choices"][0]["message"]["content"]
    # Both answers' blocks (prompt and 96 tokens: several blocks each) freed at once, not pinned
    # for decoder_kv_blocks_ttl or the prefill's lease.
    deadline = time.monotonic() + 5
    while True:
        m = E.Metrics.scrape(mt.prefill.url)
        usage = m.get("vllm:kv_cache_usage_perc")
        if usage <= before + 1e-9 and m.get("vllm:num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, f"prefill's KV usage {usage} stays above {before}: blocks pinned"
        time.sleep(0.2)
    assert usage < 0.01, usage
