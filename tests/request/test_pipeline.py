"""The proxy end to end over loopback, against the project's vLLM simulator."""

import asyncio

import msgspec
import pytest
from helpers import chat_body, probe_round, stack, wait_for

from epd_proxy.http.client import ConnectionPool
from epd_proxy.request.turns.multiturn import strip_token_ids
from epd_proxy.sim import SimConfig, expected_text

CJK_PROMPT = "请描述这张图片 🚀 — naïve café"


# -- bytes stay bytes ---------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prefill", [0, 1])
async def test_client_gets_exactly_decodes_bytes(stream, prefill):
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, record_responses=True, split_utf8=True)
    async with stack(prefill=prefill, decode=0 if not prefill else 1, pd=0 if prefill else 1, sim=sim) as (
            cluster, proxy, client):
        body = chat_body(CJK_PROMPT, stream=stream, max_tokens=24, seed=7,
                         **({"stream_options": {"include_usage": True}} if stream else {}))
        if prefill:
            # The proxy's first answer (and first stream) from a decode asks it for token ids
            # (whether it keeps blocks for the next turn: protocol.md §2.10, "The first answer"):
            # the client gets the bytes decode sends unasked. From then on, decode's bytes as they are.
            reply = await client.chat(body)
            asked = cluster.records("decode")[-1].response_body
            assert b'"prompt_token_ids":[' in asked and reply.text() == expected_text(body)
            assert b'"token_ids":[' not in reply.body and b'"prompt_token_ids":[' not in reply.body
            if not stream:
                assert reply.body == strip_token_ids(asked)
        reply = await client.chat(body)
        assert reply.status == 200
        consumer = cluster.records("decode" if prefill else "pd")[-1]
        assert reply.body == consumer.response_body
        want = b"text/event-stream" if stream else b"application/json"
        assert reply.headers[b"content-type"].startswith(want)
        assert reply.text() == expected_text(body)
        assert any(ord(ch) > 0xFFFF for ch in reply.text()) or any(ord(ch) > 0x7F for ch in reply.text())
        if stream:
            assert reply.body.endswith(b"data: [DONE]\n\n")


async def test_completions_endpoint_runs_pd():
    async with stack() as (cluster, proxy, client):
        body = {"model": "sim-model", "prompt": "The capital of France is", "max_tokens": 6}
        reply = await client.post("/v1/completions", body)
        assert reply.status == 200, reply.body
        assert reply.text() == expected_text(body)
        p, d = cluster.records("prefill")[-1], cluster.records("decode")[-1]
        assert p.path == d.path == "/v1/completions"
        assert p.json["prompt"] == d.json["prompt"] == body["prompt"]


# -- what each stage receives ---------------------------------------------------------------

async def test_prefill_body_is_sanitised_and_decode_keeps_every_client_field():
    async with stack() as (cluster, proxy, client):
        body = chat_body(stream=True, max_tokens=8, max_completion_tokens=9, min_tokens=2,
                         min_completion_tokens=2, stream_options={"include_usage": True}, n=1,
                         temperature=0.3, seed=3, my_unknown_field={"kept": True})
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        p = cluster.records("prefill")[-1].json
        d = cluster.records("decode")[-1].json
        assert p["stream"] is False and p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
        for gone in ("stream_options", "min_tokens", "min_completion_tokens"):
            assert gone not in p
        assert p["n"] == 1
        assert p["kv_transfer_params"]["do_remote_decode"] is True
        assert p["messages"] == d["messages"]
        for key in ("stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens",
                    "min_completion_tokens", "temperature", "seed", "my_unknown_field"):
            assert d[key] == body[key], key


async def test_decode_gets_prefills_kv_transfer_params_verbatim():
    async with stack() as (cluster, proxy, client):
        reply = await client.chat(chat_body())
        assert reply.status == 200
        p = cluster.records("prefill")[-1]
        d = cluster.records("decode")[-1]
        sent_by_p = msgspec.json.decode(p.response_body)["kv_transfer_params"] if p.response_body else p.kv
        assert d.json["kv_transfer_params"] == sent_by_p


async def test_request_id_is_kept_shared_and_derived_for_encoders():
    async with stack(encode=2, encode_policy="round-robin") as (cluster, proxy, client):
        body = chat_body(images=["https://x/a.png", "https://x/b.png"])
        reply = await client.chat(body, headers=[(b"x-request-id", b"req-42")])
        assert reply.status == 200, reply.body
        assert reply.headers[b"x-request-id"] == b"req-42"
        assert cluster.records("prefill")[-1].request_id == "req-42"
        assert cluster.records("decode")[-1].request_id == "req-42"
        enc_ids = sorted(r.request_id for r in cluster.records("encode"))
        assert [i.rsplit(":", 1)[0] for i in enc_ids] == ["req-42:0", "req-42:1"]
        assert all(len(i.rsplit(":", 1)[1]) == 6 for i in enc_ids)


async def test_a_request_id_is_made_when_the_client_sends_none():
    async with stack() as (cluster, proxy, client):
        reply = await client.chat(chat_body())
        rid = reply.headers[b"x-request-id"].decode()
        assert len(rid) >= 16
        assert cluster.records("decode")[-1].request_id == rid


# -- encoders -------------------------------------------------------------------------------

async def test_single_image_requests_rotate_over_all_encoders():
    async with stack(encode=3, encode_policy="round-robin") as (cluster, proxy, client):
        for i in range(6):
            reply = await client.chat(chat_body(images=[f"https://x/{i}.png"]))
            assert reply.status == 200, reply.body
        seen = [r.instance for r in cluster.records("encode")]
        assert seen == ["encode-0", "encode-1", "encode-2"] * 2


async def test_cursor_stays_contiguous_across_item_counts():
    async with stack(encode=3, encoder_max_batch_size=1, encode_policy="round-robin") as (cluster, proxy, client):
        groups = []
        for n, count in enumerate([2, 1, 3, 1]):
            before = len(cluster.records("encode"))
            reply = await client.chat(chat_body(images=[f"https://x/{n}-{k}.png" for k in range(count)]))
            assert reply.status == 200, reply.body
            recs = cluster.records("encode")[before:]
            groups.append(sorted(r.instance for r in recs))
        assert groups == [["encode-0", "encode-1"], ["encode-2"], ["encode-0", "encode-1", "encode-2"],
                          ["encode-0"]]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
async def test_whole_cycles_hit_every_encoder_equally(n):
    async with stack(encode=n, encode_policy="round-robin") as (cluster, proxy, client):
        for i in range(3 * n):
            assert (await client.chat(chat_body(images=[f"https://x/{i}.png"]))).status == 200
        counts = [len(inst.records) for inst in cluster.instances("encode")]
        assert counts == [3] * n


async def test_concurrent_requests_never_share_a_slot():
    async with stack(encode=4, encode_policy="round-robin") as (cluster, proxy, client):
        replies = await asyncio.gather(*(client.chat(chat_body(images=[f"https://x/c{i}.png"]))
                                         for i in range(20)))
        assert all(r.status == 200 for r in replies)
        assert [len(inst.records) for inst in cluster.instances("encode")] == [5, 5, 5, 5]


@pytest.mark.parametrize("batch, sizes", [(0, [3, 3]), (1, [1] * 6), (2, [2, 2, 1, 1])])
async def test_images_on_one_encoder_are_batched(batch, sizes):
    a, c, d, f = (f"https://x/{k}.png" for k in "ACDF")
    async with stack(encode=2, encoder_max_batch_size=batch, encode_policy="round-robin") as (cluster, proxy, client):
        body = chat_body(images=[a, a, c, d, a, f], mm_processor_kwargs={"size": 224})
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        recs = cluster.records("encode")
        got = sorted(len(r.json["messages"][0]["content"]) for r in recs)
        assert got == sorted(sizes)
        for r in recs:
            assert r.json["mm_processor_kwargs"] == {"size": 224}
            assert r.json["stream"] is False and "max_tokens" not in r.json
            assert all(part["type"] == "image_url" and part["uuid"] for part in r.json["messages"][0]["content"])
        # The consumer (prefill) got every image as an embeds reference and found each
        # one's embedding with its own metadata (the simulator checks both).
        p = cluster.records("prefill")[-1]
        parts = [x for x in p.json["messages"][0]["content"] if x["type"] != "text"]
        assert [x["type"] for x in parts] == ["image_embeds"] * 6
        assert p.status == 200 and p.error is None
        ec = p.json["ec_transfer_params"]
        assert len(ec["ec_items"]) == 6
        assert len({item["transfer_id"] for item in ec["ec_items"]}) == 6
        assert all(item["mm_hash"].endswith("-processed") for item in ec["ec_items"])
        assert reply.text() == expected_text(body)


async def test_e_pd_sends_embeds_to_the_decode_instance():
    async with stack(encode=1, prefill=0, decode=0, pd=1) as (cluster, proxy, client):
        body = chat_body(images=["https://x/cat.png"], stream=True)
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        pd = cluster.records("pd")[-1]
        assert pd.json["messages"][0]["content"][1]["type"] == "image_embeds"
        assert "kv_transfer_params" not in pd.json
        assert cluster.instances("pd")[0].stats.local_encodes == 0
        assert cluster.instances("pd")[0].stats.ec_hits == 1


async def test_no_rewrite_sends_raw_media_and_no_uuid():
    async with stack(encode=1, rewrite=False) as (cluster, proxy, client):
        body = chat_body(images=["https://x/cat.png"])
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        assert "uuid" not in cluster.records("encode")[-1].json["messages"][0]["content"][0]
        p = cluster.records("prefill")[-1]
        assert p.json["messages"] == body["messages"]
        assert p.status == 200


def _data_url(n: int, seed: int) -> str:
    import base64
    import random

    return "data:image/png;base64," + base64.b64encode(random.Random(seed).randbytes(n)).decode()


@pytest.mark.parametrize("mode", ["rewrite", "example", "no-rewrite", "no-encoder"])
async def test_large_data_urls_reach_every_stage_byte_for_byte(mode):
    # Large media strings are never decoded by the proxy (epd_proxy.blobs): what each
    # stage receives must still be exactly the client's URL, hashed to the same uuid.
    from blake3 import blake3

    urls = [_data_url(40_000, 1), _data_url(3_000, 2), _data_url(40_000, 1)]
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, record_responses=True,
                    ec_connector="example" if mode == "example" else "nixl")
    encode = 0 if mode == "no-encoder" else 2
    async with stack(encode=encode, sim=sim, rewrite=mode != "no-rewrite") as (cluster, proxy, client):
        # Usage asked for: the proxy relays decode's stream as received (without it, it would
        # ask for the usage event itself and take it out: test_hidden_usage.py).
        body = chat_body(CJK_PROMPT, images=urls, stream=True, max_tokens=12,
                         stream_options={"include_usage": True})
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        assert reply.body == cluster.records("decode")[-1].response_body
        assert reply.text() == expected_text(body)
        sent = [p["image_url"]["url"] for r in cluster.records("encode") for p in r.json["messages"][0]["content"]]
        assert sorted(sent) == sorted(urls[:encode and 3])
        for r in cluster.records("encode"):
            for part in r.json["messages"][0]["content"]:
                if mode == "no-rewrite":
                    assert "uuid" not in part
                else:
                    assert part["uuid"] == blake3(part["image_url"]["url"].encode()).hexdigest()
        d = cluster.records("decode")[-1].json["messages"][0]["content"]
        if mode in ("example", "no-rewrite", "no-encoder"):
            assert [p["image_url"]["url"] for p in d[1:]] == urls
        else:
            assert [p["type"] for p in d[1:]] == ["image_embeds"] * 3
        if encode:
            consumer = cluster.instances("prefill")[0].stats
            assert consumer.local_encodes == 0 and consumer.ec_hits == 3


async def test_text_only_chat_skips_the_encoders():
    async with stack(encode=2, encode_policy="round-robin") as (cluster, proxy, client):
        assert (await client.chat(chat_body())).status == 200
        assert cluster.records("encode") == []


# -- failures before the commit point ---------------------------------------------------------

async def test_decode_500_is_retried_with_fresh_handles():
    async with stack(encode=1) as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("status=500")
        body = chat_body(images=["https://x/a.png"], stream=True)
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        assert reply.text() == expected_text(body)
        d1, d2 = cluster.records("decode")
        p1, p2 = cluster.records("prefill")
        assert d1.status == 500 and d2.status == 200
        assert d1.json["kv_transfer_params"] == p1.kv and d2.json["kv_transfer_params"] == p2.kv
        assert d1.json["kv_transfer_params"] != d2.json["kv_transfer_params"]
        e1, e2 = cluster.records("encode")
        t1 = e1.json.get("ec_transfer_params")
        tids = [p["ec_transfer_params"]["ec_items"][0]["transfer_id"] for p in (p1.json, p2.json)]
        assert tids[0] != tids[1] and t1 is None


async def test_in_band_error_as_first_event_is_retried():
    async with stack() as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("error-after=0")
        body = chat_body(stream=True)
        reply = await client.chat(body)
        assert reply.status == 200
        assert reply.text() == expected_text(body)
        assert len(cluster.records("decode")) == 2


async def test_retry_prefers_another_decode_instance():
    async with stack(decode=2) as (cluster, proxy, client):
        d0, d1 = cluster.instances("decode")
        d0.inject("status=503", times=5)
        d1.inject("status=503", times=5)
        reply = await client.chat(chat_body())
        assert reply.status == 502
        recs = cluster.records("decode")
        assert {r.instance for r in recs} == {"decode-0", "decode-1"}
        assert reply.json()["error"]["type"] == "BadGatewayError"


async def test_retries_exhausted_give_502_with_envelope():
    async with stack(decode_retries=1) as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("status=500", times=2)
        reply = await client.chat(chat_body(stream=True))
        assert reply.status == 502
        err = reply.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert len(cluster.records("decode")) == 2


async def test_upstream_4xx_is_relayed_as_received_and_not_retried():
    async with stack() as (cluster, proxy, client):
        body = chat_body(stream=False, stream_options={"include_usage": True})  # vLLM: 400
        reply = await client.chat(body)
        assert reply.status == 400
        d = cluster.records("decode")[-1]
        assert reply.body == d.response_body
        assert len(cluster.records("decode")) == 1


async def test_encoder_4xx_reaches_a_streaming_client_as_a_status():
    async with stack(encode=1) as (cluster, proxy, client):
        cluster.instances("encode")[0].inject("status=400")
        reply = await client.chat(chat_body(images=["https://x/a.png"], stream=True))
        assert reply.status == 400
        assert reply.json()["error"]["code"] == 400
        assert cluster.records("decode") == []


async def test_encoder_down_is_a_503_for_a_streaming_client():
    # Its only encoder refuses connections: the role is unreachable now.
    async with stack(encode=1, decode_retries=0) as (cluster, proxy, client):
        await cluster.instances("encode")[0].crash()
        reply = await client.chat(chat_body(images=["https://x/a.png"], stream=True))
        assert reply.status == 503
        assert reply.headers[b"retry-after"] == b"5"
        assert reply.json()["error"]["type"] == "ServiceUnavailableError"


async def test_prefill_without_kv_params_is_a_502_not_a_silent_full_prefill():
    async with stack(decode_retries=0) as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("drop-kv")
        reply = await client.chat(chat_body())
        assert reply.status == 502
        assert "kv_transfer_params" in reply.json()["error"]["message"]
        assert cluster.records("decode") == []


async def test_stage_timeout_is_504():
    from epd_proxy.config import StageTimeouts
    async with stack(decode_retries=0, timeouts=StageTimeouts(prefill=0.3)) as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("hang")
        reply = await client.chat(chat_body())
        assert reply.status == 504
        await wait_for(lambda: cluster.records("prefill")[-1].aborted)


async def test_no_reachable_decode_is_503_with_retry_after():
    async with stack(fail_threshold=1, decode_retries=0) as (cluster, proxy, client):
        d = cluster.instances("decode")[0]
        await d.crash()
        for _ in range(2):  # in rotation, then ejected by its probe: tried anyway, both times
            reply = await client.chat(chat_body())
            assert reply.status == 503
            assert reply.headers[b"retry-after"] == b"5"
            assert "no decode instance" in reply.json()["error"]["message"]
            assert d.url not in reply.json()["error"]["message"]
            await probe_round(proxy.app.pools["decode"], 0.5)
        assert proxy.app.pools["decode"].instances[0].state == "ejected"
        await d.restart()
        assert (await client.chat(chat_body())).status == 200


# -- failures after the commit point ------------------------------------------------------------

async def test_reset_mid_stream_ends_with_an_in_band_error_and_done():
    async with stack() as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("reset-after=3")
        reply = await client.chat(chat_body(stream=True, max_tokens=10))
        assert reply.status == 200
        events = reply.events
        assert events[-1] == b"data: [DONE]"
        err = msgspec.json.decode(events[-2][len(b"data: "):])
        assert err["error"]["code"] == 502
        for e in events[:-2]:
            msgspec.json.decode(e[len(b"data: "):])  # every relayed event is whole


async def test_engine_in_band_error_mid_stream_is_relayed():
    async with stack() as (cluster, proxy, client):
        cluster.instances("decode")[0].inject("error-after=3")
        reply = await client.chat(chat_body(stream=True, max_tokens=10))
        assert reply.status == 200
        assert reply.events[-1] == b"data: [DONE]"
        assert b'"error"' in reply.events[-2]
        assert len(cluster.records("decode")) == 1  # never retried after the commit


# -- cancellation ------------------------------------------------------------------------------

async def _send_and_drop(url: str, body: dict, after_bytes: int = 0, wait: float = 0.0) -> None:
    reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
    raw = msgspec.json.encode(body)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%b" % (len(raw), raw))
    if after_bytes:
        await reader.readexactly(after_bytes)
    if wait:
        await asyncio.sleep(wait)
    writer.transport.abort()


async def test_client_disconnect_mid_stream_closes_decode():
    sim = SimConfig(itl_ms=20, ttft_ms=0.5)
    async with stack(sim=sim) as (cluster, proxy, client):
        await _send_and_drop(proxy.url, chat_body(stream=True, max_tokens=200), after_bytes=200)
        await wait_for(lambda: cluster.records("decode") and cluster.records("decode")[-1].aborted)
        await wait_for(lambda: proxy.app.pools["decode"].instances[0].inflight == 0)


async def test_client_disconnect_mid_prefill_closes_prefill():
    async with stack() as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("hang")
        await _send_and_drop(proxy.url, chat_body(stream=True), wait=0.2)
        await wait_for(lambda: cluster.records("prefill") and cluster.records("prefill")[-1].aborted)
        assert cluster.records("decode") == []


async def test_client_disconnect_mid_encode_closes_every_encoder_request():
    async with stack(encode=2, encode_policy="round-robin") as (cluster, proxy, client):
        for inst in cluster.instances("encode"):
            inst.inject("hang")
        await _send_and_drop(proxy.url, chat_body(images=["https://x/a.png", "https://x/b.png"]), wait=0.2)
        await wait_for(lambda: len(cluster.records("encode")) == 2
                       and all(r.aborted for r in cluster.records("encode")))
        assert cluster.records("prefill") == []


async def test_non_stream_client_disconnect_closes_decode():
    sim = SimConfig(itl_ms=20, ttft_ms=0.5)
    async with stack(sim=sim) as (cluster, proxy, client):
        await _send_and_drop(proxy.url, chat_body(stream=False, max_tokens=200), wait=0.3)
        await wait_for(lambda: cluster.records("decode") and cluster.records("decode")[-1].aborted)


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, ctype, status, param", [
    (b"{not json", b"application/json", 400, None),
    (b"[1, 2]", b"application/json", 400, None),
    (b'{"model": "m"}', b"application/json", 400, "messages"),
    (b'{"messages": "hi"}', b"application/json", 400, "messages"),
    (b'{"messages": [{"role": "user", "content": 42}]}', b"application/json", 400, None),
    (b'{"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}', b"application/json", 400, None),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', b"application/json", 400, "stream"),
    (b'{"messages": []}', b"text/plain", 415, None),
])
async def test_bad_input_gets_a_clear_4xx_envelope(raw, ctype, status, param):
    async with stack() as (cluster, proxy, client):
        reply = await client.request("POST", "/v1/chat/completions", raw, [(b"content-type", ctype)])
        assert reply.status == status
        err = reply.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param:
            assert err["param"].startswith(param)
        assert cluster.records() == []


async def test_completions_without_prompt_is_400():
    async with stack() as (cluster, proxy, client):
        reply = await client.post("/v1/completions", {"model": "sim-model"})
        assert reply.status == 400 and reply.json()["error"]["param"] == "prompt"


# -- the rest of the surface ----------------------------------------------------------------------

async def test_pooled_upstream_connections_retire_before_vllms_keep_alive():
    async with stack(upstream_keep_alive=5.0) as (cluster, proxy, client):
        for pool in proxy.app.pools.values():
            for inst in pool.instances:
                assert isinstance(inst.connections, ConnectionPool)
                assert 0 < inst.connections.idle_timeout < 5.0


async def test_upstream_api_key_is_sent_as_bearer():
    async with stack(encode=1, upstream_api_key="sekrit") as (cluster, proxy, client):
        await client.chat(chat_body(images=["https://x/a.png"]))
        for rec in cluster.records():
            assert rec.headers.get("authorization") == "Bearer sekrit"


async def test_keep_alive_client_connection_serves_many_requests():
    async with stack() as (cluster, proxy, client):
        for _ in range(5):
            assert (await client.chat(chat_body(stream=True))).status == 200
        assert client.pool.open_connections == 1


async def test_push_ec_consumer_address_and_replica_rank_match():
    zmq = ["tcp://10.0.0.5:19019", "tcp://10.0.0.5:19020"]  # one decode server, two DP replicas
    async with stack(encode=1, prefill=0, decode=0, pd=1, ec_consumer_zmq_addrs=zmq,
                     ec_consumer_dp_size=2) as (cluster, proxy, client):
        for i in range(4):
            reply = await client.chat(chat_body(images=[f"https://x/z{i}.png"]))
            assert reply.status == 200, reply.body
        enc = cluster.records("encode")
        pd = cluster.records("pd")
        ranks = [int(r.headers["x-data-parallel-rank"]) for r in pd]
        assert ranks == [0, 1, 0, 1]
        for e, d, rank in zip(enc, pd, ranks):
            ec = e.json["ec_transfer_params"]
            assert ec["consumer_zmq"] == zmq[rank]
            sent = [x["transfer_id"] for x in ec["ec_items"]]
            got = [x["transfer_id"] for x in d.json["ec_transfer_params"]["ec_items"]]
            assert sent == got and all(len(t) == 32 for t in sent)
