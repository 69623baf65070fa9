"""vLLM's KV cache events with two proxy replicas and an instance restarted mid-test (real vLLM:
the ``kv`` cluster, two prefills and a decode publishing their events).

Two ``epd-proxy serve`` processes, as operators run replicas: they share nothing (no state
store), each subscribes to every instance itself.

- Replica A opens conversations; replica B, started afterwards, learns where their blocks are
  from the instances' replay buffers and sends each next turn to the prefill holding its
  prefix, where ``vllm:prefix_cache_hits_total`` grows. Without the index B would send a
  turn of a conversation it never saw by rendezvous on the conversation's anchor; A's level
  openings placed some conversations against that order, so approximate routing would miss
  them (checked: at least one such conversation is among those B routes).
- A prefill is killed (SIGKILL) and started again on the same ports: both replicas see its
  events stop (not connected), keep answering meanwhile (the other prefill serves), see the
  new engine as a restart (its blocks cleared) and fill the index again from its events.
"""

from __future__ import annotations

import sys
import threading

import pytest
import vllm_e2e as E
from rendezvous import rendezvous_order

from epd_proxy.routing.view import RequestView

CLUSTER = "kv"
ORDER = 2
pytestmark = pytest.mark.vllm

HITS = "vllm:prefix_cache_hits_total"
BLOCK = 32
# Openings A sends before giving up on seeing one placed against the rendezvous order: A's
# openings stay level within 4 (``OPEN_SLACK_MIN``), so the sixth that prefers one prefill
# goes to the other.
MAX_OPENINGS = 10


def _specs(kv) -> dict:
    return {"prefill": [kv.prefill.events_spec(), kv.prefill_b.events_spec()], "decode": [kv.decode.events_spec()]}


@pytest.fixture(scope="module")
def replica_a(kv, start_proxy):
    return start_proxy("kv-replica-a", **_specs(kv))


def _status(proxy) -> dict:
    r = E.request(proxy.url, "GET", "/status")
    assert r.status == 200, E.describe(r)
    return r.json()


def _prefill_requests(proxy) -> dict[str, int]:
    return {i["url"]: i["requests"] for i in _status(proxy)["pools"]["prefill"]}


def _stream(proxy, url: str) -> dict:
    return _status(proxy)["kv_events"]["instances"][url][0]


def _in_rotation(proxy, url: str) -> bool:
    return any(i["url"] == url and i["healthy"] for i in _status(proxy)["pools"]["prefill"])


def _connected(proxy, urls) -> bool:
    m = E.Metrics.scrape(proxy.url)
    up = {lab["url"]: v for n, lab, v in m.samples if n == "epd_proxy_kv_events_connected"}
    return all(up.get(u) == 1.0 for u in urls)


def _chat(messages: list, max_tokens: int = 8) -> dict:
    return {"model": E.MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def _placed(proxy, body: dict) -> str:
    """Send ``body`` through ``proxy``; the prefill it chose."""
    before = _prefill_requests(proxy)
    r = E.post(proxy.url, "/v1/chat/completions", body)
    E.assert_ok(r, False)
    after = _prefill_requests(proxy)
    moved = [u for u in after if after[u] != before.get(u, 0)]
    assert len(moved) == 1, (before, after)
    return moved[0]


def _next_turn(first: list, answer: str) -> list:
    # A new message longer than --local-prefill-max-tokens (64): the decode, which holds the first
    # turn too, would otherwise compute the rest alone and no prefill would be asked.
    return first + [{"role": "assistant", "content": answer},
                    {"role": "user", "content": E.unique_prompt(words=120)}]


def test_replica_b_routes_a_conversation_replica_a_opened(kv, replica_a, start_proxy):
    prefills = [kv.prefill.url, kv.prefill_b.url]
    urls = [*prefills, kv.decode.url]
    assert E.wait_for(lambda: _connected(replica_a, urls), 60), _status(replica_a)["kv_events"]
    # Conversations whose anchor's rendezvous order prefers the first prefill (what a replica
    # without the index would pick for a turn it never saw), opened through A until A's level
    # openings put one on the second.
    preferred = kv.prefill.url
    conversations: list[tuple[list, str, str]] = []  # (first turn, answer, holder)
    while len(conversations) < MAX_OPENINGS and {h for _, _, h in conversations} != set(prefills):
        first = [{"role": "user", "content": E.unique_prompt(words=200)}]
        if rendezvous_order(prefills, RequestView(_chat(first)).anchor)[0] != preferred:
            continue
        before = _prefill_requests(replica_a)
        r = E.post(replica_a.url, "/v1/chat/completions", _chat(first))
        E.assert_ok(r, False)
        after = _prefill_requests(replica_a)
        holder = next(u for u in prefills if after[u] != before[u])
        conversations.append((first, r.json()["choices"][0]["message"]["content"], holder))
    against = [c for c in conversations if c[2] != preferred]
    print(f"\n[e2e] A placed {len(conversations)} openings preferring {preferred}: "
          f"{len(against)} on the other prefill", file=sys.stderr)
    assert against, f"A placed all {len(conversations)} openings on their rendezvous choice"

    # B starts now: the blocks A's turns left reach it through the replay buffers.
    replica_b = start_proxy("kv-replica-b", **_specs(kv))
    assert E.wait_for(lambda: _connected(replica_b, urls), 60), _status(replica_b)["kv_events"]
    for _, _, holder in conversations:
        assert E.wait_for(lambda h=holder: _stream(replica_b, h)["blocks"] > 0, 20)
    exact0 = E.Metrics.scrape(replica_b.url).get("epd_proxy_routing_exact_total", role="prefill")
    # The conversations against the rendezvous order first (the ones approximation misses), then one with.
    chosen = against + [c for c in conversations if c[2] == preferred][:1]
    for n, (first, answer, holder) in enumerate(chosen):
        turn = _next_turn(first, answer)
        # What B would do without the index: rendezvous on the anchor (B never saw this conversation).
        approx = rendezvous_order(prefills, RequestView(_chat(turn)).anchor)[0]
        inst = kv.prefill if holder == kv.prefill.url else kv.prefill_b
        before = inst.metrics()
        got = _placed(replica_b, _chat(turn))
        assert got == holder, f"conversation {n}: B chose {got}, the prefix is on {holder} (rendezvous {approx})"
        hits = E.delta(inst, HITS, before, 2 * BLOCK)
        assert hits >= 2 * BLOCK, f"conversation {n}: {hits} cached tokens on {holder}"
    exact = E.Metrics.scrape(replica_b.url).get("epd_proxy_routing_exact_total", role="prefill") - exact0
    assert exact >= len(chosen), exact
    # Events from every instance, in each replica's metrics (the decode's too: it stores the
    # blocks it received and the ones its answers filled).
    for proxy in (replica_a, replica_b):
        m = E.Metrics.scrape(proxy.url)
        received = {lab["url"]: v for name, lab, v in m.samples if name == "epd_proxy_kv_events_received_total"}
        assert all(received.get(u, 0) > 0 for u in urls), received


class _Traffic:
    """Chat requests through the replicas in a loop, on a thread: every answer must be a 200."""

    def __init__(self, proxies) -> None:
        self.proxies = proxies
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            proxy = self.proxies[n % len(self.proxies)]
            n += 1
            try:
                r = E.post(proxy.url, "/v1/chat/completions",
                           _chat([{"role": "user", "content": E.unique_prompt(words=60)}], max_tokens=4), timeout=60)
                if r.status == 200:
                    self.ok += 1
                else:
                    self.failures.append(E.describe(r))
            except OSError as exc:
                self.failures.append(repr(exc))
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=90)


def test_a_restarted_prefill_is_cleared_and_refilled(kv, replica_a, start_proxy, e2e_log_dir):
    victim = kv.prefill_b
    urls = [kv.prefill.url, kv.prefill_b.url, kv.decode.url]
    replicas = [replica_a, start_proxy("kv-replica-c", **_specs(kv))]
    assert all(E.wait_for(lambda p=p: _connected(p, urls), 60) for p in replicas)
    # The victim holds something in both indexes before it dies.
    first = [{"role": "user", "content": E.unique_prompt(words=200)}]
    E.assert_ok(E.post(victim.url, "/v1/chat/completions", _chat(first, max_tokens=1)), False)
    for p in replicas:
        assert E.wait_for(lambda p=p: _stream(p, victim.url)["blocks"] > 0, 20), _stream(p, victim.url)
    restarts = {p.url: _stream(p, victim.url)["restarts"] for p in replicas}

    traffic = _Traffic(replicas)
    try:
        victim.kill()
        # Its replay socket stops answering: the index no longer speaks for it.
        for p in replicas:
            assert E.wait_for(lambda p=p: not _stream(p, victim.url)["connected"], 15), _stream(p, victim.url)
        served = traffic.ok
        assert E.wait_for(lambda: traffic.ok >= served + 4 or traffic.failures, 60), (traffic.ok, traffic.failures)
        # A replica started while the instance is down (before it, as pods start in any order).
        late = start_proxy("kv-replica-d", **_specs(kv))
        assert E.wait_for(lambda: _connected(late, [kv.prefill.url, kv.decode.url]), 60)
        assert not _stream(late, victim.url)["connected"]
    finally:
        traffic.stop()
    assert not traffic.failures, traffic.failures[:5]
    print(f"\n[e2e] {traffic.ok} requests answered while {victim.url} was down", file=sys.stderr)
    victim.restart(e2e_log_dir)
    # Back: connected again, the new engine recognised as one (a restart counted, the dead
    # engine's blocks gone: nothing was sent to the new one yet).
    for p in replicas:
        assert E.wait_for(lambda p=p: _stream(p, victim.url)["connected"], 30), _stream(p, victim.url)
        assert E.wait_for(lambda p=p: _stream(p, victim.url)["restarts"] > restarts[p.url], 15), \
            _stream(p, victim.url)
        assert _stream(p, victim.url)["blocks"] == 0, _stream(p, victim.url)
    # The late replica connects to it as it comes up: nothing to clear, nothing held yet.
    assert E.wait_for(lambda: _stream(late, victim.url)["connected"], 30), _stream(late, victim.url)
    assert _stream(late, victim.url)["blocks"] == 0
    replicas.append(late)
    # The new engine's events fill the index again, and a next turn is routed on them (once the
    # replicas take the instance back: its failed requests and probes ejected it for a while).
    for p in replicas:
        assert E.wait_for(lambda p=p: _in_rotation(p, victim.url), 90), _status(p)["pools"]["prefill"]
    first = [{"role": "user", "content": E.unique_prompt(words=200)}]
    r = E.post(victim.url, "/v1/chat/completions", _chat(first, max_tokens=1))
    E.assert_ok(r, False)
    for p in replicas:
        assert E.wait_for(lambda p=p: _stream(p, victim.url)["blocks"] > 0, 20), _stream(p, victim.url)
    before = victim.metrics()
    turn = _next_turn(first, r.json()["choices"][0]["message"]["content"])
    got = _placed(replicas[1], _chat(turn))
    assert got == victim.url, f"sent to {got}; the restarted {victim.url} holds the prefix"
    assert E.delta(victim, HITS, before, 2 * BLOCK) >= 2 * BLOCK
