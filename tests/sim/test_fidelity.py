"""What the end-to-end suite saw real vLLM 0.32.0 do, and the simulator's switches around it."""

from __future__ import annotations

import asyncio
import re
import time

from simhelpers import chat_body, failure, fast_config, metric, prefill_body, push_decode_params

from epd_proxy.sim import SimCluster, SimConfig, expected_text


async def test_chat_response_shape(http):
    async with SimCluster(pd=2, config=fast_config()) as c:
        a, b = c.instances("pd")
        j = (await http.chat(a.url, chat_body("shape", max_tokens=3))).json
        assert list(j) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                           "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                           "ec_transfer_params", "metrics"]
        assert j["prompt_text"] is None and j["metrics"] is None
        (ch,) = j["choices"]
        assert list(ch) == ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
                            "routed_experts"]
        # vLLM 0.32's ChatMessage: "reasoning", and an empty tool_calls list is dropped.
        assert ch["message"] == {"role": "assistant", "content": expected_text(chat_body("shape", max_tokens=3)),
                                 "refusal": None, "annotations": None, "audio": None, "function_call": None,
                                 "reasoning": None}
        assert list(j["usage"]) == ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                                    "completion_tokens_details"]
        # system_fingerprint: vllm-<version>-<8 hex>, stable, shared by instances of one configuration.
        fp = j["system_fingerprint"]
        assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", fp) and fp == a.system_fingerprint == b.system_fingerprint
        j2 = (await http.chat(b.url, chat_body("shape", max_tokens=3))).json
        assert j2["system_fingerprint"] == fp
    async with SimCluster(prefill=1, decode=1, pd=1, config=fast_config(tp_size=2)) as c:
        fps = {i.system_fingerprint for i in c.all_instances()}
        assert len(fps) == 3 and all(f.startswith("vllm-0.32.0-tp2-") for f in fps)
    async with SimCluster(pd=1, config=fast_config(system_fingerprint="")) as c:
        j = (await http.chat(c.urls("pd")[0], chat_body(max_tokens=1))).json
        assert j["system_fingerprint"] is None
        evs = (await http.chat(c.urls("pd")[0], chat_body(max_tokens=1, stream=True))).events
        assert all("system_fingerprint" not in e for e in evs[:-1])


async def test_request_id_echo_is_a_flag(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        url = c.urls("pd")[0]
        r = await http.chat(url, chat_body(max_tokens=1), rid="echo-1")
        assert r.headers[b"x-request-id"] == b"echo-1"
        r = await http.chat(url, chat_body(max_tokens=0), rid="echo-2")  # errors too, as vLLM's middleware
        assert r.status == 400 and r.headers[b"x-request-id"] == b"echo-2"
        r = await http.chat(url, chat_body(max_tokens=1))
        assert len(r.headers[b"x-request-id"]) == 32
    async with SimCluster(pd=1, config=fast_config(echo_request_id=False)) as c:
        r = await http.chat(c.urls("pd")[0], chat_body(max_tokens=1), rid="echo-3")
        assert b"x-request-id" not in r.headers
        assert r.json["id"] == "chatcmpl-echo-3"  # the id is still used


async def test_strict_roles_switch(http):
    # Strict (the default): a prefill without do_remote_decode and a decode with it are refused.
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        assert (await http.chat(c.urls("prefill")[0], chat_body(max_tokens=2))).status == 400
        assert (await http.chat(c.urls("decode")[0], prefill_body(chat_body()))).status == 400
    # Like vLLM: any KV instance serves a plain request, and produces KV for do_remote_decode.
    async with SimCluster(prefill=1, decode=2, config=fast_config(strict_roles=False)) as c:
        p = c.instances("prefill")[0]
        body = chat_body("plain", max_tokens=3)
        r = await http.chat(p.url, body)
        assert r.status == 200 and r.json["kv_transfer_params"] is None and p.held_kv_blocks == 0
        assert r.json["choices"][0]["message"]["content"] == expected_text(body)
        assert p.stats.local_prefills == 1
        d0, d1 = c.instances("decode")
        r = await http.chat(d0.url, prefill_body(body))
        assert r.status == 200 and d0.held_kv_blocks == 1
        kv = r.json["kv_transfer_params"]
        assert kv["remote_engine_id"] == d0.engine_id
        r = await http.chat(d1.url, dict(body, kv_transfer_params=kv))
        assert r.status == 200 and r.json["choices"][0]["message"]["content"] == expected_text(body)
        assert d1.stats.kv_pulls == 1 and d0.held_kv_blocks == 0
    # The switch can be set per role, or from a topology spec.
    c = SimCluster.from_spec("prefill=1,decode=1,prefill.strict_roles=false")
    assert not c.instances("prefill")[0].config.strict_roles and c.instances("decode")[0].config.strict_roles


async def test_kv_failure_delay(http):
    cfg = fast_config(kv_failure_delay_ms=150)
    async with SimCluster(prefill=1, decode=1, config=cfg) as c:
        body = chat_body("late failure", max_tokens=2)
        pr = await http.chat(c.urls("prefill")[0], prefill_body(body))
        kv = pr.json["kv_transfer_params"]
        await c.instances("prefill")[0].crash()
        d = c.instances("decode")[0]
        t0 = time.monotonic()
        r = await http.chat(d.url, dict(body, kv_transfer_params=kv))
        assert time.monotonic() - t0 >= 0.14
        assert "side channel" in failure(r, d)
        # During the wait the request holds its slot, as it waits for remote KV in vLLM.
        task = asyncio.create_task(http.chat(d.url, dict(body, stream=True, kv_transfer_params=kv)))
        await asyncio.sleep(0.05)
        assert d.engine.num_waiting == 1
        r = await task
        assert r.status == 200 and "side channel" in failure(r, d)
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        body = chat_body("fast failure", max_tokens=2)
        kv = (await http.chat(c.urls("prefill")[0], prefill_body(body))).json["kv_transfer_params"]
        await c.instances("prefill")[0].crash()
        t0 = time.monotonic()
        r = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=kv))
        assert r.status == 500 and time.monotonic() - t0 < 0.1  # default 0: fast


async def test_decode_kv_metrics(http):
    cfg = fast_config(block_size=4, kv_bytes_per_block=1000)
    async with SimCluster(prefill=1, decode=1, config=cfg) as c:
        d = c.instances("decode")[0]
        sizes = []
        for i, words in enumerate((3, 10)):
            body = chat_body(" ".join(["w"] * words), max_tokens=2)  # 4 and 11 prompt tokens
            kv = (await http.chat(c.urls("prefill")[0], prefill_body(body), rid=f"m-{i}")).json["kv_transfer_params"]
            sizes.append(len(kv["remote_block_ids"][0]))
            assert (await http.chat(d.url, dict(body, kv_transfer_params=kv), rid=f"m-{i}")).status == 200
        assert sizes == [1, 3]
        # A local prefill on D does not count as a transfer.
        await http.chat(d.url, chat_body("local one", max_tokens=1))
        m = (await http.get(d.url, "/metrics")).data.decode()
        assert metric(m, "vllm:nixl_bytes_transferred_count") == 2
        assert metric(m, "vllm:nixl_bytes_transferred_sum") == 4000
        assert 'vllm:nixl_bytes_transferred_bucket{model_name="sim-model",engine="0",le="2048.0"} 1.0' in m
        assert 'vllm:nixl_bytes_transferred_bucket{model_name="sim-model",engine="0",le="8192.0"} 2.0' in m
        assert 'vllm:nixl_bytes_transferred_bucket{model_name="sim-model",engine="0",le="+Inf"} 2.0' in m
        assert "# TYPE vllm:nixl_bytes_transferred histogram" in m
        assert metric(m, "vllm:external_prefix_cache_hits_total") == 4 + 11
        assert metric(m, "vllm:external_prefix_cache_queries_total") == 4 + 11
        src = 'vllm:prompt_tokens_by_source_total{model_name="sim-model",engine="0",source="%s"}'
        assert metric(m, src % "external_kv_transfer") == 15
        assert metric(m, src % "local_compute") == 3
        assert metric(m, src % "local_cache_hit") == 0
        # The prefill computed both prompts and transferred nothing itself; the second prompt's
        # first block (the role and three words) came from its prefix cache.
        pm = (await http.get(c.urls("prefill")[0], "/metrics")).data.decode()
        assert metric(pm, src % "local_compute") == 11 and metric(pm, "vllm:nixl_bytes_transferred_count") == 0
        assert metric(pm, src % "local_cache_hit") == 4
    # Push mode counts one transfer per load as well; Mooncake has no NIXL metrics.
    async with SimCluster(prefill=1, decode=1, config=fast_config(kv_connector="nixl-push")) as c:
        body = chat_body("pushed", max_tokens=2)
        ident = c.prefill_identity(0)
        await http.chat(c.urls("prefill")[0], prefill_body(body, "t-1"))
        r = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=push_decode_params(ident, "t-1")))
        assert r.status == 200
        m = (await http.get(c.urls("decode")[0], "/metrics")).data.decode()
        assert metric(m, "vllm:nixl_bytes_transferred_count") == 1
        assert metric(m, "vllm:nixl_bytes_transferred_sum") == SimConfig().kv_bytes_per_block
    async with SimCluster(prefill=1, decode=1, config=fast_config(kv_connector="mooncake")) as c:
        m = (await http.get(c.urls("decode")[0], "/metrics")).data.decode()
        assert "nixl_bytes_transferred" not in m


async def test_request_success_reasons(http):
    async with SimCluster(pd=1, config=fast_config()) as c:
        url = c.urls("pd")[0]
        await http.chat(url, chat_body(max_tokens=2))
        await http.chat(url, chat_body())
        await http.chat(url, chat_body(max_tokens=2), fault="error-after=1")
        m = (await http.get(url, "/metrics")).data.decode()
        reason = 'vllm:request_success_total{model_name="sim-model",engine="0",finished_reason="%s"}'
        assert [metric(m, reason % r) for r in ("stop", "length", "abort", "error", "repetition")] == [1, 1, 0, 1, 0]


async def test_response_model_is_the_served_name(http):
    async with SimCluster(pd=1, config=fast_config(check_model=False)) as c:
        j = (await http.chat(c.urls("pd")[0], chat_body(model="other-name", max_tokens=1))).json
        assert j["model"] == "sim-model"
        j = (await http.chat(c.urls("pd")[0], chat_body(model="", max_tokens=1))).json
        assert j["model"] == "sim-model"
