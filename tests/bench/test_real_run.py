"""A small real run: the load generator through a real proxy in front of an in-process
simulator, on loopback; the report's numbers must add up."""

import json

from epd_proxy.bench import report
from epd_proxy.bench.clients import UrlClient
from epd_proxy.bench.loadgen import Phase
from epd_proxy.bench.workloads import make_workload, prepare, simulator_expected
from epd_proxy.config import ProxyConfig, parse_instance
from epd_proxy.runtime.serve import start_proxy
from epd_proxy.sim import SimCluster, SimConfig


async def test_small_run_through_the_proxy(tmp_path):
    cfg = SimConfig(itl_ms=1.0, split_utf8=True, records=False)
    async with SimCluster(encode=1, prefill=1, decode=1, config=cfg) as cluster:
        pc = ProxyConfig(encode=[parse_instance(u, "encode") for u in cluster.urls("encode")],
                         prefill=[parse_instance(u, "prefill") for u in cluster.urls("prefill")],
                         decode=[parse_instance(u, "decode") for u in cluster.urls("decode")],
                         probe_interval=0)
        proxy = await start_proxy(pc)
        url = proxy.url
        try:
            runs = {}
            for name in ("mixed", "nonstream"):
                wl = make_workload(name, max_tokens=12, variants=3, image_kb=20)
                reqs = prepare(wl, expected=simulator_expected())
                ph = Phase(url, reqs, concurrency=4, warmup=0.0, duration=30.0, max_requests=24,
                           progress=False, label=name, client=UrlClient(url))
                await ph.run()
                s = ph.summary()
                runs[name] = s
                assert s["requests"] == 24, s["error_examples"]
                assert s["ok"] == 24 and s["errors"] == 0
                assert s["verify_errors"] == 0 and s["outside_window"]["verify_errors"] == 0
                assert s["req_s"] > 0 and s["window_s"] > 0
                assert s["e2e_ms"]["count"] == 24
                assert s["e2e_ms"]["p50"] <= s["e2e_ms"]["p99"]
            mixed = runs["mixed"]
            assert set(mixed["e2e_ms_by_kind"]) == {"stream", "nonstream", "mm"}
            # Streams have per-token gaps; 11 gaps per 12-token stream.
            n_stream = mixed["e2e_ms_by_kind"]["stream"]["count"] + mixed["e2e_ms_by_kind"]["mm"]["count"]
            assert mixed["itl_ms"]["count"] == 11 * n_stream
            assert mixed["ttft_ms"]["count"] == 24
            assert runs["nonstream"]["itl_ms"]["count"] == 0
        finally:
            await proxy.close()
    res = {"meta": {"command": "test"}, "scenarios": {"url": {"url": url, "workloads": runs}}}
    res["checks"] = report.checks(res)
    report.write(res, str(tmp_path), plots=False)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["scenarios"]["url"]["workloads"]["mixed"]["requests"] == 24
    assert [c for c in data["checks"] if c["key"] == "verify"][0]["measured"] == 0
    assert "| mixed |" in (tmp_path / "report.md").read_text()


async def test_verification_catches_a_wrong_answer():
    cfg = SimConfig(itl_ms=0.5, records=False)
    async with SimCluster(decode=1, config=cfg) as cluster:
        reqs = prepare(make_workload("stream", max_tokens=4, variants=2), expected=lambda body: "not this")
        url = cluster.urls("decode")[0]
        ph = Phase(url, reqs, concurrency=2, max_requests=6, progress=False, client=UrlClient(url))
        await ph.run()
        s = ph.summary()
        assert s["verify_errors"] == 6 and s["ok"] == 0
        assert s["error_kinds"] == {"verification": 6}


async def test_client_side_stages_baseline():
    """direct-pd: the load generator runs E -> P -> D itself; the text must still verify."""
    from epd_proxy.bench.clients import StagesClient

    cfg = SimConfig(itl_ms=0.5, records=False)
    async with SimCluster(encode=1, prefill=1, decode=1, config=cfg) as cluster:
        reqs = prepare(make_workload("mixed", max_tokens=6, variants=2, image_kb=8), expected=simulator_expected())
        client = StagesClient(cluster.urls("encode")[0], cluster.urls("prefill")[0], cluster.urls("decode")[0])
        ph = Phase("direct-pd", reqs, concurrency=2, max_requests=8, progress=False, client=client)
        await ph.run()
        s = ph.summary()
        assert s["ok"] == 8 and s["errors"] == 0, s["error_examples"]
        assert s["verify_errors"] == 0
        # The prefill and encoder really were used.
        assert cluster.instances("prefill")[0].stats.requests >= 8
        assert cluster.instances("encode")[0].stats.requests >= 2


class _Recording:
    """The real client, noting when each request is sent."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.sent: list[float] = []

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def send(self, prep, timeouts, verify):
        import time

        self.sent.append(time.perf_counter())
        return await self.inner.send(prep, timeouts, verify)


async def _first_sends(url: str, reqs, ramp):
    client = _Recording(UrlClient(url))
    ph = Phase(url, reqs, concurrency=16, warmup=0.6, duration=0.2, progress=False, client=client, ramp=ramp)
    await ph.run()
    assert ph.summary()["errors"] == 0
    return sorted(client.sent)[:16]


async def test_closed_loop_workers_start_spread_over_the_warmup():
    """A deterministic engine keeps workers started together in step forever (bursts of
    C completions); by default the first requests are spread over the warm-up instead."""
    cfg = SimConfig(itl_ms=1.0, records=False)
    async with SimCluster(decode=1, config=cfg) as cluster:
        url = cluster.urls("decode")[0]
        reqs = prepare(make_workload("stream", max_tokens=40, variants=2), expected=simulator_expected())
        together = await _first_sends(url, reqs, ramp=0.0)
        spread = await _first_sends(url, reqs, ramp=None)  # default: over the warm-up
        # Together: the 16 first requests leave at once (before the first one can finish,
        # ~40 ms, on an idle machine: a loaded one stretches that, not the spread below).
        # Spread: 16 uniform draws over 0.6 s, far wider than one request.
        assert spread[-1] - spread[0] > 0.2
        assert together[-1] - together[0] < (spread[-1] - spread[0]) / 4


async def test_messages_and_responses_workloads_through_the_proxy():
    """The Messages and Responses workloads: P/D through the proxy and client-side stages,
    every answer verified against the simulator's text."""
    from epd_proxy.bench.clients import StagesClient

    cfg = SimConfig(itl_ms=0.5, records=False)
    async with SimCluster(prefill=1, decode=1, config=cfg) as cluster:
        pc = ProxyConfig(prefill=[parse_instance(u, "prefill") for u in cluster.urls("prefill")],
                         decode=[parse_instance(u, "decode") for u in cluster.urls("decode")], probe_interval=0)
        proxy = await start_proxy(pc)
        try:
            for name in ("messages", "responses"):
                reqs = prepare(make_workload(name, max_tokens=6, variants=2), expected=simulator_expected())
                assert {r.kind for r in reqs} == {name}
                for client in (UrlClient(proxy.url), StagesClient(None, cluster.urls("prefill")[0],
                                                                  cluster.urls("decode")[0])):
                    ph = Phase(name, reqs, concurrency=2, max_requests=6, progress=False, client=client)
                    await ph.run()
                    s = ph.summary()
                    assert s["ok"] == 6 and s["verify_errors"] == 0, s["error_examples"]
                    assert s["itl_ms"]["count"] == 5 * 6  # streamed: a gap per token after the first
        finally:
            await proxy.close()
