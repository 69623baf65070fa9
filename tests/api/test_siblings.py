"""With --workers, /metrics, /status and /ready answer for the whole proxy (siblings.py), over
real sockets to a real multi-process proxy."""

import asyncio

import msgspec
from helpers import JSON, chat_body
from procs import child_proxy, fresh_request
from prometheus_client.parser import text_string_to_metric_families

from epd_proxy.sim import SimCluster, SimConfig


def _samples(text: bytes) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


async def _until_every_worker_answers(url: str, workers: int) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    while (await fresh_request(url, "GET", "/status")).json().get("workers") != workers:
        assert loop.time() < end, "the workers never all answered"
        await asyncio.sleep(0.05)


async def test_every_scrape_counts_every_request_of_every_worker():
    """Each scrape used to reach one worker: 47 requests read as 23, 24, 23, ..."""
    async with SimCluster(prefill=1, decode=1, config=SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        async with child_proxy(cluster, "--workers", "2", "--probe-interval", "0.5") as (_, url):
            await _until_every_worker_answers(url, 2)
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            while not all(all(i["models"] for i in pool)
                          for pool in (await fresh_request(url, "GET", "/status")).json()["pools"].values()):
                assert loop.time() < end, "the instances' models were never read"
                await asyncio.sleep(0.05)
            n = 16
            body = msgspec.json.encode(chat_body(max_tokens=2))
            replies = await asyncio.gather(*(fresh_request(url, "POST", "/v1/chat/completions", body, JSON)
                                             for _ in range(n)))
            assert [r.status for r in replies] == [200] * n
            chat = ("endpoint", "/v1/chat/completions")
            for _ in range(6):  # fresh connections: each may be taken by either worker
                s = _samples((await fresh_request(url, "GET", "/metrics")).body)
                assert s[("epd_proxy_requests_total", (chat, ("status", "200")))] == n
                assert s[("epd_proxy_request_duration_seconds_count",
                          (chat, ("status_class", "2xx"), ("stream", "false")))] == n
                assert s[("epd_proxy_workers", ())] == 2
                decode = (("role", "decode"), ("url", cluster.urls("decode")[0]))
                assert s[("epd_proxy_instance_requests_total", decode)] == n
                # Health is each worker's own view: one series per worker.
                assert {dict(k[1])["worker"] for k in s if k[0] == "epd_proxy_instance_healthy"} == {"0", "1"}
                assert s[("process_start_time_seconds", ())] > 0
                # The roster is the same in every worker: not counted twice.
                assert s[("epd_proxy_roster_instances", (("role", "decode"), ("state", "healthy")))] == 1
                # Per model: requests summed over the workers; what an instance serves, once.
                assert s[("epd_proxy_model_requests_total", (("model", "sim-model"), ("status", "200")))] == n
                assert s[("epd_proxy_instance_model_info", (("model", "sim-model"),) + decode)] == 1

                status = (await fresh_request(url, "GET", "/status")).json()
                assert status["workers"] == 2
                assert status["pools"]["decode"][0]["requests"] == n
                assert status["pools"]["decode"][0]["healthy_workers"] == 2
                assert status["models"]["sim-model"]["ready"]  # over the merged pools
                assert status["models"]["sim-model"]["roles"]["decode"] == {"in_rotation": 1, "out": 0}

                ready = await fresh_request(url, "GET", "/ready")
                assert ready.status == 200
                assert ready.json() == {"status": "ready", "workers": 2, "workers_configured": 2}
