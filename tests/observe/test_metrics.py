"""The metrics record plain numbers and render Prometheus text only when scraped;
what a scraper sees must equal what prometheus_client's own objects would say."""

import random
import shutil
import subprocess
from types import SimpleNamespace

import pytest
from helpers import chat_body, stack
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epd_proxy.instances.collectors import pool_collector
from epd_proxy.instances.models import Served
from epd_proxy.observe.metrics import _STAGE_BUCKETS, Buckets, ProxyMetrics, render
from epd_proxy.sim import SimConfig


def samples(text: bytes) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_bucket_bounds_are_inclusive():
    b = Buckets((0.001, 0.01))
    for v in (0.001, 0.0010001, 0.01, 5.0, 0.0):
        b.observe(v)
    assert b.cumulative() == [("0.001", 2), ("0.01", 4), ("+Inf", 5)]
    assert abs(b.sum - 5.0120001) < 1e-12


def test_histograms_match_prometheus_client():
    rng = random.Random(7)
    values = [rng.choice(_STAGE_BUCKETS) for _ in range(50)] + [rng.expovariate(20) for _ in range(500)] + [500.0]
    ref_registry = CollectorRegistry()
    ref = Histogram("epd_proxy_stage_duration_seconds", "x", ["stage"], buckets=_STAGE_BUCKETS,
                    registry=ref_registry)
    m = ProxyMetrics()
    for v in values:
        ref.labels("prefill").observe(v)
        m.observe_stages({"prefill": v})
    want = {k: v for k, v in samples(generate_latest(ref_registry)).items() if not k[0].endswith("_created")}
    got = {k: v for k, v in samples(m.render()).items() if k[0].startswith("epd_proxy_stage_duration")}
    assert want.keys() == got.keys()
    for k in want:
        assert abs(want[k] - got[k]) < 1e-9, k


def test_exposition_has_every_family():
    # What the collector reads from a pool, at scrape time.
    inst = SimpleNamespace(url="http://127.0.0.1:9", healthy=True, inflight=2, requests=9,
                           health=SimpleNamespace(ejections=4, errors={"connect": 3, "http_503": 2}),
                           signals=SimpleNamespace(others=3.0),
                           served=Served({"base": None, "alias": None, "sql": "base", "chat": "base"}))
    pool = SimpleNamespace(instances=[inst], panics=6, outliers=SimpleNamespace(local_errors=7),
                           policy=SimpleNamespace(spills=8), wedged_routing={"prefill_alone": 5, "refused": 1})
    m = ProxyMetrics()
    m.register(pool_collector({"decode": pool}, worker=0))
    m.observe_request("/v1/chat/completions", 200, 0.3)
    m.observe_request("/v1/chat/completions", 200, 0.2)
    m.observe_request("/v1/completions", 499, 0.01)
    m.retries += 2
    m.stream_errors += 1
    m.disconnects += 3
    m.inflight += 4
    m.inflight -= 1
    s = samples(m.render())
    chat = ("endpoint", "/v1/chat/completions")
    assert s[("epd_proxy_requests_total", (chat, ("status", "200")))] == 2
    assert s[("epd_proxy_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))] == 1
    ok = (chat, ("status_class", "2xx"), ("stream", "false"))
    assert s[("epd_proxy_request_duration_seconds_count", ok)] == 2
    assert abs(s[("epd_proxy_request_duration_seconds_sum", ok)] - 0.5) < 1e-12
    assert s[("epd_proxy_request_duration_seconds_bucket", (chat, ("le", "0.25")) + ok[1:])] == 1
    assert s[("epd_proxy_retries_total", ())] == 2
    assert s[("epd_proxy_stream_errors_total", ())] == 1
    assert s[("epd_proxy_client_disconnects_total", ())] == 3
    assert s[("epd_proxy_inflight_requests", ())] == 3
    inst = (("role", "decode"), ("url", "http://127.0.0.1:9"))
    assert s[("epd_proxy_instance_healthy", inst + (("worker", "0"),))] == 1
    assert s[("epd_proxy_instance_inflight", inst)] == 2
    assert s[("epd_proxy_instance_requests_total", inst)] == 9
    assert s[("epd_proxy_instance_failures_total", (("kind", "connect"),) + inst)] == 3
    assert s[("epd_proxy_instance_failures_total", (("kind", "http_503"),) + inst)] == 2
    assert s[("epd_proxy_instance_ejections_total", inst)] == 4
    assert s[("epd_proxy_panic_routing_total", (("role", "decode"),))] == 6
    assert s[("epd_proxy_routing_spills_total", (("role", "decode"),))] == 8
    assert s[("epd_proxy_instance_other_requests", inst + (("worker", "0"),))] == 3
    assert s[("epd_proxy_local_errors_total", (("role", "decode"),))] == 7
    assert s[("epd_proxy_wedged_routing_total", (("outcome", "prefill_alone"), ("role", "decode")))] == 5
    assert s[("epd_proxy_wedged_routing_total", (("outcome", "refused"), ("role", "decode")))] == 1
    assert s[("epd_proxy_instance_model_info", (("model", "alias"),) + inst)] == 1
    assert s[("epd_proxy_instance_model_info", (("model", "base"),) + inst)] == 1
    assert s[("epd_proxy_instance_adapters", inst)] == 2
    assert not any(name == "epd_proxy_instance_model_info" and ("model", "sql") in labels for name, labels in s)


# -- a live scrape, checked by Prometheus' own linter ------------------------------------------------

PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package 'prometheus'; "
                                             "make test installs it when run as root)")
async def test_promtool_accepts_a_live_scrape():
    async with stack(encode=1, max_inflight=4) as (cluster, proxy, client):
        assert (await client.chat(chat_body(stream=True, images=["https://example.com/a.png"]))).status == 200
        assert (await client.chat(chat_body())).status == 200
        assert (await client.post("/v1/chat/completions", b"{nope")).status == 400
        text = (await client.request("GET", "/metrics")).body
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr
    s = samples(text)
    assert s[("epd_proxy_time_to_first_token_seconds_count", (("endpoint", "/v1/chat/completions"),))] == 1
    assert s[("epd_proxy_inter_token_seconds_count", ())] == 1
    assert s[("epd_proxy_overhead_seconds_count", ())] == 2
    assert s[("epd_proxy_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "400")))] == 1
    assert any(k[0] == "process_cpu_seconds_total" for k in s)
    assert any(k[0] == "python_gc_collections_total" for k in s)


async def test_each_encoder_sub_request_and_the_push_hand_off_are_stages():
    async with stack(encode=2, encode_policy="round-robin") as (cluster, proxy, client):
        images = ["https://example.com/a.png", "https://example.com/b.png"]  # one per encoder
        assert (await client.chat(chat_body(images=images))).status == 200
        s = samples((await client.request("GET", "/metrics")).body)
    assert s[("epd_proxy_stage_duration_seconds_count", (("stage", "encode_request"),))] == 2
    assert s[("epd_proxy_stage_duration_seconds_count", (("stage", "encode"),))] == 1
    # Push mode: both legs at once; when prefill answers first, decode's remaining wait is the hand-off.
    sim = SimConfig(itl_ms=0, ttft_ms=0.5, kv_connector="nixl-push", push_registration_timeout=2.0,
                    kv_abort_timeout=2.0, roles={"prefill": {"ttft_ms": 30.0}})
    async with stack(sim=sim, kv_connector="nixl-push") as (cluster, proxy, client):
        reply = await client.chat(chat_body(stream=True))
        assert reply.status == 200
        handed_off = b"kv_handoff;dur=" in reply.headers[b"server-timing"]
        s = samples((await client.request("GET", "/metrics")).body)
    assert s[("epd_proxy_overhead_seconds_count", ())] == 1
    assert s.get(("epd_proxy_stage_duration_seconds_count", (("stage", "kv_handoff"),)), 0) == int(handed_off)


async def test_a_retry_is_counted_against_the_instance_that_failed_the_attempt():
    async with stack(prefill=2, routing="round-robin") as (cluster, proxy, client):
        cluster.instances("prefill")[0].inject("status=503")  # once; the retry goes to the other
        for _ in range(2):  # round-robin: one of the two reaches it first
            assert (await client.chat(chat_body())).status == 200
        s = samples((await client.request("GET", "/metrics")).body)
        assert (await client.request("GET", "/nope")).status == 404
        s404 = samples((await client.request("GET", "/metrics")).body)
    failed = [i for i in proxy.app.pools["prefill"].instances if i.health.errors]
    assert len(failed) == 1
    assert s[("epd_proxy_instance_retries_total", (("role", "prefill"), ("url", failed[0].url)))] == 1
    assert s[("epd_proxy_retries_total", ())] == 1
    assert s404[("epd_proxy_requests_total", (("endpoint", "other"), ("status", "404")))] == 1


def test_token_counters_by_model_with_bounded_labels():
    m = ProxyMetrics(max_models=2)
    m.observe_tokens(m.model("a"), (10, 3, 4))
    m.observe_tokens(m.model("a"), (5, 2, None))
    m.observe_tokens(m.model(None), (1, 1, None))  # no model in the body
    m.observe_tokens(m.model("b"), (7, 7, 0))
    m.observe_tokens(m.model("c"), (1, 2, None))  # past the two labels: "other"
    m.observe_tokens(m.model("d"), (8, 0, None))
    s = samples(render([m.snapshot(), m.snapshot()]))  # two workers' numbers add up
    model = lambda name: (("model", name),)  # noqa: E731
    assert s[("epd_proxy_prompt_tokens_total", model("a"))] == 30
    assert s[("epd_proxy_completion_tokens_total", model("a"))] == 10
    assert s[("epd_proxy_cached_tokens_total", model("a"))] == 8
    assert s[("epd_proxy_prompt_tokens_total", model("-"))] == 2
    assert s[("epd_proxy_prompt_tokens_total", model("b"))] == 14
    assert s[("epd_proxy_prompt_tokens_total", model("other"))] == 18
    assert not any(labels == model("c") or labels == model("d") for _, labels in s)
    hist = (("kind", "prompt"), ("model", "a"))
    assert s[("epd_proxy_request_tokens_count", hist)] == 4
    assert s[("epd_proxy_request_tokens_sum", hist)] == 30
    assert s[("epd_proxy_request_tokens_bucket", (("kind", "prompt"), ("le", "8.0"), ("model", "a")))] == 2
    assert s[("epd_proxy_request_tokens_bucket", (("kind", "prompt"), ("le", "32.0"), ("model", "a")))] == 4


def test_model_labels_stay_bounded_whatever_is_named():
    m = ProxyMetrics(max_models=3)
    for i in range(10_000):
        series = m.model(f"adapter-{i}")
        m.observe_request("/v1/chat/completions", 200, 0.01, bool(i % 2), series)
    assert len(m.models) == 3 and m.model("adapter-9999").label == "other"
    assert m.model(7) is m.no_model and m.model(None) is m.no_model  # not a name: no label of its own
    s = samples(m.render())
    labels = {dict(labels)["model"] for name, labels in s if name.startswith("epd_proxy_model_")}
    assert labels == {"adapter-0", "adapter-1", "adapter-2", "other"}
    assert s[("epd_proxy_model_requests_total", (("model", "other"), ("status", "200")))] == 9997
    assert s[("epd_proxy_model_request_duration_seconds_count", (("model", "adapter-1"), ("stream", "true")))] == 1


def test_per_model_latency_families():
    m = ProxyMetrics()
    a = m.model("a")
    m.observe_commit("/v1/chat/completions", 0.2, 0.15, True, a)
    m.observe_gap(0.004, a)
    m.observe_commit("/v1/chat/completions", 0.3, 0.25, False, a)  # not a stream: no TTFT
    m.observe_request("/v1/chat/completions", 200, 0.5, True, a)
    m.observe_request("/v1/chat/completions", 503, 0.001, False, m.no_model)
    s = samples(m.render())
    assert s[("epd_proxy_model_time_to_first_token_seconds_count", (("model", "a"),))] == 1
    assert s[("epd_proxy_model_time_to_first_token_seconds_sum", (("model", "a"),))] == 0.2
    assert s[("epd_proxy_model_inter_token_seconds_count", (("model", "a"),))] == 1
    assert s[("epd_proxy_inter_token_seconds_count", ())] == 1  # the all-model family too
    assert s[("epd_proxy_model_requests_total", (("model", "-"), ("status", "503")))] == 1
    assert ("epd_proxy_model_time_to_first_token_seconds_count", (("model", "-"),)) not in s


async def test_a_live_scrape_counts_every_requests_tokens_by_model():
    """Streams whose client did not ask for usage count too."""
    async with stack(metrics_max_models=4) as (cluster, proxy, client):
        for body in (chat_body(max_tokens=3), chat_body(stream=True, max_tokens=5),
                     chat_body(stream=True, max_tokens=7, stream_options={"include_usage": True})):
            assert (await client.chat(body)).status == 200
        prompt = (await client.chat(chat_body(max_tokens=1))).json()["usage"]["prompt_tokens"]
        s = samples((await client.request("GET", "/metrics")).body)
    model = (("model", "sim-model"),)
    assert s[("epd_proxy_completion_tokens_total", model)] == 3 + 5 + 7 + 1
    assert s[("epd_proxy_prompt_tokens_total", model)] == 4 * prompt
    assert s[("epd_proxy_request_tokens_count", (("kind", "completion"),) + model)] == 4
