"""NIXL pull hand-off between a simulated prefill and decode."""

from __future__ import annotations

import asyncio

from simhelpers import GENERIC_EVENT, chat_body, failure, fast_config, metric, prefill_body, stream_text

from epd_proxy.sim import SimCluster, expected_text

REAL_032_FIELDS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                   "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                   "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
                   "remote_prefill_cached_tokens"}


async def _prefill(http, cluster, body, rid="req-1", path="/v1/chat/completions"):
    p = cluster.urls("prefill")[0]
    r = await http.post(p, path, prefill_body(body), headers=[(b"x-request-id", rid.encode())])
    assert r.status == 200, r.data
    return r.json


async def test_prefill_returns_vllm_032_params_and_holds_blocks(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        body = chat_body("one two three four five", max_tokens=12)
        out = await _prefill(http, c, body, rid="abc")
        kv = out["kv_transfer_params"]
        assert set(kv) == REAL_032_FIELDS
        p = c.instances("prefill")[0]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert isinstance(kv["remote_block_ids"], list) and isinstance(kv["remote_block_ids"][0], list)
        assert kv["remote_engine_id"] == p.engine_id == "sim-prefill-0"
        assert kv["remote_request_id"].startswith("chatcmpl-abc-") and len(kv["remote_request_id"]) == len(
            "chatcmpl-abc-") + 8
        assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", p.port)
        assert kv["tp_size"] == 1 and kv["transfer_mode"] == "pull"
        assert kv["remote_num_tokens"] == out["usage"]["prompt_tokens"] == 6
        assert out["ec_transfer_params"] is None
        assert out["choices"][0]["message"]["content"] == expected_text(dict(body, max_tokens=1))
        assert p.held_kv_blocks == 1 and p.held_kv_requests == 1
        m = (await http.get(p.url, "/metrics")).data.decode()
        assert metric(m, "sim:held_kv_blocks") == 1


async def test_completions_request_id_format(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        out = await _prefill(http, c, {"model": "sim-model", "prompt": "Red Hat is"}, rid="pd-7",
                             path="/v1/completions")
        assert out["object"] == "text_completion"
        assert out["kv_transfer_params"]["remote_request_id"].startswith("cmpl-pd-7-0-")


async def test_handoff_succeeds_once_then_second_pull_fails(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(prompt_tokens_details=True)) as c:
        body = chat_body("hello there world", max_tokens=6)
        kv = (await _prefill(http, c, body))["kv_transfer_params"]
        d = c.urls("decode")[0]
        r = await http.chat(d, dict(body, kv_transfer_params=kv), rid="req-1")
        assert r.status == 200, r.data
        j = r.json
        assert j["choices"][0]["message"]["content"] == expected_text(body)
        # The transferred KV is no prefix-cache hit: D reports P's hits (none here), as vLLM 0.31+.
        assert kv["remote_prefill_cached_tokens"] == 0
        assert j["usage"]["prompt_tokens_details"] is None
        assert j["kv_transfer_params"] is None
        p, dec = c.instances("prefill")[0], c.instances("decode")[0]
        assert p.held_kv_blocks == 0
        assert dec.stats.kv_pulls == 1 and dec.stats.local_prefills == 0

        # The same params again: the blocks are gone -> non-stream 500 with vLLM's generic
        # body; the reason stays in the simulator's record ...
        r2 = await http.chat(d, dict(body, kv_transfer_params=kv), rid="req-1")
        assert r2.status == 500
        assert r2.json == {"error": {"message": "Internal server error", "type": "InternalServerError",
                                     "param": None, "code": 500}}
        assert "no KV blocks held" in failure(r2, dec)
        assert b"no KV" not in r2.data
        # ... and stream: 200, then (chat) the role chunk, vLLM's in-band error event and [DONE].
        r3 = await http.chat(d, dict(body, stream=True, kv_transfer_params=kv), rid="req-3")
        assert r3.status == 200
        evs = r3.events
        assert evs[-1] == "[DONE]" and len(evs) == 3
        assert evs[0] == {"id": "chatcmpl-req-3", "object": "chat.completion.chunk", "created": c.created,
                          "model": "sim-model",
                          "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None}
        assert r3.data.split(b"\n\n")[1] + b"\n\n" == GENERIC_EVENT
        assert "no KV blocks held" in failure(r3, dec)
        # Completions streams have no role chunk: the error event comes first.
        r4 = await http.completion(d, {"model": "sim-model", "prompt": "hello there world", "max_tokens": 2,
                                       "stream": True, "kv_transfer_params": kv})
        assert r4.data == GENERIC_EVENT + b"data: [DONE]\n\n"
        assert dec.stats.kv_pull_failures == 3
        m = (await http.get(d, "/metrics")).data.decode()
        assert metric(m, "sim:kv_pull_failures_total") == 3
        assert metric(m, "vllm:nixl_num_failed_transfers_total") == 3
        assert metric(m, "sim:kv_pulls_total") == 1
        assert metric(m, 'vllm:request_success_total{model_name="sim-model",engine="0",finished_reason="error"}') == 3


async def test_streamed_decode_after_pull(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(prompt_tokens_details=True)) as c:
        body = chat_body("stream me", max_tokens=9, stream=True, stream_options={"include_usage": True})
        kv = (await _prefill(http, c, body))["kv_transfer_params"]
        r = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=kv), rid="req-1")
        evs = r.events
        assert stream_text(evs) == expected_text(body)
        usage = evs[-2]["usage"]
        assert usage["completion_tokens"] == 9
        assert "prompt_tokens_details" not in usage  # P had no prefix-cache hit


async def test_blocks_expire_after_abort_timeout(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(kv_abort_timeout=0.1)) as c:
        body = chat_body("expire me", max_tokens=3)
        kv = (await _prefill(http, c, body))["kv_transfer_params"]
        p = c.instances("prefill")[0]
        assert p.held_kv_blocks == 1
        await asyncio.sleep(0.2)
        assert p.held_kv_blocks == 0
        assert p.stats.kv_blocks_expired == 1
        r = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=kv))
        assert r.status == 500 and "expired" in failure(r, c.instances("decode")[0])


async def test_prompt_mismatch_fails(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        body = chat_body("the prompt P saw", max_tokens=3)
        kv = (await _prefill(http, c, body))["kv_transfer_params"]
        other = chat_body("a different prompt for D", max_tokens=3, kv_transfer_params=kv)
        r = await http.chat(c.urls("decode")[0], other)
        assert r.status == 500
        assert "prompt mismatch" in failure(r, c.instances("decode")[0])


async def test_wrong_engine_id_or_blocks_fail(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        body = chat_body("x y z", max_tokens=2)
        kv = (await _prefill(http, c, body))["kv_transfer_params"]
        d = c.urls("decode")[0]
        dec = c.instances("decode")[0]
        r = await http.chat(d, dict(body, kv_transfer_params=dict(kv, remote_engine_id="someone-else")))
        assert r.status == 500 and "engine id mismatch" in failure(r, dec)
        r = await http.chat(d, dict(body, kv_transfer_params=dict(kv, remote_block_ids=[[999]])))
        assert r.status == 500 and "block ids" in failure(r, dec)
        # Still held: the right params work.
        r = await http.chat(d, dict(body, kv_transfer_params=kv))
        assert r.status == 200


async def test_dead_side_channel_fails(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        body = chat_body("a", max_tokens=2)
        kv = (await _prefill(http, c, body))["kv_transfer_params"]
        await c.instances("prefill")[0].crash()
        r = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=kv))
        assert r.status == 500 and "side channel" in failure(r, c.instances("decode")[0])


async def test_decode_without_remote_params_counts_local_prefill(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        d = c.instances("decode")[0]
        r = await http.chat(d.url, chat_body(max_tokens=4))
        assert r.status == 200
        assert r.json["usage"]["prompt_tokens_details"] is None
        assert d.stats.local_prefills == 1 and d.stats.kv_pulls == 0
        m = (await http.get(d.url, "/metrics")).data.decode()
        assert metric(m, "sim:local_prefills_total") == 1


async def test_prefill_without_do_remote_decode_is_400(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        p = c.urls("prefill")[0]
        r = await http.chat(p, chat_body(max_tokens=1))
        assert r.status == 400
        err = r.json["error"]
        assert err["type"] == "BadRequestError" and "do_remote_decode" in err["message"]
        # A prefill request sent to a decoder is refused too.
        r = await http.chat(c.urls("decode")[0], prefill_body(chat_body()))
        assert r.status == 400 and "do_remote_decode" in r.json["error"]["message"]


async def test_drop_kv_fault(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        p = c.urls("prefill")[0]
        r = await http.chat(p, prefill_body(chat_body()), fault="prefill:drop-kv")
        assert r.status == 200 and r.json["kv_transfer_params"] is None
        assert c.instances("prefill")[0].held_kv_blocks == 0


async def test_block_ids_cover_the_prompt(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(block_size=4)) as c:
        body = chat_body(" ".join(["w"] * 20), max_tokens=2)  # 21 tokens -> 6 blocks of 4
        kv = (await _prefill(http, c, body))["kv_transfer_params"]
        assert len(kv["remote_block_ids"][0]) == 6
        kv2 = (await _prefill(http, c, body, rid="req-2"))["kv_transfer_params"]
        assert not set(kv["remote_block_ids"][0]) & set(kv2["remote_block_ids"][0])
        assert c.held_kv_blocks == 12


async def test_decode_queue_longer_than_abort_timeout_loses_kv(http):
    """D admits the request (and loads KV) only when a slot frees up, as vLLM does."""
    cfg = fast_config(kv_abort_timeout=0.15, roles={"decode": {"max_num_seqs": 1, "itl_ms": 10}})
    async with SimCluster(prefill=1, decode=1, config=cfg) as c:
        d = c.urls("decode")[0]
        body = chat_body("queued", max_tokens=2)
        kv = (await _prefill(http, c, body))["kv_transfer_params"]
        blocker = asyncio.create_task(http.chat(d, chat_body("long one", max_tokens=30)))
        await asyncio.sleep(0.02)
        r = await http.chat(d, dict(body, kv_transfer_params=kv))
        assert r.status == 500 and "no KV blocks held" in failure(r, c.instances("decode")[0])
        assert (await blocker).status == 200
