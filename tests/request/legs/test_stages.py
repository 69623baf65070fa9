"""The prefill and decode stages against simulated instances over real sockets: what each
returns, and the status a client would see for each way an instance can fail."""

import contextlib

import msgspec
import pytest
from helpers import chat_body
from procs import free_port

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import choose
from epd_proxy.request.context import RequestContext
from epd_proxy.request.legs.stage_bodies import decode_body, nixl_prefill_request_params, prefill_body
from epd_proxy.request.legs.stages import DecodeStage, PrefillStage
from epd_proxy.sim import SimCluster, SimConfig
from epd_proxy.wire.errors import ProxyError


@contextlib.asynccontextmanager
async def role_pool(role, urls):
    pool = InstancePool(role, [InstanceSpec(u, role) for u in urls])
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def cluster():
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as c:
        yield c


def new_ctx():
    return RequestContext("req-stage", "/v1/chat/completions", [])


def to_prefill(body):
    return prefill_body(body, nixl_prefill_request_params())


def failures(pool):
    return pool.snapshot()[0]["consecutive_failures"]


async def test_prefill_returns_the_kv_transfer_params_raw(cluster):
    async with role_pool("prefill", cluster.urls("prefill")) as pool:
        stage = PrefillStage(pool, timeout=5, connect_timeout=2)
        ctx = new_ctx()
        inst = choose(pool)
        kv = await stage.run(ctx, inst, to_prefill(chat_body()))
        assert isinstance(kv, msgspec.Raw)
        params = msgspec.json.decode(kv)
        assert params["do_remote_prefill"] is True and params["remote_block_ids"]
        assert ctx.prefill_report is not None  # the prompt's usage, for the client's
        assert "prefill" in ctx.timings
        assert (inst.inflight, inst.requests, failures(pool)) == (0, 1, 0)
        assert ctx.legs == [inst]


async def test_prefill_without_kv_params_returns_none(cluster):
    async with role_pool("prefill", cluster.urls("prefill")) as pool:
        stage = PrefillStage(pool, timeout=5, connect_timeout=2)
        kv = await stage.run(new_ctx(), choose(pool), to_prefill(chat_body(sim_fault="drop-kv")))
        assert kv is None


async def test_an_upstream_4xx_is_relayed_and_blames_nobody(cluster):
    async with role_pool("prefill", cluster.urls("prefill")) as pool:
        stage = PrefillStage(pool, timeout=5, connect_timeout=2)
        inst = choose(pool)
        with pytest.raises(ProxyError) as caught:
            await stage.run(new_ctx(), inst, to_prefill(chat_body(sim_fault="status=400")))
        err = caught.value
        assert err.status == 400 and not err.retryable
        assert err.upstream_body is not None and err.body() == err.upstream_body  # the engine's own answer
        assert (inst.inflight, failures(pool)) == (0, 0)


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_an_upstream_5xx_is_a_retryable_502_naming_the_role(cluster, status):
    async with role_pool("prefill", cluster.urls("prefill")) as pool:
        stage = PrefillStage(pool, timeout=5, connect_timeout=2)
        inst = choose(pool)
        ctx = new_ctx()
        with pytest.raises(ProxyError) as caught:
            await stage.run(ctx, inst, to_prefill(chat_body(sim_fault=f"status={status}")))
        err = caught.value
        assert (err.status, err.retryable) == (502, True)
        assert err.message.startswith(f"prefill instance failed with HTTP {status}")
        assert inst.url not in err.message and "127.0.0.1" not in err.message
        assert inst.inflight == 0
        # 502/503 say something about the instance, vLLM's 500 only about this request.
        assert failures(pool) == (0 if status == 500 else 1)


async def test_a_refused_connection_with_no_other_instance_is_503():
    async with role_pool("prefill", [f"http://127.0.0.1:{free_port()}"]) as pool:
        stage = PrefillStage(pool, timeout=5, connect_timeout=2)
        inst = choose(pool)
        ctx = new_ctx()
        with pytest.raises(ProxyError) as caught:
            await stage.run(ctx, inst, to_prefill(chat_body()))
        err = caught.value
        assert (err.status, err.retryable) == (503, True)
        assert err.message.startswith("no prefill instance available")
        assert "127.0.0.1" not in err.message
        assert inst in ctx.excluded and inst.inflight == 0


async def test_decode_reads_past_the_role_chunk_before_anything_is_committed(cluster):
    async with role_pool("decode", cluster.urls("decode")) as pool:
        stage = DecodeStage(pool, first_timeout=5, idle_timeout=5, connect_timeout=2)
        ctx = new_ctx()
        inst = choose(pool)
        leg = await stage.open(ctx, inst, decode_body(chat_body(stream=True), kv=None))
        try:
            assert leg.inst is inst and leg.body is None
            events = [e for e in leg.first.split(b"\n\n") if e]
            assert b'"role":"assistant"' in events[0]
            assert b'"content":' in events[-1] and events[-1] != events[0]  # a token was read
            assert inst.inflight == 1  # held until the relay is done with it
            assert "decode_first" in ctx.timings
        finally:
            leg.resp.close()
            ctx.release_all()
        assert inst.inflight == 0


async def test_decode_non_stream_returns_the_whole_answer(cluster):
    async with role_pool("decode", cluster.urls("decode")) as pool:
        stage = DecodeStage(pool, first_timeout=5, idle_timeout=5, connect_timeout=2)
        ctx = new_ctx()
        leg = await stage.open(ctx, choose(pool), decode_body(chat_body(), kv=None))
        try:
            assert msgspec.json.decode(leg.body)["choices"][0]["message"]["content"]
            assert leg.first == b""
        finally:
            leg.resp.close()
            ctx.release_all()


async def test_decode_in_band_error_as_first_event_is_retryable(cluster):
    async with role_pool("decode", cluster.urls("decode")) as pool:
        stage = DecodeStage(pool, first_timeout=5, idle_timeout=5, connect_timeout=2)
        inst = choose(pool)
        ctx = new_ctx()
        with pytest.raises(ProxyError) as caught:
            await stage.open(ctx, inst, decode_body(chat_body(stream=True, sim_fault="error-after=0"), kv=None))
        assert (caught.value.status, caught.value.retryable) == (502, True)
        assert caught.value.message.startswith("decode instance failed")
        assert inst.inflight == 0


async def test_decode_without_headers_in_time_is_504(cluster):
    async with role_pool("decode", cluster.urls("decode")) as pool:
        stage = DecodeStage(pool, first_timeout=0.2, idle_timeout=5, connect_timeout=2)
        inst = choose(pool)
        ctx = new_ctx()
        with pytest.raises(ProxyError) as caught:
            await stage.open(ctx, inst, decode_body(chat_body(stream=True, sim_fault="hang"), kv=None))
        # Not retryable: the pool's only instance timed out, and no retry goes back to it.
        assert (caught.value.status, caught.value.retryable) == (504, False)
        assert caught.value.message.startswith("decode instance timed out") and inst in ctx.timed_out
        assert inst.inflight == 0 and failures(pool) == 1
