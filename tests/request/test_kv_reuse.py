"""kv_reuse.py: turn keys, the store's promises (once, in time, bounded), decode's answer."""

from __future__ import annotations

import json
from array import array

import pytest

from epd_proxy.request.kv_reuse import (
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
    carries_params,
    common_prefix,
    estimate_new_tokens,
    keep_key,
    lookup_key,
    read_answer,
    reuse_params,
    strip_params,
    strip_stream_params,
    tokens_of,
)

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
    assert got is None and reason == UNKNOWN
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
    entry = Entry(dict(PARAMS), "d", 200, 800, 0, b"", ids=ids)
    assert reuse_params(entry, list(range(250)))["remote_num_tokens"] == 200
    changed = list(range(150)) + [7] + list(range(151, 250))  # the answer re-tokenized differently
    params = reuse_params(entry, changed)
    assert params["remote_num_tokens"] == 150 and entry.params["remote_num_tokens"] == 120
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


def test_stream_events_stripped():
    event = b'data: {"id":"x","choices":[],"kv_transfer_params":' + json.dumps(PARAMS).encode() + b"}\n\n"
    out = strip_stream_params(b'data: {"choices":[{"delta":{}}]}\n\n' + event + b"data: [DONE]\n\n")
    assert b"remote_block_ids" not in out and out.endswith(b"data: [DONE]\n\n")
    plain = b'data: {"choices":[],"kv_transfer_params":null}\n\n'
    assert strip_stream_params(plain) is plain
