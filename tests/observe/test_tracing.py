"""OpenTelemetry tracing (tracing.py): a span per request and per stage leg, and the
traceparent each backend received is its leg span's. Uses the SDK's in-memory exporter."""

import pytest
from helpers import chat_body, stack

otel = pytest.importorskip("opentelemetry.sdk.trace", reason="the OpenTelemetry SDK is not installed "
                                                              "(pip install 'epd-proxy[otel]')")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from epd_proxy.observe import tracing  # noqa: E402

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


def _tracing():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracing.Tracing(provider), exporter


def _traceparent(span) -> str:
    c = span.context
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-01"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_span_per_leg_and_the_backend_gets_its_traceparent(stream):
    # round-robin: the two images go one to each encoder (by uuid affinity both may share one)
    async with stack(encode=2, encode_policy="round-robin") as (cluster, proxy, client):
        proxy.app.pipeline.tracing, exporter = _tracing()
        images = ["https://example.com/a.png", "https://example.com/b.png"]  # one per encoder
        body = chat_body(images=images, stream=stream, stream_options={"include_usage": True} if stream else None)
        reply = await client.chat(body, [(b"traceparent", f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01".encode())])
        assert reply.status == 200
    spans = exporter.get_finished_spans()
    root = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(root) == 1
    root = root[0]
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE and f"{root.parent.span_id:016x}" == CLIENT_PARENT
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["epd_proxy.outcome"] == "ok"
    legs = sorted((s for s in spans if s.kind == SpanKind.CLIENT), key=lambda s: s.name)
    assert [s.name for s in legs] == ["decode", "encode", "encode", "prefill"]
    for leg in legs:
        assert leg.parent.span_id == root.context.span_id
        assert leg.attributes["http.response.status_code"] == 200
        assert leg.end_time <= root.end_time
    # Each backend received its own leg's traceparent (not the client's).
    received = {r.headers.get("traceparent") for r in cluster.records()}
    assert received == {_traceparent(s) for s in legs}
    by_url = {s.attributes["epd_proxy.instance"] for s in legs}
    assert by_url == set(cluster.urls("encode") + cluster.urls("prefill") + cluster.urls("decode"))
    decode = legs[0]
    usage = root.attributes
    assert usage["gen_ai.usage.output_tokens"] == 8 and usage["gen_ai.usage.input_tokens"] > 0
    assert decode.attributes["gen_ai.usage.output_tokens"] == 8


async def test_off_unless_the_environment_asks(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.from_environment() is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    on = tracing.from_environment()
    assert on is not None
    on.close()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.from_environment() is None
    async with stack() as (cluster, proxy, client):
        assert proxy.app.pipeline.tracing is None
        assert (await client.chat(chat_body())).status == 200
