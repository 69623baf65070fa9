"""Multi-turn reuse an operator can see: each turn's one outcome (outcomes.py) in the metrics,
the access log and ``Server-Timing``; the tokenize call apart from the prefill legs; held KV
per decode in ``/status``; and the first answer a proxy sees kept like any other."""

from __future__ import annotations

import io
import re

import msgspec
from helpers import Client, stack
from test_multiturn import _ask, _next, _reads, _sim, _t1, _wrong

from epd_proxy import ProxyConfig, start_proxy
from epd_proxy.observe.access_log import AccessLog
from epd_proxy.request.context import RequestContext
from epd_proxy.request.turns.multiturn import (
    BOUND,
    EXPIRED,
    SUPERSEDED,
    UNKNOWN,
    Entry,
    KVReuse,
    TurnStore,
    answer_message,
    earlier_keys,
    keep_key,
    lookup_key,
)
from epd_proxy.request.turns.outcomes import RETRIED, REUSED
from epd_proxy.request.turns.reuse import TurnReuse
from epd_proxy.runtime.serve import config_for_cluster
from epd_proxy.sim import SimConfig, expected_text

PARAMS = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[1, 2, 3]],
          "remote_num_tokens": 40}


def _body(*turns: str) -> dict:
    """A chat request whose history holds ``turns`` (user, answer, user, answer, ...)."""
    roles = ("user", "assistant")
    return {"model": "m", "messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


def _keep(store: TurnStore, body: dict, answer: str, now: float = 0.0, tokens: int = 40) -> Entry:
    key, conversation, chars = keep_key(body, answer_message(answer, None))
    entry = Entry(dict(PARAMS), "http://d1", tokens, chars, now + store.life, conversation, "m", key=key)
    store.put(key, entry, now)
    return entry


# -- the store says why it has nothing, after the entry is gone ------------------------------


def test_a_turn_let_go_before_its_next_turn_says_why():
    store = TurnStore(ttl=20, margin=5, max_held=50)
    _keep(store, _body("q1"), "a1", now=0.0)
    _keep(store, _body("other"), "b1", now=1.0)  # the bound (50 tokens) lets the first go
    key, conversation, _, _ = lookup_key(_body("q1", "a1", "q2"))
    assert store.take(key, conversation, 2.0)[1] == BOUND
    # expired, and swept by an unrelated put before the next turn came: still told as expired
    _keep(store, _body("third"), "c1", now=3.0)
    store.put(b"x", Entry(dict(PARAMS), "http://d2", 1, 1, 100.0, b"x"), 30.0)
    key, conversation, _, _ = lookup_key(_body("third", "c1", "q2"))
    assert store.take(key, conversation, 30.0)[1] == EXPIRED
    # the same turn answered again: the first answer's next turn is superseded
    first = _body("regen")
    _keep(store, first, "r1", now=31.0)
    _keep(store, _body("regen", "r1", "more"), "r2", now=31.0)
    key, conversation, _, _ = lookup_key(_body("regen", "r1", "other branch"))
    assert store.take(key, conversation, 32.0)[1] == SUPERSEDED  # a branch from turn 1 after turn 2 was kept
    assert store.released[SUPERSEDED] == 1
    assert store.take(b"never kept", None, 32.0)[1] == UNKNOWN


def test_earlier_keys_name_the_older_turns_a_history_carries():
    t1 = _body("q1")
    k1 = keep_key(t1, answer_message("a1", None))[0]
    t2 = _body("q1", "a1", "q2")
    k2 = keep_key(t2, answer_message("a2", None))[0]
    t3 = _body("q1", "a1", "q2", "a2", "q3")
    assert earlier_keys(t3) == {k1}  # the previous turn's (k2) is lookup_key's
    assert lookup_key(t3)[0] == k2
    edited = _body("q1", "a1 (edited)", "q2", "a2", "q3")
    assert k1 not in earlier_keys(edited)


def test_holding_counts_tokens_and_conversations_per_decode():
    store = TurnStore(480, 15, 0)
    _keep(store, _body("q1"), "a1", tokens=40)
    _keep(store, _body("other"), "b1", tokens=60)
    assert store.holding() == {"http://d1": (100, 2)}


def test_a_later_attempt_whose_read_was_spent_is_retried():
    ctx = RequestContext("r", "/v1/chat/completions", [])
    ctx.kv_outcome, ctx.kv_reuse = REUSED, KVReuse({}, None)
    TurnReuse.again(ctx)  # the prefill never got them (refused): still this attempt's to read
    assert ctx.kv_outcome == REUSED
    ctx.kv_reuse = None  # read by a prefill on the failed attempt
    TurnReuse.again(ctx)
    assert ctx.kv_outcome == RETRIED
    ctx.kv_outcome = "not_held"
    TurnReuse.again(ctx)
    assert ctx.kv_outcome == "not_held"


# -- through the proxy, over the simulator's bidirectional transfer ------------------------------


def _asked_ids(cluster) -> list[bool]:
    return [msgspec.json.decode(r.body).get("return_token_ids") is True for r in cluster.records("decode")]


async def test_the_first_conversation_through_a_fresh_proxy_reuses_on_turn_2():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)  # the first answer this process sees
        await _ask(client, _next(b1))
        assert len(_reads(cluster)) == 1 and _wrong(cluster) == 0
        assert proxy.app.pipeline.reuse.counts.turns == {"reused": 1}


async def test_a_decode_that_keeps_no_blocks_is_asked_for_token_ids_once():
    async with stack(sim=SimConfig(itl_ms=0, ttft_ms=0.5), local_prefill_max_tokens=0) as (
            cluster, proxy, client):
        b1 = _t1()
        first = await _ask(client, b1)  # asked: its decode had not answered this process yet
        await _ask(client, _next(b1))
        await _ask(client, b1)
        assert _asked_ids(cluster) == [True, False, False]
        assert first.json()["prompt_token_ids"] is None  # the client gets what it would unasked
        assert not proxy.app.pipeline.turns.active and proxy.app.pipeline.reuse.counts.turns == {}
        (url,) = [i.url for i in cluster.instances("decode")]
        assert proxy.app.pipeline.reuse.decodes == {url: False}


async def test_each_turn_has_one_outcome_in_the_access_log_and_server_timing():
    for fmt in ("text", "json"):
        out = io.StringIO()
        async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
            proxy.app.pipeline.access_log = AccessLog(fmt, stream=out)
            b1 = _t1()
            await _ask(client, b1)
            r2 = await _ask(client, _next(b1))
            again = await _ask(client, _next(b1))  # the same turn once more: its parameters are spent
            opening = await _ask(client, _t1("a new conversation"))
            timing = [r.headers[b"server-timing"].decode() for r in (r2, again, opening)]
        assert 'kv;desc="reused"' in timing[0] and "tokenize;dur=" in timing[0]
        assert 'kv;desc="already_used"' in timing[1] and 'kv;desc="opening"' in timing[2]
        p = cluster.urls("prefill")[0].split("://")[1]
        lines = out.getvalue().splitlines()
        assert len(lines) == 4
        if fmt == "json":
            docs = [msgspec.json.decode(line) for line in lines]
            assert [d["kv"] for d in docs] == [None, "reused", "already_used", "opening"]
            assert docs[1]["instances"]["tokenize"] == [p] and docs[1]["instances"]["prefill"] == [p]
            assert "tokenize" in docs[1]["stages_ms"]
        else:
            assert " kv=" not in lines[0]  # before any decode answered with parameters: no outcome
            assert [re.search(r" kv=(\S+) ok$", line).group(1) for line in lines[1:]] == \
                ["reused", "already_used", "opening"]
            # the tokenize call is not a second prefill leg (that notation means a retry)
            assert f" tok={p} p={p} d=" in lines[1] and len(re.findall(r" p=", lines[1])) == 1
            assert " tokenize=" in lines[1]


async def test_a_conversation_back_on_a_process_holding_an_older_turn_is_not_called_edited():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, a, client_a):
        config = config_for_cluster(cluster, ProxyConfig(probe_interval=0, scrape_interval=0,
                                                         local_prefill_max_tokens=0))
        async with await start_proxy(config) as b:
            client_b = Client(b.url)
            try:
                await _ask(client_b, _t1("B's own first conversation"))
                b1 = _t1()
                await _ask(client_a, b1)  # A keeps turn 1
                b2 = _next(b1)
                await _ask(client_b, b2)  # B never saw turn 1; it keeps turn 2
                b3 = _next(b2)
                await _ask(client_a, b3)  # back on A, which holds turn 1 of this very history
            finally:
                await client_b.close()
            assert a.app.pipeline.reuse.counts.turns == {"older_turn": 1}
            assert b.app.pipeline.reuse.counts.turns == {"not_held": 1}
            assert a.app.pipeline.turns.released[SUPERSEDED] == 1  # turn 1's blocks let go


async def test_an_edited_history_is_still_edited():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        edited = _next(b1)
        edited["messages"][2] = {"role": "assistant", "content": expected_text(b1) + " (edited)"}
        await _ask(client, edited)
        assert proxy.app.pipeline.reuse.counts.turns == {"edited": 1}


async def test_status_shows_held_kv_per_decode_and_metrics_the_outcomes():
    async with stack(sim=_sim(), decode=2, local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        await _ask(client, _t1("another conversation"))
        await _ask(client, _next(b1))
        status = (await client.request("GET", "/status")).json()
        rows = {d["url"]: d["kv_reuse"] for d in status["pools"]["decode"]}
        held = proxy.app.pipeline.turns.held
        assert sum(r["held_conversations"] for r in rows.values()) == 2
        assert {u: r["held_tokens"] for u, r in rows.items() if r["held_tokens"]} == held
        assert all(r["keeps_blocks"] is True for r in rows.values() if r["held_tokens"])
        metrics = (await client.request("GET", "/metrics")).body
        assert b'epd_proxy_kv_reuse_turns_total{outcome="reused"} 1' in metrics
        assert b'epd_proxy_kv_reuse_turns_total{outcome="opening"} 1' in metrics
        assert b'epd_proxy_kv_reuse_answers_total{result="kept"} 3' in metrics


# -- a turn after a stream without parameters (vLLM 0.32's chat and completions streams) ---------

async def test_a_turn_after_a_stream_without_parameters_says_so_not_not_held():
    """On 0.32 (the simulator's default: parameters in non-stream answers only) a streamed turn
    is never kept: its next turn is ``stream_no_params``, chat and completions alike, while a
    turn nothing here ever answered stays ``not_held``."""
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        proxy.app.pipeline.access_log = AccessLog("text", stream=io.StringIO())
        await _ask(client, _t1("a conversation kept the usual way"))  # reuse is on from here
        streamed = dict(_t1("a conversation whose client streams"), stream=True)
        for _ in range(2):  # the first stream is asked for its token ids; the second is not
            r = await client.chat(streamed)
            assert r.status == 200 and r.events[-1] == b"data: [DONE]"
            streamed = dict(_next(streamed), stream=True)
        r = await client.chat(streamed)
        assert 'kv;desc="stream_no_params"' in r.headers[b"server-timing"].decode()
        assert proxy.app.pipeline.reuse.counts.turns["stream_no_params"] == 2
        # A history no process here answered: still not_held.
        stranger = _next(_t1("a conversation served elsewhere"))
        r = await client.chat(stranger)
        assert 'kv;desc="not_held"' in r.headers[b"server-timing"].decode()
        # Completions: a prompt that extends a streamed prompt and its answer.
        prompt = "Once upon a time " * 10
        first = {"model": "sim-model", "prompt": prompt, "max_tokens": 16, "stream": True}
        r = await client.post("/v1/completions", msgspec.json.encode(first))
        assert r.status == 200
        follow = {"model": "sim-model", "prompt": prompt + expected_text(first) + " and then?", "max_tokens": 16}
        r = await client.post("/v1/completions", msgspec.json.encode(follow))
        assert 'kv;desc="stream_no_params"' in r.headers[b"server-timing"].decode(), r.headers
        assert proxy.app.pipeline.reuse.counts.turns["stream_no_params"] == 3
        metrics = (await client.request("GET", "/metrics")).body.decode()
        assert 'epd_proxy_kv_reuse_turns_total{outcome="stream_no_params"} 3.0' in metrics


def test_unkept_streams_are_bounded_oldest_first():
    from epd_proxy.request.turns.unkept import UnkeptStreams

    unkept = UnkeptStreams(capacity=2)
    bodies = [_t1(f"conversation {n}") for n in range(3)]
    for body in bodies:
        unkept.add_chat(body)
    assert len(unkept) == 2
    follows = [unkept.chat_follows(_next(b), len(b["messages"])) for b in bodies]
    assert follows == [False, True, True]
