"""Where a retry may go, over real sockets: never back to an instance that timed out on the
request, never a prefill that no decode can take, and a refused decode's KV handed to another
decode rather than left held on the prefill; and every failure counter at 0 from the start."""

import time

import pytest
from helpers import chat_body, stack, wait_for
from prometheus_client.parser import text_string_to_metric_families

from epd_proxy.config import StageTimeouts
from epd_proxy.sim import SimConfig

pytestmark = pytest.mark.asyncio

SIM = SimConfig(itl_ms=0, ttft_ms=0.5, kv_abort_timeout=30.0)


def _series(text: str, name: str) -> dict[tuple, float]:
    """A family's samples by their sorted labels (``name`` as exported, e.g. ``..._total``)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


async def test_a_hung_prefill_alone_is_answered_504_at_the_stage_timeout():
    # The first-byte deadline is far off: the answer comes at the prefill timeout, and the
    # retries never go back to the instance that timed out.
    t = StageTimeouts(prefill=0.3, first_byte=10.0)
    async with stack(sim=SIM, decode_retries=3, timeouts=t) as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("hang", times=5)
        t0 = time.monotonic()
        reply = await client.chat(chat_body())
        elapsed = time.monotonic() - t0
        assert reply.status == 504, reply.body
        err = reply.json()["error"]
        assert err["type"] == "GatewayTimeoutError" and err["message"].startswith("prefill instance timed out")
        assert "127.0.0.1" not in err["message"]
        assert 0.3 <= elapsed < 1.5
        assert len(cluster.records("prefill")) == 1 and cluster.records("decode") == []
        inst = proxy.app.pools["prefill"].instances[0]
        # An instance signal of its own kind, not a request failure.
        assert inst.health.errors == {"timeout": 1} and inst.health.window_failures == 0
        assert proxy.app.metrics.retries == 0


async def test_a_hung_prefill_is_retried_on_the_other_one():
    t = StageTimeouts(prefill=0.3, first_byte=10.0)
    async with stack(prefill=2, sim=SIM, decode_retries=1, routing="round-robin",
                     timeouts=t) as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("hang", times=5)
        for _ in range(2):
            reply = await client.chat(chat_body())
            assert reply.status == 200, reply.body
        # Each request: the hung instance first (round-robin starts there), then the other.
        assert [r.instance for r in cluster.records("prefill")] == ["prefill-0", "prefill-1"] * 2
        assert proxy.app.metrics.retries == 2


async def test_no_prefill_runs_when_every_decode_is_draining():
    async with stack(sim=SIM) as (cluster, proxy, client):
        pool = proxy.app.pools["decode"]
        pool.outliers.drain(pool.instances[0])
        reply = await client.chat(chat_body())
        assert reply.status == 503 and reply.headers.get(b"retry-after") == b"5"
        assert "decode" in reply.json()["error"]["message"]
        assert cluster.records("prefill") == []


async def test_a_refused_decode_costs_one_prefill_and_its_kv_is_counted_stranded():
    # The only decode is down: the prefill that ran before it refused is not run again for a
    # retry that could only go back to it, and its held KV is counted.
    async with stack(sim=SIM, decode_retries=3) as (cluster, proxy, client):
        await cluster.instances("decode")[0].stop()
        reply = await client.chat(chat_body())
        assert reply.status == 503 and reply.headers.get(b"retry-after") == b"5", reply.body
        assert reply.json()["error"]["message"] == "no decode instance available: none accepts connections"
        assert len(cluster.records("prefill")) == 1 and cluster.held_kv_blocks > 0
        text = (await client.request("GET", "/metrics")).body.decode()
        stranded = _series(text, "epd_proxy_kv_stranded_total")
        assert list(stranded.values()) == [1.0]
        ((labels, _),) = stranded.items()
        assert dict(labels)["role"] == "prefill"


async def test_a_refused_decode_hands_the_kv_to_another_decode():
    async with stack(decode=2, sim=SIM, routing="round-robin") as (cluster, proxy, client):
        await cluster.instances("decode")[0].stop()
        for _ in range(4):
            reply = await client.chat(chat_body())
            assert reply.status == 200, reply.body
        # One prefill per request: the refused decode's parameters went to the other decode.
        assert len(cluster.records("prefill")) == 4
        assert proxy.app.pools["decode"].instances[0].health.errors.get("connect", 0) >= 1
        await wait_for(lambda: cluster.held_kv_blocks == 0, timeout=5)
        assert proxy.app.pools["prefill"].instances[0].stranded == 0
        assert proxy.app.metrics.retries == 0


async def test_every_failure_counter_has_its_series_before_the_first_failure():
    async with stack(encode=1, sim=SIM) as (cluster, proxy, client):
        text = (await client.request("GET", "/metrics")).body.decode()
    urls = {role: cluster.urls(role) for role in ("encode", "prefill", "decode")}
    failures = _series(text, "epd_proxy_instance_failures_total")
    for role, role_urls in urls.items():
        for url in role_urls:
            for kind in ("connect", "timeout", "http_500", "http_503", "in_band", "probe_status"):
                assert failures[(("kind", kind), ("role", role), ("url", url))] == 0
            key = (("role", role), ("url", url))
            assert _series(text, "epd_proxy_instance_retries_total")[key] == 0
            assert _series(text, "epd_proxy_instance_ejections_total")[key] == 0
    assert set(_series(text, "epd_proxy_kv_stranded_total").values()) == {0.0}
    assert _series(text, "epd_proxy_kv_stranded_total").keys() == {(("role", "prefill"), ("url", u))
                                                                    for u in urls["prefill"]}
    removals = _series(text, "epd_proxy_removals_total")
    assert removals[(("reason", "forgotten"), ("role", "decode"))] == 0
    assert _series(text, "epd_proxy_client_rejections_total")[(("status", "408"),)] == 0
