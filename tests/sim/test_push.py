"""NIXL push and Mooncake: D registers for a transfer_id, P pushes when its prefill is done."""

from __future__ import annotations

import asyncio
import time

from simhelpers import chat_body, failure, fast_config, metric, prefill_body, push_decode_params, stream_text

from epd_proxy.sim import SimCluster, expected_text


async def test_push_concurrent_legs_overlap(http):
    cfg = fast_config(kv_connector="nixl-push", roles={"prefill": {"ttft_ms": 60}})
    async with SimCluster(prefill=1, decode=1, config=cfg) as c:
        ident = c.prefill_identity(0)
        assert ident["engine_id"] == "sim-prefill-0" and ident["tp"] == 1 and ident["pp"] == 1
        body = chat_body("push me please", max_tokens=5, stream=True)
        tid = "xfer-1"
        p_task = asyncio.create_task(http.chat(c.urls("prefill")[0], prefill_body(body, tid), rid="req-1"))
        d_task = asyncio.create_task(http.chat(c.urls("decode")[0],
                                               dict(body, kv_transfer_params=push_decode_params(ident, tid))))
        pr, dr = await asyncio.gather(p_task, d_task)
        assert pr.status == 200
        pkv = pr.json["kv_transfer_params"]
        assert pkv["transfer_mode"] == "push" and pkv["transfer_id"] == tid
        assert pkv["remote_engine_id"] == ident["engine_id"]
        assert dr.status == 200 and stream_text(dr.events) == expected_text(body)
        prec = c.instances("prefill")[0].records[-1]
        drec = c.instances("decode")[0].records[-1]
        # The legs overlapped: D's stream started (headers) before P answered.
        assert drec.t_headers < prec.t_end
        assert drec.t_received < prec.t_end and prec.t_received < drec.t_end
        assert c.held_kv_blocks == 0
        assert c.instances("decode")[0].stats.kv_pulls == 1


async def test_push_decode_registers_first(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(kv_connector="nixl-push")) as c:
        ident = c.prefill_identity(0)
        body = chat_body("decode first", max_tokens=4)
        d_task = asyncio.create_task(http.chat(c.urls("decode")[0],
                                               dict(body, kv_transfer_params=push_decode_params(ident, "t-d1"))))
        await asyncio.sleep(0.1)
        assert not d_task.done()  # waiting for the push
        pr = await http.chat(c.urls("prefill")[0], prefill_body(body, "t-d1"))
        assert pr.status == 200
        dr = await d_task
        assert dr.status == 200 and dr.json["choices"][0]["message"]["content"] == expected_text(body)


async def test_push_prefill_first_holds_then_decode_claims(http):
    cfg = fast_config(kv_connector="nixl-push", push_registration_timeout=0.2)
    async with SimCluster(prefill=1, decode=1, config=cfg) as c:
        ident = c.prefill_identity(0)
        body = chat_body("prefill first", max_tokens=4)
        pr = await http.chat(c.urls("prefill")[0], prefill_body(body, "t-p1"))
        assert pr.status == 200
        p = c.instances("prefill")[0]
        assert p.held_kv_blocks == 1  # unclaimed push offer
        dr = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=push_decode_params(ident, "t-p1")))
        assert dr.status == 200
        assert p.held_kv_blocks == 0
        # A second decode with the same transfer_id waits in vain.
        t0 = time.monotonic()
        cfg_timeout = c.instances("decode")[0].config.push_registration_timeout
        dr2 = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=push_decode_params(ident, "t-p1")))
        assert dr2.status == 500 and "push_registration_timeout" in failure(dr2, c.instances("decode")[0])
        assert time.monotonic() - t0 >= cfg_timeout * 0.9


async def test_push_registration_timeout(http):
    cfg = fast_config(kv_connector="nixl-push", push_registration_timeout=0.15)
    async with SimCluster(prefill=1, decode=1, config=cfg) as c:
        ident = c.prefill_identity(0)
        body = chat_body("nobody prefills this", max_tokens=4, stream=True)
        t0 = time.monotonic()
        dr = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=push_decode_params(ident, "t-x")))
        elapsed = time.monotonic() - t0
        assert 0.12 <= elapsed < 1.0
        assert dr.status == 200
        evs = dr.events
        d = c.instances("decode")[0]
        # vLLM sends the chat role chunk first, then the in-band error and [DONE].
        assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "error" in evs[1] and evs[-1] == "[DONE]" and len(evs) == 3
        assert "push_registration_timeout" in failure(dr, d)
        assert d.stats.kv_pull_failures == 1


async def test_unclaimed_push_counts_as_stranded_until_timeout(http):
    cfg = fast_config(kv_connector="nixl-push", kv_abort_timeout=0.15)
    async with SimCluster(prefill=1, decode=1, config=cfg) as c:
        pr = await http.chat(c.urls("prefill")[0], prefill_body(chat_body(max_tokens=3), "t-lost"))
        assert pr.status == 200
        p = c.instances("prefill")[0]
        m = (await http.get(p.url, "/metrics")).data.decode()
        assert metric(m, "sim:held_kv_blocks") == 1
        await asyncio.sleep(0.25)
        assert p.held_kv_blocks == 0 and p.stats.kv_blocks_expired == 1


async def test_push_engine_id_mismatch_fails(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(kv_connector="nixl-push")) as c:
        ident = dict(c.prefill_identity(0), engine_id="prefill-engine-001")
        body = chat_body("wrong identity", max_tokens=2)
        await http.chat(c.urls("prefill")[0], prefill_body(body, "t-e"))
        dr = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=push_decode_params(ident, "t-e")))
        assert dr.status == 500 and "engine id mismatch" in failure(dr, c.instances("decode")[0])


async def test_push_prompt_mismatch_fails(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(kv_connector="nixl-push")) as c:
        ident = c.prefill_identity(0)
        await http.chat(c.urls("prefill")[0], prefill_body(chat_body("P prompt", max_tokens=2), "t-m"))
        dr = await http.chat(c.urls("decode")[0],
                             chat_body("D prompt", max_tokens=2, kv_transfer_params=push_decode_params(ident, "t-m")))
        assert dr.status == 500 and "prompt mismatch" in failure(dr, c.instances("decode")[0])


async def test_push_prefill_requires_transfer_id(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config(kv_connector="nixl-push")) as c:
        r = await http.chat(c.urls("prefill")[0], prefill_body(chat_body()))
        assert r.status == 400 and "transfer_id" in r.json["error"]["message"]


async def test_pull_decoder_rejects_push_params(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        ident = c.prefill_identity(0)
        r = await http.chat(c.urls("decode")[0], chat_body(kv_transfer_params=push_decode_params(ident, "t")))
        assert r.status == 500 and "remote_block_ids" in failure(r, c.instances("decode")[0])


async def test_mooncake_query_and_handoff(http):
    async with SimCluster(prefill=2, decode=1, config=fast_config(kv_connector="mooncake")) as c:
        for i in range(2):
            ident = c.prefill_identity(i)
            assert ident["bootstrap_addr"].startswith("http://127.0.0.1:")
            q = await http.get(ident["bootstrap_addr"], "/query")
            assert q.status == 200 and q.json == {"0": {"engine_id": f"sim-prefill-{i}"}}
        ident = c.prefill_identity(1)
        body = chat_body("mooncake", max_tokens=3, stream=True)
        tid = "xfer-req-9"
        p_body = dict(prefill_body(body), kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                                               "transfer_id": tid})
        d_kv = {"do_remote_decode": False, "do_remote_prefill": True,
                "remote_bootstrap_addr": ident["bootstrap_addr"], "remote_engine_id": ident["engine_id"],
                "transfer_id": tid}
        dr, pr = await asyncio.gather(http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=d_kv)),
                                      http.chat(c.urls("prefill")[1], p_body))
        assert pr.status == 200 and dr.status == 200
        assert stream_text(dr.events) == expected_text(body)
        assert c.instances("prefill")[1].stats.kv_pushes == 1
        # Wrong engine id for that bootstrap address.
        await http.chat(c.urls("prefill")[1], dict(p_body, kv_transfer_params=dict(p_body["kv_transfer_params"],
                                                                                    transfer_id="t2")))
        bad = dict(d_kv, remote_engine_id="sim-prefill-0", transfer_id="t2")
        r = await http.chat(c.urls("decode")[0], dict(body, stream=False, kv_transfer_params=bad))
        assert r.status == 500 and "engine id mismatch" in failure(r, c.instances("decode")[0])


async def test_client_abort_while_decode_waits_for_push(http):
    import msgspec
    from simhelpers import JSON_HEADERS

    from epd_proxy.http.client import ConnectionPool

    async with SimCluster(prefill=1, decode=1, config=fast_config(kv_connector="nixl-push")) as c:
        d, p = c.instances("decode")[0], c.instances("prefill")[0]
        pool = ConnectionPool(d.url)
        body = chat_body("abandoned", stream=True, kv_transfer_params=push_decode_params(c.prefill_identity(0), "t-ab"))
        resp = await pool.request("POST", "/v1/chat/completions", body=msgspec.json.encode(body), headers=JSON_HEADERS)
        assert resp.status == 200  # vLLM commits a stream's headers before the KV arrives
        await asyncio.sleep(0.05)
        assert p.state()["push_waiters"] == ["t-ab"]
        resp.close()
        await pool.close()
        await asyncio.sleep(0.05)
        rec = d.records[-1]
        assert rec.aborted and rec.bytes_sent == 0
        assert p.state()["push_waiters"] == [] and d.engine.n_active == 0
