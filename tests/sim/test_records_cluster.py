"""Request records, client aborts, clusters, topology specs and the CLI."""

from __future__ import annotations

import argparse
import asyncio
import time

import msgspec
import pytest
from simhelpers import JSON_HEADERS, chat_body, fast_config, metric, prefill_body

from epd_proxy.http.client import ConnectionPool
from epd_proxy.sim import SimCluster, SimConfig, expected_text
from epd_proxy.sim import cli as sim_cli


async def test_records_are_accurate(http):
    async with SimCluster(prefill=1, decode=1, config=fast_config()) as c:
        body = chat_body("record me", max_tokens=4, stream=True, stream_options={"include_usage": True},
                         min_tokens=2)
        t_before = time.monotonic()
        pr = await http.chat(c.urls("prefill")[0], prefill_body(body), rid="rec-1",
                             headers=[(b"x-custom", b"Value")])
        dr = await http.chat(c.urls("decode")[0], dict(body, kv_transfer_params=pr.json["kv_transfer_params"]),
                             rid="rec-1")
        (prec,) = c.instances("prefill")[0].records
        (drec,) = c.instances("decode")[0].records
        # P saw max_tokens == 1, stream false, no stream_options / min_tokens.
        assert prec.json["max_tokens"] == 1 and prec.json["stream"] is False
        assert "stream_options" not in prec.json and "min_tokens" not in prec.json
        assert prec.json["kv_transfer_params"]["do_remote_decode"] is True
        assert prec.headers["x-request-id"] == "rec-1" and prec.headers["x-custom"] == "Value"
        assert prec.headers["content-type"] == "application/json"
        assert prec.request_id == "rec-1" and prec.method == "POST" and prec.path == "/v1/chat/completions"
        assert msgspec.json.decode(prec.body) == prec.json
        assert prec.status == 200 and not prec.aborted and prec.fault is None and not prec.stream
        assert prec.bytes_sent == len(pr.data)
        assert prec.kv == pr.json["kv_transfer_params"]
        assert t_before <= prec.t_received <= prec.t_headers <= prec.t_end <= drec.t_received
        assert drec.stream and drec.status == 200 and drec.bytes_sent == len(dr.data)
        assert drec.t_received <= drec.t_headers <= drec.t_end
        assert drec.json["min_tokens"] == 2
        assert [r.instance for r in c.records()] == ["prefill-0", "decode-0"]
        assert c.records("decode") == [drec]
        # Side-channel traffic is not in the records; it is in side_channel_log.
        assert all(not r.path.startswith("/sim/") for r in c.records())
        assert [e["op"] for e in c.instances("prefill")[0].side_channel_log] == ["serve-pull"]


async def test_client_disconnect_mid_stream_is_recorded_as_aborted(http):
    async with SimCluster(decode=1, config=fast_config(itl_ms=5)) as c:
        d = c.instances("decode")[0]
        pool = ConnectionPool(d.url)
        resp = await pool.request("POST", "/v1/chat/completions", headers=JSON_HEADERS,
                                  body=msgspec.json.encode(chat_body(max_tokens=500, stream=True)))
        first = await resp.read_chunk()
        assert first.startswith(b"data: ")
        resp.close()  # unfinished body: the connection is aborted
        await pool.close()
        await asyncio.sleep(0.05)
        (rec,) = d.records
        assert rec.aborted and rec.status == 200 and rec.t_end is not None
        assert 0 < rec.bytes_sent < 500 * 100
        assert d.stats.aborted == 1 and d.engine.n_active == 0
        text = (await http.get(d.url, "/metrics")).data.decode()
        assert metric(text, "sim:aborted_requests_total") == 1
        # vLLM counts a client's disconnect under no finished_reason.
        assert metric(text, "vllm:request_success_total") == 0
        assert 'finished_reason="abort"} 0.0' in text
        # Non-stream aborts are seen too (vLLM cancels those handlers as well).
        pool = ConnectionPool(d.url)
        task = asyncio.create_task(pool.request("POST", "/v1/chat/completions", headers=JSON_HEADERS,
                                                body=msgspec.json.encode(chat_body(max_tokens=500))))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await pool.close()
        await asyncio.sleep(0.05)
        assert d.records[-1].aborted and d.records[-1].t_headers is None and d.stats.aborted == 2
        assert sum(d.stats.success.values()) == 0


async def test_records_can_be_turned_off(http):
    async with SimCluster(pd=1, config=fast_config(records=False)) as c:
        assert (await http.chat(c.urls("pd")[0], chat_body(max_tokens=2))).status == 200
        assert len(c.instances("pd")[0].records) == 0
    async with SimCluster(pd=1, config=fast_config(max_records=3)) as c:
        for _ in range(5):
            await http.chat(c.urls("pd")[0], chat_body(max_tokens=1))
        assert len(c.instances("pd")[0].records) == 3


async def test_two_clusters_do_not_interfere(http):
    async with SimCluster(encode=1, prefill=1, decode=1, config=fast_config()) as a, \
            SimCluster(encode=1, prefill=1, decode=1, config=fast_config()) as b:
        assert not set(a.urls("decode")) & set(b.urls("decode"))
        assert a.prefill_identity(0)["engine_id"] == b.prefill_identity(0)["engine_id"]
        body = chat_body("cluster a", max_tokens=3)
        kv = (await http.chat(a.urls("prefill")[0], prefill_body(body))).json["kv_transfer_params"]
        # B's decode is pointed at A's prefill by the params: it pulls from A, not from B.
        r = await http.chat(b.urls("decode")[0], dict(body, kv_transfer_params=kv))
        assert r.status == 200
        kv2 = (await http.chat(a.urls("prefill")[0], prefill_body(body))).json["kv_transfer_params"]
        forged = dict(kv2, remote_port=b.instances("prefill")[0].port)  # B never prefilled this
        r = await http.chat(a.urls("decode")[0], dict(body, kv_transfer_params=forged))
        assert r.status == 500
        # EC stores are per cluster.
        img = {"type": "image_url", "image_url": {"url": "https://x/only-in-a.png"}, "uuid": "u-a"}
        await http.chat(a.urls("encode")[0], {"model": "sim-model", "messages": [{"role": "user", "content": [img]}]})
        assert "u-a" in a.ec_store and "u-a" not in b.ec_store
        assert len(a.records()) == 4 and len(b.records()) == 1
        assert a.instances("prefill")[0].held_kv_blocks == 1 and b.held_kv_blocks == 0


async def test_startup_is_fast_and_spec_parsing():
    t0 = time.monotonic()
    async with SimCluster.from_spec("encode=2,prefill=2,decode=4,pd=1") as c:
        assert time.monotonic() - t0 < 0.5
        assert [len(c.instances(r)) for r in ("encode", "prefill", "decode", "pd")] == [2, 2, 4, 1]
        assert len(c.all_instances()) == 9 and len(set(i.port for i in c.all_instances())) == 9
        assert c.instances("encode")[1].name == "encode-1"
    c = SimCluster.from_spec("e=1,p=1,d=2,kv=nixl-push,itl_ms=7,decode.itl_ms=3,max_num_seqs=9")
    assert c.config.kv_connector == "nixl-push" and c.config.itl_ms == 7 and c.config.max_num_seqs == 9
    assert c.instances("decode")[0].config.itl_ms == 3 and c.instances("prefill")[0].config.itl_ms == 7
    for bad in ("encode=x", "frobnicate=1", "kv=tcp", "decode"):
        with pytest.raises(ValueError):
            SimCluster.from_spec(bad)


async def test_base_port_and_identities(http):
    import random

    # Consecutive fixed ports: try a few bases below the ephemeral range until one is free.
    for _attempt in range(20):
        base = random.randrange(20000, 30000)
        cluster = SimCluster(encode=1, prefill=2, decode=1, base_port=base,
                             config=fast_config(kv_connector="mooncake", engine_id_format="my-{role}-{index}"))
        try:
            await cluster.start()
        except OSError:
            continue
        break
    else:
        pytest.skip("no free run of 6 ports")
    try:
        c = cluster
        assert [i.port for i in c.all_instances()] == [base, base + 1, base + 2, base + 3]
        ids = c.prefill_identities()
        assert [i["engine_id"] for i in ids] == ["my-prefill-0", "my-prefill-1"]
        assert [i["bootstrap_port"] for i in ids] == [base + 4, base + 5]
        assert ids[0]["kv_port"] == base + 1 and ids[0]["kv_host"] == "127.0.0.1"
        assert "my-prefill-1" in c.describe()
        assert (await http.get(c.urls("decode")[0], "/health")).status == 200
    finally:
        await cluster.stop()


async def test_cli_runs_until_cancelled(capsys):
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    args = parser.parse_args(["--encode", "1", "--prefill", "1", "--decode", "2", "--kv-connector", "nixl-push",
                              "--itl-ms", "0", "--fault-rate", "0", "--set", "decode.max_num_seqs=4"])
    task = asyncio.create_task(sim_cli.run_cluster(args))
    await asyncio.sleep(0.2)
    out = capsys.readouterr().out
    assert "decode" in out and "engine_id=sim-prefill-0" in out
    url = out.split("decode")[1].split()[0]
    pool = ConnectionPool(url)
    resp = await pool.request("POST", "/v1/chat/completions", headers=JSON_HEADERS,
                              body=msgspec.json.encode(chat_body(max_tokens=3)))
    data = msgspec.json.decode(await resp.read())
    assert data["choices"][0]["message"]["content"] == expected_text(chat_body(max_tokens=3))
    await pool.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_config_validation():
    with pytest.raises(ValueError):
        SimConfig(kv_connector="tcp")
    with pytest.raises(ValueError):
        SimConfig(roles={"decode": {"nope": 1}})
    with pytest.raises(ValueError):
        SimConfig(roles={"worker": {"itl_ms": 1}})
    with pytest.raises(ValueError):
        SimConfig(ec_connector="shared-disk")
    with pytest.raises(ValueError):
        SimConfig(roles={"encode": {"ec_connector": "nope"}})


def test_cli_fidelity_switches():
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    cfg = sim_cli.config_from_args(parser.parse_args(["--ec-connector", "example", "--no-strict-roles",
                                                      "--kv-failure-delay-ms", "5000"]))
    assert (cfg.ec_connector, cfg.strict_roles, cfg.kv_failure_delay_ms) == ("example", False, 5000.0)
    cfg = sim_cli.config_from_args(parser.parse_args([]))
    assert (cfg.ec_connector, cfg.strict_roles, cfg.kv_failure_delay_ms, cfg.echo_request_id) == (
        "nixl", True, 0.0, True)
    c = SimCluster.from_spec("pd=1,ec_connector=example,echo_request_id=false,system_fingerprint=fp-1")
    (inst,) = c.all_instances()
    assert inst.config.ec_connector == "example" and not inst.config.echo_request_id
    assert inst.system_fingerprint == "fp-1"
