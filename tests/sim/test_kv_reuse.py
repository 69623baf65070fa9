"""Bidirectional KV transfer between a simulated decode and prefill (multi-turn reuse), over
real sockets, as vLLM 0.32 behaves (docs: sim/README.md "Bidirectional transfer")."""

from __future__ import annotations

import asyncio
import time

from simhelpers import chat_body, fast_config, metric, nixl_prefill_params, prefill_body

from epd_proxy.sim import SimCluster, expected_text, prompt_tokens

SYSTEM = " ".join(f"w{i}" for i in range(300))  # a long system prompt, the same on every turn
DECODE_FIELDS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                 "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                 "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode"}


def bidi(**kw):
    return fast_config(bidirectional=True, **kw)


def turn1(user: str = "first question here", answer: int = 120) -> dict:
    return {"model": "sim-model", "max_tokens": answer,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}


def follow(prev: dict, user: str = "and then what", answer: int = 120) -> dict:
    """The next turn: the previous messages, the answer the simulator gave, a new user message."""
    msgs = prev["messages"] + [{"role": "assistant", "content": expected_text(prev)},
                               {"role": "user", "content": user}]
    return {"model": "sim-model", "max_tokens": answer, "messages": msgs}


async def pd_turn(http, c, body, *, reuse=None, p=0, d=0, rid="t", stream=False):
    """One P/D turn as a proxy does it: prefill (with decode's parameters from the last turn,
    if any), then decode with prefill's. Returns (prefill's reply, decode's reply)."""
    pbody = prefill_body(body)
    pbody["kv_transfer_params"] = dict(reuse, do_remote_decode=True, do_remote_prefill=False) if reuse \
        else nixl_prefill_params()
    pr = await http.chat(c.urls("prefill")[p], pbody, rid=rid + "-p")
    if pr.status != 200:
        return pr, None
    dbody = dict(body, kv_transfer_params=pr.json["kv_transfer_params"], stream=stream)
    dr = await http.chat(c.urls("decode")[d], dbody, rid=rid)
    return pr, dr


async def metrics(http, inst) -> str:
    return (await http.get(inst.url, "/metrics")).data.decode()


def local_compute(text: str) -> float:
    """``vllm:prompt_tokens_by_source_total{source="local_compute"}``: prompt tokens computed."""
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="local_compute"' in line:
            return float(line.rpartition(" ")[2])
    raise AssertionError("local_compute not exported")


async def test_decode_answer_carries_params_and_keeps_blocks(http):
    async with SimCluster(prefill=1, decode=1, config=bidi(bidirectional_kv_ttl=480.0)) as c:
        body = turn1()
        t0 = time.monotonic()
        _, dr = await pd_turn(http, c, body)
        assert dr.status == 200, dr.data
        out = dr.json
        assert out["choices"][0]["message"]["content"] == expected_text(body)
        kv = out["kv_transfer_params"]
        d = c.instances("decode")[0]
        assert set(kv) == DECODE_FIELDS
        assert kv["do_remote_decode"] is True and kv["do_remote_prefill"] is False
        assert kv["remote_engine_id"] == d.engine_id and (kv["remote_host"], kv["remote_port"]) == (d.host, d.port)
        assert kv["remote_request_id"].startswith("chatcmpl-t-")
        # prompt + answer as the next turn spells them (the assistant's role token and words)
        assert kv["remote_num_tokens"] == prompt_tokens(follow(body)) - 1 - len("and then what".split())
        assert t0 + 479 < kv["remote_blocks_expiry_time"] < time.monotonic() + 481
        nblocks = -(-kv["remote_num_tokens"] // 16)
        assert len(kv["remote_block_ids"][0]) == nblocks == d.kv_reuse.kept_blocks
        m = await metrics(http, d)
        assert metric(m, "sim:kept_kv_blocks") == nblocks and metric(m, "sim:kept_kv_requests") == 1
        assert metric(m, "vllm:kv_cache_usage_perc") == nblocks / 65536
        # prefill's 1-token answer keeps nothing of its own for a next turn
        assert c.instances("prefill")[0].kv_reuse.kept_blocks == 0


async def test_without_bidirectional_nothing_is_kept(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        _, dr = await pd_turn(http, c, turn1())
        assert dr.json["kv_transfer_params"] is None
        assert c.instances("decode")[0].kv_reuse.kept_blocks == 0


async def test_next_turn_prefill_reads_only_beyond_its_own_cache(http):
    async with SimCluster(prefill=2, decode=1, config=bidi()) as c:
        p0, p1 = c.instances("prefill")
        d = c.instances("decode")[0]
        b1 = turn1()
        _, d1 = await pd_turn(http, c, b1, rid="a")
        kv = d1.json["kv_transfer_params"]
        b2 = follow(b1)
        before = await metrics(http, p0)
        pr, d2 = await pd_turn(http, c, b2, reuse=kv, rid="b")
        assert d2.status == 200, d2.data
        assert d2.json["choices"][0]["message"]["content"] == expected_text(b2)
        after = await metrics(http, p0)
        own = metric(after, "vllm:prefix_cache_hits_total") - metric(before, "vllm:prefix_cache_hits_total")
        read = (metric(after, "vllm:external_prefix_cache_hits_total")
                - metric(before, "vllm:external_prefix_cache_hits_total"))
        computed = (local_compute(after)
                    - local_compute(before))
        n1, n2, kept = prompt_tokens(b1), prompt_tokens(b2), kv["remote_num_tokens"]
        assert own == (n1 - 1) // 16 * 16  # turn 1's prompt, whole blocks
        assert read == kept - 1 - own >= 64  # the rest of turn 1 and its answer, from decode
        assert computed == n2 - own - read  # only the new turn
        assert metric(after, "vllm:nixl_bytes_transferred_count") == 1
        # decode freed the blocks it kept for turn 1 (single use); it keeps turn 2's
        dm = await metrics(http, d)
        assert metric(dm, "sim:kv_reuse_reads_total") == 1 and metric(dm, "sim:kv_reuse_read_tokens_total") == read
        assert d.kv_reuse.kept_requests == 1
        kv2 = d2.json["kv_transfer_params"]
        assert kv2["remote_request_id"] != kv["remote_request_id"]
        # a prefill without the prefix reads everything decode kept (but the last token)
        b3 = follow(b2)
        before = await metrics(http, p1)
        _, d3 = await pd_turn(http, c, b3, reuse=kv2, p=1, rid="c")
        assert d3.json["choices"][0]["message"]["content"] == expected_text(b3)
        after = await metrics(http, p1)
        assert metric(after, "vllm:prefix_cache_hits_total") == 0
        assert metric(after, "vllm:external_prefix_cache_hits_total") == kv2["remote_num_tokens"] - 1
        assert local_compute(after) == (
            prompt_tokens(b3) - kv2["remote_num_tokens"] + 1)


async def test_short_remainder_is_recomputed_but_blocks_are_freed(http):
    async with SimCluster(prefill=1, decode=1, config=bidi()) as c:
        p = c.instances("prefill")[0]
        d = c.instances("decode")[0]
        b1 = turn1(answer=20)  # prompt mod 16 + 20 answer tokens < 64
        _, d1 = await pd_turn(http, c, b1, rid="a")
        b2 = follow(b1, answer=8)
        _, d2 = await pd_turn(http, c, b2, reuse=d1.json["kv_transfer_params"], rid="b")
        assert d2.json["choices"][0]["message"]["content"] == expected_text(b2)
        assert metric(await metrics(http, p), "vllm:external_prefix_cache_hits_total") == 0
        dm = await metrics(http, d)
        assert metric(dm, "sim:kv_reuse_releases_total") == 1 and metric(dm, "sim:kv_reuse_reads_total") == 0
        assert d.kv_reuse.kept_requests == 1  # turn 2's only


async def test_params_used_twice_give_a_wrong_answer_with_200(http):
    async with SimCluster(prefill=2, decode=1, config=bidi()) as c:
        b1 = turn1()
        _, d1 = await pd_turn(http, c, b1, rid="a")
        kv = d1.json["kv_transfer_params"]
        b2 = follow(b1)
        _, ok = await pd_turn(http, c, b2, reuse=kv, rid="b")
        assert ok.json["choices"][0]["message"]["content"] == expected_text(b2)
        # the same parameters again (a retry, a regeneration): prefill 1 has no cache, reads
        _, again = await pd_turn(http, c, b2, reuse=kv, p=1, rid="c")
        assert again.status == 200
        assert again.json["choices"][0]["message"]["content"] != expected_text(b2)
        p1 = c.instances("prefill")[1]
        assert metric(await metrics(http, p1), "sim:wrong_kv_reads_total") == 1
        assert metric(await metrics(http, c.instances("decode")[0]), "sim:kv_reuse_unknown_total") == 1


async def test_another_conversations_params_give_a_wrong_answer(http):
    async with SimCluster(prefill=1, decode=1, config=bidi()) as c:
        a1, b1 = turn1("conversation a"), turn1("conversation b is another one")
        _, da = await pd_turn(http, c, a1, rid="a")
        await pd_turn(http, c, b1, rid="b")
        b2 = follow(b1)
        _, wrong = await pd_turn(http, c, b2, reuse=da.json["kv_transfer_params"], rid="c")
        assert wrong.status == 200
        assert wrong.json["choices"][0]["message"]["content"] != expected_text(b2)
        # an edited history: the previous answer changed
        a2 = follow(a1)
        a2["messages"][2]["content"] = "edited " + a2["messages"][2]["content"]
        _, d2 = await pd_turn(http, c, turn1("conversation a"), rid="d")
        _, edited = await pd_turn(http, c, a2, reuse=d2.json["kv_transfer_params"], rid="e")
        assert edited.json["choices"][0]["message"]["content"] != expected_text(a2)


async def test_expiring_blocks_fail_with_500(http):
    async with SimCluster(prefill=1, decode=1, config=bidi(bidirectional_kv_ttl=5.3)) as c:
        b1 = turn1()
        _, d1 = await pd_turn(http, c, b1, rid="a")
        await asyncio.sleep(0.4)  # within 5 s of the expiry: prefill refuses to read
        pr, _ = await pd_turn(http, c, follow(b1), reuse=d1.json["kv_transfer_params"], rid="b")
        assert pr.status == 500 and pr.json["error"]["message"] == "Internal server error"
        p = c.instances("prefill")[0]
        assert metric(await metrics(http, p), "sim:kv_reuse_failures_total") == 1


async def test_kept_blocks_expire_after_the_ttl(http):
    async with SimCluster(prefill=1, decode=1, config=bidi(bidirectional_kv_ttl=0.2)) as c:
        d = c.instances("decode")[0]
        _, d1 = await pd_turn(http, c, turn1())
        n = len(d1.json["kv_transfer_params"]["remote_block_ids"][0])
        assert d.kv_reuse.kept_blocks == n
        await asyncio.sleep(0.4)
        assert d.kv_reuse.kept_blocks == 0
        assert metric(await metrics(http, d), "sim:kv_kept_expired_blocks_total") == n


async def test_restarted_decode_fails_the_read_with_500(http):
    async with SimCluster(prefill=1, decode=1, config=bidi()) as c:
        b1 = turn1()
        _, d1 = await pd_turn(http, c, b1, rid="a")
        d = c.instances("decode")[0]
        await d.crash()
        await d.restart()
        pr, _ = await pd_turn(http, c, follow(b1), reuse=d1.json["kv_transfer_params"], rid="b")
        assert pr.status == 500
        # the new life's parameters name the new engine and work
        _, d2 = await pd_turn(http, c, b1, rid="c")
        kv = d2.json["kv_transfer_params"]
        assert kv["remote_engine_id"] == d.engine_id + "-r1"
        _, ok = await pd_turn(http, c, follow(b1), reuse=kv, rid="d")
        assert ok.json["choices"][0]["message"]["content"] == expected_text(follow(b1))


async def test_stream_carries_no_params_unless_asked_but_blocks_are_kept(http):
    async with SimCluster(prefill=1, decode=1, config=bidi()) as c:
        _, dr = await pd_turn(http, c, turn1(), stream=True)
        events = dr.events
        assert events[-1] == "[DONE]"
        assert not any("kv_transfer_params" in e for e in events[:-1])
        assert c.instances("decode")[0].kv_reuse.kept_requests == 1
    async with SimCluster(prefill=1, decode=1, config=bidi(bidirectional_stream_params=True)) as c:
        b1 = turn1()
        _, dr = await pd_turn(http, c, b1, stream=True)
        events = dr.events
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        kv = events[-2]["kv_transfer_params"]
        assert kv["do_remote_decode"] is True
        assert [e for e in events[:-2] if "kv_transfer_params" in e] == []
        _, d2 = await pd_turn(http, c, follow(b1), reuse=kv, rid="b")
        assert d2.json["choices"][0]["message"]["content"] == expected_text(follow(b1))
        assert metric(await metrics(http, c.instances("prefill")[0]), "vllm:external_prefix_cache_hits_total") > 0


async def test_a_plain_request_pins_nothing_whatever_the_role(http):
    """vLLM 0.32's NixlConnector.request_finished: ``if not params: return False, None``. A
    request without kv_transfer_params is never pinned, bidirectional transfer on or not: on a
    decode (stream or not) and on a prefill (a full engine of the model) it generates and frees
    its blocks at once."""
    async with SimCluster(prefill=1, decode=1, config=bidi(strict_roles=False)) as c:
        d, p = c.instances("decode")[0], c.instances("prefill")[0]
        for inst in (d, p):
            for stream in (False, True):
                body = dict(turn1(f"plain on {inst.role} {stream}", answer=24), stream=stream)
                r = await http.chat(inst.url, body, rid=f"plain-{inst.role}-{stream}")
                assert r.status == 200, r.data
                if not stream:
                    assert r.json["choices"][0]["message"]["content"] == expected_text(body)
                    assert r.json.get("kv_transfer_params") is None
            assert inst.kv_reuse.kept_blocks == 0
            m = await metrics(http, inst)
            assert metric(m, "sim:kept_kv_requests") == 0 and metric(m, "vllm:kv_cache_usage_perc") == 0
        # the same request after a prefill, with its parameters: pinned for the next turn
        _, dr = await pd_turn(http, c, turn1(), rid="pd")
        assert d.kv_reuse.kept_blocks == len(dr.json["kv_transfer_params"]["remote_block_ids"][0]) > 0


async def test_a_full_decode_makes_new_requests_wait_until_blocks_are_freed(http):
    # 40 blocks: a turn keeps 26 of them, so a second request (27 blocks) does not fit
    async with SimCluster(prefill=1, decode=1, config=bidi(num_gpu_blocks=40)) as c:
        d = c.instances("decode")[0]
        b1 = turn1()
        _, d1 = await pd_turn(http, c, b1, rid="a")
        assert d.kv_reuse.kept_blocks == len(d1.json["kv_transfer_params"]["remote_block_ids"][0]) == 26
        waiting = asyncio.ensure_future(pd_turn(http, c, turn1("another user"), rid="b"))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # hangs without an error, as vLLM
        assert metric(await metrics(http, d), "vllm:num_requests_waiting") == 1
        # the next turn's prefill reads the kept blocks, which frees them
        b2 = follow(b1, answer=4)
        pr = await http.chat(c.urls("prefill")[0], dict(prefill_body(b2), kv_transfer_params=dict(
            d1.json["kv_transfer_params"], do_remote_decode=True)), rid="c-p")
        assert pr.status == 200
        _, dr = await asyncio.wait_for(waiting, 5)
        assert dr.status == 200


async def test_plain_request_to_decode_computes_from_its_prefix_cache(http):
    async with SimCluster(prefill=1, decode=1, config=bidi()) as c:
        d = c.instances("decode")[0]
        b1 = turn1()
        _, d1 = await pd_turn(http, c, b1, rid="a")
        kept = d1.json["kv_transfer_params"]["remote_num_tokens"]
        b2 = follow(b1, user="ok")
        before = await metrics(http, d)
        # prefill skipped: decode alone, with the parameters a proxy sends to have it kept
        r = await http.chat(d.url, dict(b2, kv_transfer_params={"do_remote_decode": False,
                                                                 "do_remote_prefill": False}), rid="local")
        assert r.status == 200 and r.json["choices"][0]["message"]["content"] == expected_text(b2)
        after = await metrics(http, d)
        hits = metric(after, "vllm:prefix_cache_hits_total") - metric(before, "vllm:prefix_cache_hits_total")
        computed = (local_compute(after)
                    - local_compute(before))
        assert hits == kept // 16 * 16
        assert computed == prompt_tokens(b2) - hits
        assert metric(after, "sim:local_prefills_total") == 1
        assert r.json["kv_transfer_params"]["do_remote_decode"] is True  # kept again for the next turn


async def test_decode_pulls_only_blocks_beyond_its_own_cache(http):
    async with SimCluster(prefill=1, decode=1, config=bidi()) as c:
        d = c.instances("decode")[0]
        b1 = turn1()
        _, d1 = await pd_turn(http, c, b1, rid="a")
        m1 = await metrics(http, d)
        kv = d1.json["kv_transfer_params"]
        b2 = follow(b1)
        await pd_turn(http, c, b2, reuse=kv, rid="b")
        m2 = await metrics(http, d)
        sent = metric(m2, "vllm:nixl_bytes_transferred_sum") - metric(m1, "vllm:nixl_bytes_transferred_sum")
        blocks2 = -(-prompt_tokens(b2) // 16)
        assert sent == (blocks2 - kv["remote_num_tokens"] // 16) * 2 * 1024 * 1024


async def test_chunked_local_prefill_delays_the_other_streams(http):
    # 3003 prompt tokens at 0.05 ms each in chunks of 512: six steps, each 25 ms longer
    cfg = bidi(ttft_per_token_ms=0.05, itl_ms=1.0, chunked_prefill_tokens=512, strict_roles=False)
    async with SimCluster(pd=1, config=cfg) as c:
        inst = c.instances("pd")[0]
        url = inst.url
        stream = asyncio.ensure_future(http.chat(url, chat_body("a stream", max_tokens=60, stream=True)))
        await asyncio.sleep(0.01)
        long = chat_body(" ".join(f"x{i}" for i in range(3001)), max_tokens=2)
        await http.chat(url, long)
        r = await stream
        assert r.status == 200
        assert inst.engine.prefill_steps == 6 + 1  # the stream's own short prompt took one step
        rec = [r for r in inst.records if r.json and r.json.get("stream")][0]
        assert rec.t_end - rec.t_received >= 6 * 0.025  # 60 tokens alone take 60 ms
        # the decode's own view of it: the stream's tokens after each long step waited for it
        gaps = dict((ms, n) for ms, n in (await http.get(url, "/sim/state")).json["itl_model"])
        assert gaps[26.6] == 5 and gaps[23.1] == 1  # 1 ms + 512 (then 443) tokens at 0.05 ms
        assert sum(gaps.values()) == 59  # every token of the stream after its first


async def test_every_generation_api_carries_decode_params(http):
    async with SimCluster(prefill=1, decode=1, config=bidi()) as c:
        d = c.urls("decode")[0]
        local = {"kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": False}}
        msg = {"model": "sim-model", "max_tokens": 5, "messages": [{"role": "user", "content": "hi there"}], **local}
        r = await http.post(d, "/v1/messages", msg)
        assert r.status == 200 and r.json["kv_transfer_params"]["do_remote_decode"] is True
        r = await http.post(d, "/v1/responses", {"model": "sim-model", "input": "hi there", "max_output_tokens": 5,
                                                 **local})
        assert r.status == 200 and r.json["kv_transfer_params"]["do_remote_decode"] is True
        r = await http.completion(d, {"model": "sim-model", "prompt": "hi there", "max_tokens": 5, **local})
        assert r.status == 200 and r.json["kv_transfer_params"]["do_remote_decode"] is True
        assert c.instances("decode")[0].kv_reuse.kept_requests == 3


async def test_lowered_remote_num_tokens_reads_only_the_shared_part(http):
    """A proxy that finds the new prompt shares only part of what decode keeps lowers
    remote_num_tokens; the prefill reads up to there and answers right."""
    async with SimCluster(prefill=2, decode=1, config=bidi()) as c:
        b1 = turn1()
        _, d1 = await pd_turn(http, c, b1, rid="a")
        kv = d1.json["kv_transfer_params"]
        b2 = follow(b1)
        b2["messages"][2]["content"] = " ".join(b2["messages"][2]["content"].split()[:-5]) + " edited"
        shared = kv["remote_num_tokens"] // 16 * 16 - 20  # before the edit, and a block less
        blocks = [kv["remote_block_ids"][0][:-(-shared // 16)]]  # only those that hold them
        _, d2 = await pd_turn(http, c, b2, reuse=dict(kv, remote_num_tokens=shared, remote_block_ids=blocks), p=1,
                              rid="b")
        assert d2.json["choices"][0]["message"]["content"] == expected_text(b2)
        m = await metrics(http, c.instances("prefill")[1])
        assert metric(m, "vllm:external_prefix_cache_hits_total") == shared - 1
        assert metric(m, "sim:wrong_kv_reads_total") == 0


async def test_lowered_remote_num_tokens_with_every_block_named_reads_the_wrong_kv(http):
    async with SimCluster(prefill=2, decode=1, config=bidi()) as c:
        b1 = turn1()
        _, d1 = await pd_turn(http, c, b1, rid="a")
        kv = d1.json["kv_transfer_params"]
        b2 = follow(b1)
        shared = kv["remote_num_tokens"] // 16 * 16 - 20  # one block fewer than named
        _, d2 = await pd_turn(http, c, b2, reuse=dict(kv, remote_num_tokens=shared), p=1, rid="b")
        assert d2.status == 200 and d2.json["choices"][0]["message"]["content"] != expected_text(b2)
        assert metric(await metrics(http, c.instances("prefill")[1]), "sim:wrong_kv_reads_total") == 1


async def test_return_token_ids_spell_what_decode_keeps(http):
    async with SimCluster(prefill=1, decode=1, config=bidi()) as c:
        b1 = turn1()
        _, d1 = await pd_turn(http, c, dict(b1, return_token_ids=True), rid="a")
        out = d1.json
        ids = out["prompt_token_ids"] + out["choices"][0]["token_ids"]
        assert len(ids) == out["kv_transfer_params"]["remote_num_tokens"]
        tok = await http.post(c.urls("decode")[0], "/tokenize", {"model": "sim-model",
                                                                 "messages": follow(b1)["messages"]})
        assert tok.json["tokens"][:len(ids)] == ids


async def test_kept_blocks_stay_findable_for_a_local_prefill_until_freed(http):
    # a one-block LRU prefix cache: only the pinned (kept) blocks can give the hits
    async with SimCluster(prefill=1, decode=1, config=bidi(prefix_cache_blocks=1)) as c:
        d = c.instances("decode")[0]
        b1 = turn1()
        _, d1 = await pd_turn(http, c, b1, rid="a")
        kept = d1.json["kv_transfer_params"]["remote_num_tokens"]
        b2 = follow(b1, user="ok")
        before = await metrics(http, d)
        r = await http.chat(d.url, dict(b2, kv_transfer_params={"do_remote_decode": False,
                                                                 "do_remote_prefill": False}), rid="local")
        assert r.json["choices"][0]["message"]["content"] == expected_text(b2)
        after = await metrics(http, d)
        hits = metric(after, "vllm:prefix_cache_hits_total") - metric(before, "vllm:prefix_cache_hits_total")
        assert hits == kept // 16 * 16
        # freed blocks are no longer pinned: only the local request's own kept blocks are
        pinned = d.prefix_cache.pinned_blocks
        own = prompt_tokens(follow(b2)) - 1 - len("and then what".split())
        await pd_turn(http, c, follow(b1, user="again"), reuse=d1.json["kv_transfer_params"], p=0, rid="b")
        assert d.kv_reuse.kept_requests == 2  # the local request's and turn "b"'s
        assert pinned == own // 16  # turn 1's blocks are a prefix of the local request's: shared hashes


async def test_stream_return_token_ids_add_up_to_the_non_stream_ones(http):
    async with SimCluster(prefill=1, decode=1, config=bidi(bidirectional_stream_params=True)) as c:
        body = dict(turn1(), return_token_ids=True,
                    kv_transfer_params={"do_remote_decode": False, "do_remote_prefill": False})
        d = c.urls("decode")[0]
        whole = (await http.chat(d, body)).json
        events = (await http.chat(d, dict(body, stream=True))).events
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
        ids = [i for e in chunks if "token_ids" in e["choices"][0] for i in e["choices"][0]["token_ids"]]
        assert ids == whole["choices"][0]["token_ids"]
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks) == expected_text(body)
        assert events[-2]["kv_transfer_params"]["remote_num_tokens"] == len(whole["prompt_token_ids"]) + len(ids)


def test_answer_chunk_ids_add_up_to_the_answer_as_the_next_prompt_spells_it():
    import random

    from epd_proxy.sim.tokens import VOCAB, answer_chunk_ids, continuation_ids

    body = {"messages": [{"role": "user", "content": "hi"}]}
    rng = random.Random(7)
    for n in (1, 2, 5, 40, 200):
        for _ in range(20):
            answer = [rng.randrange(len(VOCAB)) for _ in range(n)]
            chunks = answer_chunk_ids(answer)
            assert len(chunks) == n
            assert [i for c in chunks for i in c] == continuation_ids(body, True, [], answer)
