"""Multi-turn KV reuse across two proxy replicas sharing one state store (a real
redis-server), against real vLLM: 1 prefill + 1 decode over NIXL with
``bidirectional_kv_xfer``. Turn 1 goes through replica A, turn 2 through replica B: B takes
the parameters A kept from the store and turn 2's prefill reads turn 1's answer from decode
(``vllm:external_prefix_cache_hits_total`` on the prefill grows); turn 3 goes back through A.
Every answer equals a single instance's (the same greedy request to decode alone)."""

from __future__ import annotations

import pytest
import vllm_e2e as E
from redis_server import SERVER, RedisServer
from test_pd_multiturn import READ_MIN, _ask_next, _body, _reference

CLUSTER = "mt"
ORDER = 20
pytestmark = pytest.mark.vllm

SYSTEM = ("You answer in plain words and keep to the point. " * 16).strip()


@pytest.fixture(scope="module")
def store():
    if SERVER is None:
        pytest.skip("redis-server is not installed (scripts/ensure-system-packages.sh installs it)")
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def replicas(mt, start_proxy, store):
    out = []
    for name in ("shared-a", "shared-b"):
        p = start_proxy(name, prefill=[mt.prefill.url], decode=[mt.decode.url],
                        extra=["--local-prefill-max-tokens", "0", "--state-store", store.url])
        # Each replica learns from an answer with parameters that decode keeps blocks (the
        # other would learn it from the store within a second).
        r = E.post(p.url, "/v1/chat/completions", _body([{"role": "user", "content": f"warm {name}"}]))
        assert r.status == 200 and r.json().get("kv_transfer_params") is None, E.describe(r)
        out.append(p)
    return out


def _turn(proxy, messages: list) -> str:
    r = E.post(proxy.url, "/v1/chat/completions", _body(messages))
    assert r.status == 200, E.describe(r)
    doc = r.json()
    assert doc.get("kv_transfer_params") is None and doc["choices"][0].get("token_ids") is None, E.describe(r)
    return E.text_of(r, "chat")


def test_a_turn_through_the_other_replica_reads_the_previous_answer_from_decode(mt, replicas):
    a, b = replicas
    used = [E.Metrics.scrape(p.url).get("epd_proxy_kv_reuse_turns_total", outcome="reused") for p in (a, b)]
    messages = _ask_next(mt, [{"role": "system", "content": SYSTEM}], "shared-1")
    text = _turn(a, messages)
    assert text == _reference(mt, messages)
    for turn, replica in ((2, b), (3, a)):
        messages = _ask_next(mt, messages + [{"role": "assistant", "content": text}], f"shared-{turn}")
        p0 = mt.prefill.metrics()
        text = _turn(replica, messages)
        assert E.delta(mt.prefill, E.EXT_HITS, p0, READ_MIN) >= READ_MIN, f"turn {turn}"
        assert text == _reference(mt, messages), f"turn {turn}"
    after = [E.Metrics.scrape(p.url).get("epd_proxy_kv_reuse_turns_total", outcome="reused") for p in (a, b)]
    assert after[0] - used[0] == 1 and after[1] - used[1] == 1
    for p in (a, b):
        m = E.Metrics.scrape(p.url)
        assert m.get("epd_proxy_state_store_up", store="redis") == 1
