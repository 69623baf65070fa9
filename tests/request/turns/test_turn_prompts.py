"""turns/prompts.py and turns/reuse.py for completions and generate (and what Messages and
Responses get): a prompt API's turns found by what decode holds, read once, never wrong."""

from __future__ import annotations

import json

from helpers import stack, wait_for

from epd_proxy.request.turns.multiturn import NO_IDS, UNKNOWN, USED, Entry, TurnStore
from epd_proxy.request.turns.prompts import (
    COMPLETIONS,
    GENERATE,
    PREFIX,
    candidate_keys,
    keep_key,
    prefix_key,
    prompt_material,
    read_prompt_answer,
)
from epd_proxy.sim import SimConfig, expected_text

PARAMS = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[1, 2, 3, 4]],
          "remote_engine_id": "e-1", "remote_request_id": "cmpl-1", "remote_num_tokens": 64}
LONG = " ".join(f"w{i}" for i in range(300)) + "\n"


def _completion(text: str, params: dict | None = PARAMS, ids: bool = True) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop", "stop_reason": None,
              "token_ids": list(range(1000, 1010)) if ids else None, "prompt_logprobs": None,
              "prompt_token_ids": list(range(54)) if ids else None}
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice],
                       "kv_transfer_params": params}).encode()


# -- pure ------------------------------------------------------------------------------------


def test_material_of_each_prompt_shape():
    assert prompt_material({"prompt": "ab"}, COMPLETIONS) == (b"ab", True)
    assert prompt_material({"prompt": ["ab"]}, COMPLETIONS) == (b"ab", True)
    assert prompt_material({"prompt": [[1, 2]]}, COMPLETIONS)[1] is False
    assert prompt_material({"token_ids": [1, 2]}, GENERATE)[1] is False
    assert prompt_material({"prompt": ["a", "b"]}, COMPLETIONS) is None  # a batch: no one continuation
    assert prompt_material({"prompt": "a", "suffix": "z"}, COMPLETIONS) is None
    assert prompt_material({"prompt": "a", "echo": True}, COMPLETIONS) is None
    assert prompt_material({"token_ids": [-1]}, GENERATE) is None


def test_the_next_prompt_finds_the_held_turn_at_its_length():
    store = TurnStore(480, 15, 0)
    body = {"model": "m", "prompt": LONG, "max_tokens": 10}
    held = read_prompt_answer(body, COMPLETIONS, _completion(" an answer"))
    assert held.reason == "" and held.held == (LONG + " an answer").encode() and len(held.ids) == 64
    prefix = prefix_key(body, COMPLETIONS, LONG.encode())
    entry = Entry(held.params, "http://d", 64, len(held.held), 100.0, keep_key(body, COMPLETIONS, held.held),
                  "m", held.ids, prefix)
    store.put(entry.conversation, entry, 0.0)
    nxt = {"model": "m", "prompt": LONG + " an answer\nmore", "max_tokens": 3, "temperature": 1}
    material = prompt_material(nxt, COMPLETIONS)[0]
    assert prefix_key(nxt, COMPLETIONS, material) == prefix
    keys = candidate_keys(nxt, COMPLETIONS, material, store.lengths(prefix))
    assert keys == [(entry.conversation, len(held.held))]
    assert store.take(keys[0][0], None, 1.0)[0] is entry
    # taken: a second request of the turn finds the tombstone at the same length
    keys = candidate_keys(nxt, COMPLETIONS, material, store.lengths(prefix))
    assert store.take(keys[0][0], None, 1.0)[1] == USED
    # another model, or an edited answer: no candidate matches
    other = dict(nxt, model="m2")
    assert prefix_key(other, COMPLETIONS, material) != prefix
    edited = dict(nxt, prompt=LONG + " an answex\nmore")
    keys = candidate_keys(edited, COMPLETIONS, edited["prompt"].encode(), store.lengths(prefix))
    assert store.take(keys[0][0], None, 1.0)[1] == UNKNOWN


def test_short_prompts_and_the_held_turn_itself_are_not_candidates():
    assert prefix_key({}, COMPLETIONS, b"x" * (PREFIX - 1)) is None
    body = {"prompt": LONG}
    assert candidate_keys(body, COMPLETIONS, LONG.encode(), [len(LONG.encode())]) == []


def test_answers_without_ids_or_with_several_choices_are_not_kept():
    body = {"model": "m", "prompt": LONG}
    assert read_prompt_answer(body, COMPLETIONS, _completion("x", ids=False)).reason == NO_IDS
    doc = json.loads(_completion("x"))
    doc["choices"].append(dict(doc["choices"][0], index=1))
    assert read_prompt_answer(body, COMPLETIONS, json.dumps(doc).encode()).reason == "choices"
    assert read_prompt_answer(body, COMPLETIONS, _completion("x", params=None)).params is None


def test_generate_holds_the_prompt_ids_and_the_answer_ids():
    body = {"model": "m", "token_ids": list(range(60)), "sampling_params": {"max_tokens": 10}}
    answer = json.dumps({"choices": [{"index": 0, "token_ids": [7] * 10}],
                         "kv_transfer_params": dict(PARAMS, remote_num_tokens=69)}).encode()
    held = read_prompt_answer(body, GENERATE, answer)
    assert held.ids.tolist() == list(range(60)) + [7] * 9  # cut at remote_num_tokens
    assert len(held.held) == 70 * 8


# -- through the proxy, over the simulator -------------------------------------------------------


def _sim(**kw) -> SimConfig:
    return SimConfig(**{"itl_ms": 0, "ttft_ms": 0.5, "bidirectional": True, "enable_scale_out": True, **kw})


def _reads(cluster) -> list[dict]:
    out = []
    for rec in cluster.records("prefill"):
        body = json.loads(rec.body) if isinstance(rec.body, bytes) and rec.body else rec.body
        kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if kv and kv.get("do_remote_decode") is True and kv.get("remote_block_ids") and kv.get("remote_num_tokens"):
            out.append(kv)
    return out


def _wrong(cluster) -> int:
    return sum(i.stats.wrong_answers for i in cluster.instances("prefill"))


async def _complete(client, body) -> str:
    r = await client.post("/v1/completions", body)
    assert r.status == 200, r.body
    doc = r.json()
    assert doc["kv_transfer_params"] is None
    assert doc["choices"][0]["token_ids"] is None and doc["choices"][0]["prompt_token_ids"] is None
    text = doc["choices"][0]["text"]
    assert text == expected_text(body)
    return text


async def test_completions_turns_read_the_previous_answer_from_decode():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        await _complete(client, {"model": "sim-model", "prompt": "warm up", "max_tokens": 4})
        b1 = {"model": "sim-model", "prompt": LONG, "max_tokens": 120}
        a1 = await _complete(client, b1)
        b2 = {"model": "sim-model", "prompt": LONG + a1 + "\n" + " ".join(f"u{i}" for i in range(80)) + "\n",
              "max_tokens": 120}
        a2 = await _complete(client, b2)
        b3 = dict(b2, prompt=b2["prompt"] + a2 + "\nthird turn here\n")
        await _complete(client, b3)
        assert len(_reads(cluster)) == 2 and _wrong(cluster) == 0
        assert cluster.instances("prefill")[0].stats.external_cached_tokens >= 2 * 64
        outcomes = proxy.app.pipeline.reuse.counts.turns
        assert outcomes["reused"] == 2
        await _complete(client, b3)  # the same turn again: the parameters are gone
        assert len(_reads(cluster)) == 2 and outcomes["already_used"] == 1 and _wrong(cluster) == 0


async def test_a_short_completions_follow_up_is_served_by_the_holding_decode_alone():
    async with stack(sim=_sim()) as (cluster, proxy, client):
        await _complete(client, {"model": "sim-model", "prompt": "warm up", "max_tokens": 4})
        b1 = {"model": "sim-model", "prompt": LONG, "max_tokens": 60}
        a1 = await _complete(client, b1)
        prefills = len(cluster.records("prefill"))
        await _complete(client, {"model": "sim-model", "prompt": LONG + a1 + "\nok?\n", "max_tokens": 20})
        assert len(cluster.records("prefill")) == prefills
        assert proxy.app.pipeline.reuse.counts.turns["local_prefill"] == 1


async def _generate(client, body) -> list[int]:
    r = await client.post(GENERATE, body)
    assert r.status == 200, r.body
    doc = r.json()
    assert doc["kv_transfer_params"] is None
    return doc["choices"][0]["token_ids"]


async def test_generate_turns_read_by_token_prefix_without_tokenize():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        await _generate(client, {"model": "sim-model", "token_ids": [5, 6], "sampling_params": {"max_tokens": 2}})
        b1 = {"model": "sim-model", "token_ids": list(range(10, 310)), "sampling_params": {"max_tokens": 100}}
        out1 = await _generate(client, b1)
        b2 = dict(b1, token_ids=b1["token_ids"] + out1 + list(range(400, 480)))
        out2 = await _generate(client, b2)
        assert len(_reads(cluster)) == 1 and _wrong(cluster) == 0
        assert not any(r.path == "/tokenize" for r in cluster.records())
        # the answer equals a fresh instance's for the same tokens (nothing read wrongly)
        async with stack(sim=_sim(bidirectional=False)) as (_, _, plain):
            assert await _generate(plain, b2) == out2


async def test_messages_and_responses_answers_lose_their_parameters_and_free_the_blocks():
    async with stack(sim=_sim(), local_prefill_max_tokens=0) as (cluster, proxy, client):
        await _complete(client, {"model": "sim-model", "prompt": "warm up", "max_tokens": 4})
        d = cluster.instances("decode")[0]
        kept = d.kv_reuse.kept_requests
        counts = proxy.app.pipeline.reuse.counts
        before = counts.answers.get(NO_IDS, 0)
        r = await client.post("/v1/messages", {"model": "sim-model", "max_tokens": 8,
                                               "messages": [{"role": "user", "content": LONG}]})
        assert r.status == 200 and r.json().get("kv_transfer_params") is None, r.body
        r = await client.post("/v1/responses", {"model": "sim-model", "input": LONG, "max_output_tokens": 8,
                                                "store": False})
        assert r.status == 200 and r.json().get("kv_transfer_params") is None, r.body
        assert counts.answers[NO_IDS] == before + 2
        await wait_for(lambda: counts.freed == 2)
        assert d.kv_reuse.kept_requests == kept


async def test_a_stored_response_retrieved_never_shows_the_parameters():
    async with stack(sim=_sim(responses_store=True), local_prefill_max_tokens=0) as (cluster, proxy, client):
        r = await client.post("/v1/responses", {"model": "sim-model", "input": LONG, "max_output_tokens": 8})
        assert r.status == 200 and r.json().get("kv_transfer_params") is None, r.body
        rid = r.json()["id"]
        got = await client.request("GET", f"/v1/responses/{rid}")
        assert got.status == 200 and got.json()["id"] == rid and got.json().get("kv_transfer_params") is None
        # A follow-up by previous_response_id is served whole by the decode that holds the
        # conversation (its own prefix cache): no prefill, nothing to read.
        prefills = len(cluster.records("prefill"))
        r = await client.post("/v1/responses", {"model": "sim-model", "input": "and then?", "max_output_tokens": 8,
                                                "previous_response_id": rid})
        assert r.status == 200 and r.json().get("kv_transfer_params") is None, r.body
        assert len(cluster.records("prefill")) == prefills


async def test_a_generate_stream_is_kept_from_its_last_event_and_read_by_the_next_turn():
    async with stack(sim=_sim(bidirectional_stream_params=True), local_prefill_max_tokens=0) as (
            cluster, proxy, client):
        await _generate(client, {"model": "sim-model", "token_ids": [5, 6], "sampling_params": {"max_tokens": 2}})
        b1 = {"model": "sim-model", "token_ids": list(range(10, 310)), "sampling_params": {"max_tokens": 100},
              "stream": True}
        r = await client.post(GENERATE, b1)
        assert r.status == 200 and b"remote_block_ids" not in r.body and b'"kv_transfer_params":null' in r.body
        out1 = []
        for event in r.body.split(b"\n\n"):
            if event.startswith(b"data: {"):
                for c in json.loads(event[6:])["choices"]:
                    out1 += c["token_ids"]
        assert len(out1) == 100
        b2 = {"model": "sim-model", "token_ids": b1["token_ids"] + out1 + list(range(400, 480)),
              "sampling_params": {"max_tokens": 20}}
        out2 = await _generate(client, b2)
        assert len(_reads(cluster)) == 1 and _wrong(cluster) == 0
        async with stack(sim=_sim(bidirectional=False)) as (_, _, plain):
            assert await _generate(plain, b2) == out2
