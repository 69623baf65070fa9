"""KV connectors against the simulator: NIXL push (both legs at once) and its failure timings."""

import asyncio

import msgspec
import pytest
from helpers import chat_body, stack, wait_for

from epd_proxy.config import StageTimeouts
from epd_proxy.request.legs.connectors import NixlPush
from epd_proxy.sim import SimConfig, expected_text


def push_sim(**kw) -> SimConfig:
    base = dict(itl_ms=0, ttft_ms=0.5, kv_connector="nixl-push", push_registration_timeout=2.0,
                kv_abort_timeout=2.0)
    base.update(kw)
    return SimConfig(**base)


def test_push_decode_params_carry_the_prefills_identity():
    from epd_proxy.config import parse_instance
    spec = parse_instance("http://p1:8100;engine_id=prefill-0;kv_host=10.0.0.1;kv_port=5600;tp=2;pp=1", "prefill")
    params = NixlPush.decode_params(spec, "req-1", "xfer-abc")
    assert params == {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "prefill-0",
                      "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 2, "pp_size": 1,
                      "remote_request_id": "req-1", "transfer_id": "xfer-abc"}
    assert "remote_block_ids" not in params


@pytest.mark.parametrize("stream", [False, True])
async def test_push_runs_both_legs_at_once(stream):
    sim = push_sim(roles={"prefill": {"ttft_ms": 150.0}})
    async with stack(sim=sim, kv_connector="nixl-push") as (cluster, proxy, client):
        body = chat_body(stream=stream, max_tokens=6)
        reply = await client.chat(body, headers=[(b"x-request-id", b"push-1")])
        assert reply.status == 200, reply.body
        assert reply.text() == expected_text(body)
        p = cluster.records("prefill")[-1]
        d = cluster.records("decode")[-1]
        # Decode's request arrived before prefill had answered: the legs overlapped.
        assert d.t_received < p.t_headers
        pk, dk = p.json["kv_transfer_params"], d.json["kv_transfer_params"]
        assert pk["do_remote_decode"] is True and pk["transfer_id"].startswith("xfer-")
        assert dk["transfer_id"] == pk["transfer_id"]
        ident = cluster.prefill_identity(0)
        assert (dk["remote_engine_id"], dk["remote_host"], dk["remote_port"]) == (
            ident["engine_id"], ident["kv_host"], ident["kv_port"])
        # vLLM's push connector pairs the legs by X-Request-Id: a fresh id per attempt,
        # the same on both legs, derived from the client's (which the client gets back).
        leg_id = dk["remote_request_id"]
        assert leg_id.startswith("push-1-") and "remote_block_ids" not in dk
        assert p.request_id == d.request_id == leg_id
        assert reply.headers[b"x-request-id"] == b"push-1"
        assert p.json["stream"] is False and p.json["max_tokens"] == 1
        assert cluster.held_kv_blocks == 0


async def test_push_with_several_prefills_uses_each_ones_identity():
    async with stack(prefill=2, sim=push_sim(), kv_connector="nixl-push",
                     prefill_policy="round-robin") as (cluster, proxy, client):
        for _ in range(4):
            assert (await client.chat(chat_body())).status == 200
        by_engine = {}
        for d in cluster.records("decode"):
            by_engine.setdefault(d.json["kv_transfer_params"]["remote_engine_id"], 0)
            by_engine[d.json["kv_transfer_params"]["remote_engine_id"]] += 1
        assert set(by_engine) == {i["engine_id"] for i in cluster.prefill_identities()}


async def test_push_prefill_failure_before_first_token_is_a_status_and_closes_decode():
    async with stack(sim=push_sim(), kv_connector="nixl-push", decode_retries=0) as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("status=503")
        reply = await client.chat(chat_body(stream=True))
        assert reply.status == 502
        assert reply.json()["error"]["type"] == "BadGatewayError"
        await wait_for(lambda: cluster.records("decode") and cluster.records("decode")[-1].done)
        assert cluster.records("decode")[-1].aborted


async def test_push_prefill_client_error_is_relayed():
    async with stack(sim=push_sim(), kv_connector="nixl-push") as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("status=400")
        reply = await client.chat(chat_body(stream=True))
        assert reply.status == 400
        assert len(cluster.records("prefill")) == 1


async def test_push_reused_client_id_never_pairs_two_requests():
    async with stack(sim=push_sim(), kv_connector="nixl-push") as (cluster, proxy, client):
        for _ in range(2):
            assert (await client.chat(chat_body(), headers=[(b"x-request-id", b"same")])).status == 200
        ids = [r.request_id for r in cluster.records("decode")]
        assert len(set(ids)) == 2 and all(i.startswith("same-") for i in ids)


async def test_push_retry_uses_a_new_transfer_id():
    async with stack(sim=push_sim(), kv_connector="nixl-push") as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("status=503")
        body = chat_body(stream=True)
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        assert reply.text() == expected_text(body)
        tids = [r.json["kv_transfer_params"]["transfer_id"] for r in cluster.records("prefill")]
        assert len(tids) == 2 and tids[0] != tids[1]
        leg_ids = [r.request_id for r in cluster.records("prefill")]
        assert leg_ids[0] != leg_ids[1]


async def test_push_prefill_failure_after_first_token_ends_in_band():
    # Prefill pushes the KV (decode starts streaming), then answers 500 a little later.
    sim = push_sim(itl_ms=20)
    async with stack(sim=sim, kv_connector="nixl-push") as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("stall-after=0:0.2,error-after=0")
        reply = await client.chat(chat_body(stream=True, max_tokens=40))
        assert reply.status == 200
        assert reply.events[-1] == b"data: [DONE]"
        err = msgspec.json.decode(reply.events[-2][len(b"data: "):])
        assert "prefill" in err["error"]["message"]
        await wait_for(lambda: cluster.records("decode")[-1].done)
        assert cluster.records("decode")[-1].aborted


async def test_push_decode_done_while_prefill_hangs_ends_the_response_now():
    sim = push_sim()
    async with stack(sim=sim, kv_connector="nixl-push", timeouts=StageTimeouts(prefill=1.0)) as (
            cluster, proxy, client):
        # Prefill pushes (so decode can finish) but never answers its HTTP request.
        cluster.instances("prefill")[0].inject("stall-after=0:30")
        body = chat_body(stream=True)
        reply = await asyncio.wait_for(client.chat(body), 5)
        assert reply.status == 200 and reply.text() == expected_text(body)
        # The prefill leg is drained in the background and bounded by its timeout.
        await wait_for(lambda: cluster.records("prefill")[-1].done, timeout=5)
        await wait_for(lambda: not proxy.app.pipeline._background, timeout=5)


async def test_push_client_disconnect_closes_both_legs():
    sim = push_sim(itl_ms=20, roles={"prefill": {"ttft_ms": 300.0}})
    async with stack(sim=sim, kv_connector="nixl-push") as (cluster, proxy, client):
        reader, writer = await asyncio.open_connection(*proxy.url.removeprefix("http://").split(":"))
        raw = msgspec.json.encode(chat_body(stream=True, max_tokens=100))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(raw), raw))
        await wait_for(lambda: cluster.records("prefill") and cluster.records("decode"))
        writer.transport.abort()
        await wait_for(lambda: cluster.records("prefill")[-1].done and cluster.records("decode")[-1].done)
        assert cluster.records("prefill")[-1].aborted and cluster.records("decode")[-1].aborted
        await wait_for(lambda: cluster.held_kv_blocks == 0, timeout=5)


async def test_e_p_d_in_push_mode_encodes_first():
    async with stack(encode=1, sim=push_sim(), kv_connector="nixl-push") as (cluster, proxy, client):
        body = chat_body(images=["https://x/a.png"], stream=True)
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        e = cluster.records("encode")[-1]
        p = cluster.records("prefill")[-1]
        assert e.t_end <= p.t_received
        assert p.json["messages"][0]["content"][1]["type"] == "image_embeds"


# -- Mooncake ------------------------------------------------------------------------------

def mooncake_sim(**kw) -> SimConfig:
    return push_sim(kv_connector="mooncake", **kw)


@pytest.mark.parametrize("stream", [False, True])
async def test_mooncake_sends_bootstrap_address_and_engine_id(stream):
    async with stack(sim=mooncake_sim(), kv_connector="mooncake") as (cluster, proxy, client):
        body = chat_body(stream=stream)
        reply = await client.chat(body)
        assert reply.status == 200, reply.body
        assert reply.text() == expected_text(body)
        p, d = cluster.records("prefill")[-1], cluster.records("decode")[-1]
        ident = cluster.prefill_identity(0)
        pk, dk = p.json["kv_transfer_params"], d.json["kv_transfer_params"]
        assert pk == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": pk["transfer_id"]}
        assert dk == {"do_remote_decode": False, "do_remote_prefill": True,
                      "remote_bootstrap_addr": ident["bootstrap_addr"], "remote_engine_id": ident["engine_id"],
                      "transfer_id": pk["transfer_id"]}
        assert p.headers["x-data-parallel-rank"] == "0"
        assert cluster.held_kv_blocks == 0


def test_mooncake_needs_each_prefills_bootstrap_port():
    from epd_proxy.api.app import validate_config
    from epd_proxy.config import ProxyConfig, parse_instance
    cfg = ProxyConfig(prefill=[parse_instance("http://p:1", "prefill")],
                      decode=[parse_instance("http://d:2", "decode")], kv_connector="mooncake")
    with pytest.raises(ValueError, match="bootstrap_port"):
        validate_config(cfg)
    validate_config(cfg.replace(prefill=[parse_instance("http://p:1;bootstrap_port=8998", "prefill")]))


async def test_mooncake_prefill_without_bootstrap_answer_is_skipped():
    async with stack(prefill=2, sim=mooncake_sim(), kv_connector="mooncake") as (cluster, proxy, client):
        connector = proxy.app.pipeline.connector
        dead = proxy.app.pools["prefill"].instances[0]
        # As if prefill 0's bootstrap server never answered: requests routed there move on.
        connector._engines.pop(dead.url, None)
        await cluster.instances("prefill")[0].crash()
        for _ in range(3):
            reply = await client.chat(chat_body())
            assert reply.status == 200, reply.body
        served = {r.instance for r in cluster.records("prefill") if r.path != "/query"}
        assert served == {"prefill-1"}


def test_the_connector_check_names_the_known_connectors_and_asks_the_connector_about_its_instances():
    from epd_proxy.config import ProxyConfig, parse_instance
    from epd_proxy.request.legs.connectors import check_connector_config
    decode = [parse_instance("http://d:2", "decode")]
    with pytest.raises(ValueError, match="unknown --kv-connector 'tcp' \\(known: nixl, nixl-push, mooncake\\)"):
        check_connector_config(ProxyConfig(decode=decode, kv_connector="tcp"))
    bare = ProxyConfig(prefill=[parse_instance("http://p:1", "prefill")], decode=decode, kv_connector="nixl-push")
    with pytest.raises(ValueError, match="engine_id"):
        check_connector_config(bare)
    check_connector_config(bare.replace(kv_connector="nixl"))  # pull mode learns what it needs per request
