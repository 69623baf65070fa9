"""multiturn.py: turn keys, the store's promises (once, in time, bounded), decode's answer."""

from __future__ import annotations

import asyncio
import json
from array import array

import pytest
from helpers import Reply, stack, wait_for

from epd_proxy.request.turns.answers import (
    carries_params,
    common_prefix,
    cut_blocks,
    read_answer,
    reuse_params,
    strip_params,
    tokenize_body,
    tokens_of,
)
from epd_proxy.request.turns.multiturn import (
    BOUND,
    EDITED,
    EXPIRED,
    NO_IDS,
    REASONING,
    SUPERSEDED,
    UNKNOWN,
    USED,
    Entry,
    TurnStore,
    answer_message,
    estimate_new_tokens,
    keep_key,
    lookup_key,
    skips_prefill,
)
from epd_proxy.sim import SimConfig, expected_text

SYSTEM = {"role": "system", "content": "be brief"}
PARAMS = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[1, 2, 3]],
          "remote_engine_id": "e-1", "remote_request_id": "chatcmpl-1", "remote_host": "127.0.0.1",
          "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 120, "remote_blocks_expiry_time": 3161.2}


def _answer(text: str = "Paris.", params: dict | None = PARAMS, ids: bool = True, **message) -> bytes:
    doc = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
           "choices": [{"index": 0, "message": {"role": "assistant", "content": text, **message},
                        "logprobs": None, "finish_reason": "stop", "stop_reason": None,
                        "token_ids": list(range(1000, 1021)) if ids else None}],
           "usage": {"prompt_tokens": 100, "completion_tokens": 21, "total_tokens": 121},
           "prompt_token_ids": list(range(100)) if ids else None,
           "kv_transfer_params": params}
    return json.dumps(doc, separators=(",", ":")).encode()


def _turn1() -> dict:
    return {"model": "m", "messages": [SYSTEM, {"role": "user", "content": "capital of France?"}],
            "max_tokens": 32, "temperature": 0}


def _turn2(answer: str = "Paris.", **changes) -> dict:
    body = _turn1()
    body["messages"] = body["messages"] + [{"role": "assistant", "content": answer},
                                           {"role": "user", "content": "and of Spain?"}]
    body.update(changes)
    return body


def _keep(store: TurnStore, body: dict, text: str = "Paris.", now: float = 0.0, decode: str = "http://d1",
          tokens: int = 120, hint: str | None = None) -> Entry:
    key, conversation, chars = keep_key(body, answer_message(text, None), hint)
    entry = Entry(dict(PARAMS), decode, tokens, chars, now + store.life, conversation, body.get("model"))
    store.put(key, entry, now)
    return entry


# -- turn keys --------------------------------------------------------------------------------


def test_next_turn_finds_the_previous_answer():
    store = TurnStore(480, 15, 0)
    entry = _keep(store, _turn1())
    key, conversation, before, new = lookup_key(_turn2())
    got, reason, stale = store.take(key, conversation, 1.0)
    assert got is entry and reason == "" and stale is None
    assert new == len("and of Spain?") and before > 0


@pytest.mark.parametrize("change", [
    {"answer": "Paris!"},  # the client edited the answer
    {"model": "other"},  # another model's KV
    {"tools": [{"type": "function", "function": {"name": "f"}}]},  # tools change the template
    {"chat_template_kwargs": {"enable_thinking": False}},
])
def test_any_change_to_what_makes_the_prompt_misses(change):
    store = TurnStore(480, 15, 0)
    _keep(store, _turn1())
    answer = change.pop("answer", "Paris.")
    key, conversation, _, _ = lookup_key(_turn2(answer, **change))
    got, reason, _ = store.take(key, conversation, 1.0)
    assert got is None and reason in (EDITED, UNKNOWN)


def test_sampling_fields_may_change_between_turns():
    store = TurnStore(480, 15, 0)
    entry = _keep(store, _turn1())
    key, conversation, _, _ = lookup_key(_turn2(max_tokens=7, temperature=0.5, stream=True, seed=3))
    assert store.take(key, conversation, 1.0)[0] is entry


def test_edited_history_misses_and_releases_the_stale_entry():
    store = TurnStore(480, 15, 0)
    entry = _keep(store, _turn1())
    body = _turn2()
    body["messages"][1] = {"role": "user", "content": "capital of Italy?"}  # an earlier message changed
    key, conversation, _, _ = lookup_key(body)
    got, reason, stale = store.take(key, conversation, 1.0)
    # The opening changed, so this is another conversation as far as the key can tell.
    assert got is None and reason == UNKNOWN and stale is None
    body = _turn2()
    body["messages"].insert(3, {"role": "user", "content": "wait"})  # a message added before the new one
    body["messages"][2] = {"role": "assistant", "content": "Lyon."}
    key, conversation, _, _ = lookup_key(body)
    got, reason, stale = store.take(key, conversation, 1.0)
    assert got is None and reason == EDITED and stale is entry
    assert store.released[SUPERSEDED] == 1 and not store.held


def test_assistant_message_with_extra_fields_is_not_looked_up():
    body = _turn2()
    body["messages"][2]["name"] = "bot"  # rendered by some templates: the held tokens never had it
    assert lookup_key(body) is None
    body["messages"][2].pop("name")
    body["messages"][2]["refusal"] = None  # empty fields are fine
    assert lookup_key(body) is not None


def test_no_previous_answer_no_lookup():
    assert lookup_key(_turn1()) is None
    body = _turn2()
    body["messages"] = body["messages"][:3]  # the request continues the answer itself
    assert lookup_key(body) is None


def test_conversation_id_hint_groups_turns():
    store = TurnStore(480, 15, 0)
    entry = _keep(store, _turn1(), hint="c-1")
    body = _turn2()
    body["messages"][2] = {"role": "assistant", "content": "Lyon."}
    key, conversation, _, _ = lookup_key(body, "c-1")
    got, reason, stale = store.take(key, conversation, 1.0)
    assert got is None and reason == EDITED and stale is entry


# -- the store ----------------------------------------------------------------------------------


def test_taken_once_then_used():
    store = TurnStore(480, 15, 0)
    _keep(store, _turn1())
    key, conversation, _, _ = lookup_key(_turn2())
    assert store.take(key, conversation, 1.0)[0] is not None
    got, reason, _ = store.take(key, conversation, 1.0)  # a retry, or the same turn at once
    assert got is None and reason == USED


def test_expiry_on_the_proxys_clock_with_the_margin():
    store = TurnStore(ttl=20, margin=5, max_held=0)
    _keep(store, _turn1(), now=100.0)
    key, conversation, _, _ = lookup_key(_turn2())
    got, reason, _ = store.take(key, conversation, 115.0)  # 20 s TTL - 5 s margin from receipt
    assert got is None and reason == EXPIRED
    assert store.released[EXPIRED] == 1 and not store.held and len(store) == 0


def test_held_tokens_bounded_per_decode_oldest_let_go():
    store = TurnStore(480, 15, max_held=250)
    first = _keep(store, _turn1(), tokens=120)
    other = _turn1()
    other["messages"][1] = {"role": "user", "content": "another conversation"}
    second = _keep(store, other, tokens=120)
    elsewhere = _turn1()
    elsewhere["messages"][1] = {"role": "user", "content": "on the other decode"}
    _keep(store, elsewhere, tokens=200, decode="http://d2")
    assert store.held == {"http://d1": 240, "http://d2": 200}
    third = _turn1()
    third["messages"][1] = {"role": "user", "content": "a third one"}
    released = store.put(b"k3", Entry(dict(PARAMS), "http://d1", 100, 10, 1e9, b"c3"), 0.0)
    assert released == [first] and store.released[BOUND] == 1
    assert store.held == {"http://d1": 220, "http://d2": 200}
    assert second in store._entries.values()


def test_the_next_turn_supersedes_the_previous_entry():
    store = TurnStore(480, 15, 0)
    first = _keep(store, _turn1())
    body = _turn2()
    key, conversation, _, _ = lookup_key(body)
    store.take(key, conversation, 1.0)
    second = _keep(store, body, "Madrid.")
    assert len(store) == 1 and second in store._entries.values() and first not in store._entries.values()
    # a turn kept without its predecessor being used (a stream in between): the old one goes
    body3 = dict(body, messages=body["messages"] + [{"role": "assistant", "content": "Madrid."},
                                                    {"role": "user", "content": "and Portugal?"}])
    released = store.put(b"x", Entry(dict(PARAMS), "http://d1", 1, 1, 1e9, second.conversation), 2.0)
    assert released == [second] and store.released[SUPERSEDED] == 1
    assert lookup_key(body3) is not None


def test_drop_decode():
    store = TurnStore(480, 15, 0)
    _keep(store, _turn1())
    assert len(store.drop_decode("http://d1")) == 1 and not store.held and len(store) == 0


def test_estimate_uses_the_conversations_own_ratio():
    entry = Entry({}, "d", tokens=100, chars=400, deadline=0, conversation=b"")
    assert estimate_new_tokens(entry, 40, 1) == 10 + 16
    assert estimate_new_tokens(Entry({}, "d", 0, 0, 0, b""), 40, 1) == 10 + 16


def test_a_prefill_is_skipped_only_for_a_few_tokens_on_a_quiet_decode():
    assert skips_prefill(40, 0, 64, 0)
    assert not skips_prefill(65, 0, 64, 0)  # too much to compute on decode
    assert not skips_prefill(40, 1, 64, 0)  # another stream would wait for it
    assert skips_prefill(40, 2, 64, 2) and not skips_prefill(40, 2.5, 64, 2)
    assert not skips_prefill(0, 0, 0, 0)  # --local-prefill-max-tokens 0: never


# -- decode's answer ----------------------------------------------------------------------------


def test_read_answer_strips_and_keeps():
    body = _answer()
    assert carries_params(body)
    read = read_answer(body)
    assert read.params == PARAMS and read.message == answer_message("Paris.", None)
    assert read.ids.tolist() == list(range(100)) + list(range(1000, 1020))  # remote_num_tokens: 120
    assert json.loads(read.body)["kv_transfer_params"] is None
    assert read.body.replace(b'"kv_transfer_params":null', b"") == body[:body.rfind(b'"kv_transfer_params"')] + b"}"
    stripped = json.loads(read_answer(body, strip_ids=True).body)
    assert stripped["prompt_token_ids"] is None and stripped["choices"][0]["token_ids"] is None
    assert stripped["choices"][0]["message"]["content"] == "Paris."
    assert stripped == dict(json.loads(_answer(ids=False)), kv_transfer_params=None)


def test_answer_without_token_ids_is_not_kept():
    read = read_answer(_answer(ids=False))
    assert read.params is None and read.reason == NO_IDS


def test_reuse_reads_only_the_tokens_the_prompt_shares():
    ids = array("l", range(200))
    held = dict(PARAMS, remote_num_tokens=200, remote_block_ids=[list(range(10, 23))])  # 13 blocks of 16
    entry = Entry(held, "d", 200, 800, 0, b"", ids=ids)
    assert reuse_params(entry, list(range(250))) == held
    changed = list(range(150)) + [7] + list(range(151, 250))  # the answer re-tokenized differently
    params = reuse_params(entry, changed)
    # the first 10 blocks hold tokens 0..159: vLLM reads the last blocks named, so only those are
    assert params["remote_num_tokens"] == 150 and params["remote_block_ids"] == [list(range(10, 20))]
    assert entry.params["remote_block_ids"] == [list(range(10, 23))]
    assert reuse_params(entry, [5] + list(range(1, 250))) is None  # nothing worth reading
    assert common_prefix(ids, list(range(10))) == 10 and common_prefix(ids, []) == 0
    assert tokens_of(b'{"count":2,"max_model_len":9,"tokens":[4,5],"token_strs":null}') == [4, 5]
    assert tokens_of(b'{"error":"x"}') is None


def test_answer_without_params_is_untouched():
    body = _answer(params=None)
    assert not carries_params(body)
    assert strip_params(body) is body


def test_reasoning_answers_are_not_kept():
    read = read_answer(_answer(reasoning_content="hmm"))
    assert read.params is None and read.reason == REASONING
    assert json.loads(read.body)["kv_transfer_params"] is None


def test_params_that_hold_nothing_are_not_kept():
    read = read_answer(_answer(params=dict(PARAMS, do_remote_decode=False)))
    assert read.params is None


def test_other_apis_only_strip():
    read = read_answer(_answer(), chat=False)
    assert read.params is None and json.loads(read.body)["kv_transfer_params"] is None


def test_answer_text_containing_the_key_is_left_alone():
    body = _answer(text='he said "kv_transfer_params":{} once')
    out = read_answer(body).body
    doc = json.loads(out)
    assert doc["kv_transfer_params"] is None
    assert doc["choices"][0]["message"]["content"] == 'he said "kv_transfer_params":{} once'


# -- through the proxy, over the simulator's bidirectional transfer ------------------------------

SIM_SYSTEM = " ".join(f"w{i}" for i in range(300))  # a long system prompt, the same on every turn


def _sim(**kw) -> SimConfig:
    return SimConfig(itl_ms=0, ttft_ms=0.5, bidirectional=True, **kw)


def _t1(user: str = "first question here", answer: int = 120) -> dict:
    return {"model": "sim-model", "max_tokens": answer,
            "messages": [{"role": "system", "content": SIM_SYSTEM}, {"role": "user", "content": user}]}


def _next(prev: dict, user: str = " ".join(f"u{i}" for i in range(100)), answer: int = 120, **extra) -> dict:
    msgs = prev["messages"] + [{"role": "assistant", "content": expected_text(prev)},
                               {"role": "user", "content": user}]
    return {"model": "sim-model", "max_tokens": answer, "messages": msgs, **extra}


def _reads(cluster) -> list[dict]:
    """The decode parameters each prefill was given to read (not those sent only to free the
    blocks: ``remote_num_tokens`` 0)."""
    out = []
    for rec in cluster.records("prefill"):
        body = _body_of(rec)
        kv = body.get("kv_transfer_params")
        if kv is not None and kv.get("do_remote_decode") is True and kv.get("remote_block_ids") \
                and kv.get("remote_num_tokens"):
            out.append(kv)
    return out


def _body_of(rec) -> dict:
    body = json.loads(rec.body) if isinstance(rec.body, bytes) and rec.body else rec.body
    return body if isinstance(body, dict) else {}


async def _ask(client, body) -> Reply:
    r = await client.chat(body)
    assert r.status == 200, r.body
    doc = r.json()
    assert doc["kv_transfer_params"] is None and doc.get("prompt_token_ids") is None
    assert doc["choices"][0].get("token_ids") is None
    assert r.text() == expected_text(body)
    return r


def _wrong(cluster) -> int:
    return sum(i.stats.wrong_answers for i in cluster.instances("prefill"))


def _counts(proxy) -> dict:
    """The turns' outcomes so far (turns/outcomes.py)."""
    return proxy.app.pipeline.reuse.counts.turns


async def test_turns_read_the_previous_answer_from_decode():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        b2 = _next(b1)
        await _ask(client, b2)
        b3 = _next(b2)
        await _ask(client, b3)
        assert len(_reads(cluster)) == 2
        p = cluster.instances("prefill")[0]
        assert p.stats.external_cached_tokens >= 2 * 64  # each read at least vLLM's threshold
        # a stream turn reads too (the simulator's stream, as 0.32's, carries no parameters)
        b4 = _next(b3, stream=True)
        r = await client.chat(b4)
        assert r.text() == expected_text(b4) and b"remote_block_ids" not in r.body
        assert len(_reads(cluster)) == 3 and _wrong(cluster) == 0
        assert _counts(proxy)["reused"] == 3 and "edited" not in _counts(proxy)


async def test_two_requests_of_one_turn_at_once_only_one_reads():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        b2 = _next(b1)
        await asyncio.gather(_ask(client, b2), _ask(client, b2))
        assert len(_reads(cluster)) == 1 and _counts(proxy)["already_used"] == 1 and _counts(proxy)["reused"] == 1
        await _ask(client, b2)  # a retry of the turn later: no second read either
        assert len(_reads(cluster)) == 1 and _counts(proxy)["already_used"] == 2
        assert _wrong(cluster) == 0


async def test_edited_history_and_a_fork_do_not_read():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        edited = _next(b1)
        edited["messages"][2] = {"role": "assistant", "content": expected_text(b1) + " (edited)"}
        await _ask(client, edited)
        assert not _reads(cluster) and _counts(proxy)["edited"] == 1
        assert proxy.app.pipeline.turns.released["superseded"] == 1
        assert _wrong(cluster) == 0


async def test_expired_parameters_are_not_used():
    async with stack(sim=_sim(), local_prefill_max_tokens=0, kv_reuse_ttl=0.5, kv_reuse_margin=0.2) as (
            cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        await asyncio.sleep(0.35)
        await _ask(client, _next(b1))
        assert not _reads(cluster) and _counts(proxy)["expired"] == 1


async def test_a_restarted_decode_fails_the_read_and_the_prefill_runs_again_without():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        d = cluster.instances("decode")[0]
        await d.crash()
        await d.restart()
        await _ask(client, _next(b1))  # prefill answers 500 with the parameters; the request is served
        assert len(_reads(cluster)) == 1 and _counts(proxy)["prefill_failed"] == 1
        assert "reused" not in _counts(proxy) and _wrong(cluster) == 0


async def test_a_decode_out_of_rotation_is_not_read_from():
    async with stack(sim=_sim(), decode=2, local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        pool = proxy.app.pipeline.decode
        held = set(proxy.app.pipeline.turns.held)
        assert len(held) == 1
        pool.outliers.drain(pool.find(held.pop()))
        await _ask(client, _next(b1))
        assert not _reads(cluster) and _counts(proxy)["decode_gone"] == 1


async def test_a_short_follow_up_is_served_by_the_holding_decode_alone():
    async with stack(sim=_sim()) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        prefills = len(cluster.records("prefill"))
        b2 = _next(b1, "ok?", answer=40)
        await _ask(client, b2)
        assert len(cluster.records("prefill")) == prefills  # no prefill leg at all
        assert _counts(proxy)["local_prefill"] == 1
        last = cluster.records("decode")[-1]
        assert _body_of(last)["kv_transfer_params"] == {"do_remote_decode": False, "do_remote_prefill": False}
        # the locally prefilled turn kept its blocks too: the next turn reads them
        b3 = _next(b2)
        await _ask(client, b3)
        assert len(_reads(cluster)) == 1 and _wrong(cluster) == 0


@pytest.mark.parametrize("max_streams", [0, 1])
async def test_a_short_follow_up_skips_the_prefill_only_while_its_decode_runs_few_streams(max_streams):
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, bidirectional=True, roles={"decode": {"itl_ms": 5}})
    async with stack(sim=sim, local_prefill_max_streams=max_streams) as (cluster, proxy, client):
        b1 = _t1(answer=20)
        await _ask(client, b1)
        decode = proxy.app.pipeline.decode.instances[0]
        other = asyncio.create_task(_ask(client, _t1("another conversation", answer=100)))  # 0.5 s on decode
        await wait_for(lambda: decode.inflight == 1)
        prefills = len(cluster.records("prefill"))
        await _ask(client, _next(b1, "ok?", answer=4))
        c, declined = _counts(proxy), proxy.app.pipeline.reuse.counts.declined
        if max_streams == 0:  # the other stream would have waited for the local prefill
            assert (c.get("local_prefill", 0), declined, c.get("reused", 0)) == (0, 1, 1)
            assert len(cluster.records("prefill")) > prefills
        else:
            assert (c.get("local_prefill", 0), declined, c.get("reused", 0)) == (1, 0, 0)
            assert len(cluster.records("prefill")) == prefills
        assert not other.done()
        await other
        assert _wrong(cluster) == 0


async def test_no_kv_reuse_still_keeps_the_parameters_from_clients():
    async with stack(sim=_sim(), kv_reuse=False) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        await _ask(client, b1)
        await _ask(client, _next(b1))
        assert not _reads(cluster) and proxy.app.pipeline.turns is None


async def test_conversation_id_is_a_hint_never_forwarded():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = dict(_t1(), conversation_id="conv-1")
        await _ask(client, b1)
        b2 = dict(_next(b1), conversation_id="conv-1")
        await _ask(client, b2)
        assert all("conversation_id" not in _body_of(r) for r in cluster.records())
        assert len(_reads(cluster)) == 1


async def test_parameters_that_will_not_be_used_free_decodes_blocks_early():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        d = cluster.instances("decode")[0]
        kept = d.kv_reuse.kept_requests
        edited = _next(b1)
        edited["messages"][2] = {"role": "assistant", "content": "something else"}
        await _ask(client, edited)  # turn 1's parameters can no longer be used
        counts = proxy.app.pipeline.reuse.counts
        await wait_for(lambda: counts.freed == 1)
        # turn 1's blocks were freed; the edited turn's are still kept
        assert d.kv_reuse.kept_requests == kept
        assert _wrong(cluster) == 0


def test_tokenize_body_only_when_it_can_see_the_whole_prompt():
    body = _turn2(tools=[{"type": "function", "function": {"name": "f"}}], cache_salt="s", max_tokens=3)
    assert tokenize_body(body) == {"model": "m", "messages": body["messages"], "tools": body["tools"]}
    assert tokenize_body(_turn2(reasoning_effort="high")) is None
    assert tokenize_body(_turn2(documents=[{"text": "x"}])) is None


@pytest.mark.parametrize("held, nblocks, shared, want", [
    (200, 13, 150, 10),  # 16-token blocks
    (255, 16, 100, 7),  # 16-token blocks, the last token's slot in the last block
    (1000, 8, 300, 3),  # 128-token blocks (vLLM on CPU)
    (100, 1, 70, 1),  # one block: whatever its size
])
def test_cut_blocks(held, nblocks, shared, want):
    assert cut_blocks([list(range(nblocks))], held, shared) == [list(range(want))]


def test_cut_blocks_refuses_what_it_cannot_tell():
    assert cut_blocks([[1, 2], [3]], 30, 20) is None  # two groups
    assert cut_blocks([[]], 30, 20) is None
    assert cut_blocks([list(range(9))], 200, 150) is None  # no power of two gives 9 blocks for 200 tokens


async def test_a_decode_that_leaves_takes_its_kept_parameters_with_it():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        await _ask(client, _t1())
        turns = proxy.app.pipeline.turns
        (url,) = set(turns.held)
        assert proxy.app.pipeline.reuse.decodes == {url: True}
        proxy.app.membership.unregister(url, source="static")
        assert not turns.held and len(turns) == 0 and turns.released["decode_gone"] == 1
        assert proxy.app.pipeline.reuse.decodes == {}  # one joining at that URL is asked anew


async def test_parameters_a_refused_prefill_never_got_go_to_the_retry():
    async with stack(sim=_sim(), prefill=2, local_prefill_max_tokens=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        home = cluster.records("prefill")[-1].instance  # cache-aware sends the next turn there first
        dead = next(i for i in cluster.instances("prefill") if i.name == home)
        await dead.crash()
        await _ask(client, _next(b1))
        assert len(_reads(cluster)) == 1 and _counts(proxy)["reused"] == 1
        assert _wrong(cluster) == 0


async def test_parameters_taken_for_a_prefill_that_never_ran_are_freed():
    async with stack(sim=_sim(), local_prefill_max_tokens=0, decode_retries=0) as (cluster, proxy, client):
        b1 = _t1()
        await _ask(client, b1)
        await cluster.instances("prefill")[0].crash()
        r = await client.chat(_next(b1))
        assert r.status == 503
        turns = proxy.app.pipeline.turns
        assert _counts(proxy)["request_failed"] == 1 and "reused" not in _counts(proxy) and not turns.held
