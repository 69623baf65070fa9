"""Optional OpenTelemetry tracing: a span per client request and one per stage leg.

On only when the OpenTelemetry SDK is installed (``pip install 'epd-proxy[otel]'``)
and the standard environment asks for it (``OTEL_TRACES_EXPORTER`` or an
``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``; ``OTEL_SDK_DISABLED=true`` wins;
``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and the
exporter's own variables are read by the SDK). Off, a request carries ``trace = None``
and each leg pays one ``is None`` test.

The W3C ``traceparent`` sent to an instance is its leg span's (the client's own,
if any, is the request span's parent), so vLLM's spans (``--otlp-traces-endpoint``)
join the trace under the leg that called them.
"""

from __future__ import annotations

import logging
import os

from epd_proxy.http import Headers

log = logging.getLogger("epd_proxy.tracing")

_TRACE_HEADERS = (b"traceparent", b"tracestate")


def from_environment():
    """A :class:`Tracing` configured by the ``OTEL_*`` variables, or None (off)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if exporter == "none" or not (exporter or endpoint):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    except ImportError:
        log.error("OTEL_* asks for traces but the OpenTelemetry SDK is not installed "
                  "(pip install 'epd-proxy[otel]'); tracing is off")
        return None
    span_exporter: SpanExporter
    if exporter == "console":
        span_exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.error("OTEL_* asks for OTLP traces but opentelemetry-exporter-otlp-proto-http is not "
                      "installed (pip install 'epd-proxy[otel]'); tracing is off")
            return None
        span_exporter = OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME",
                                                                                 "epd-proxy")}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    return Tracing(provider)


class Tracing:
    """Starts request traces from one tracer provider (the SDK's, or a test's)."""

    def __init__(self, provider) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("epd_proxy")
        self.propagator = TraceContextTextMapPropagator()
        self._trace = trace

    def start(self, method: str, path: str, request_id: str, client_headers: dict) -> "RequestTrace":
        carrier = {}
        for name in _TRACE_HEADERS:
            value = client_headers.get(name)
            if value is not None:
                carrier[name.decode()] = value.decode("latin-1")
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(f"{method} {path}", context=parent, kind=self._trace.SpanKind.SERVER,
                                      attributes={"http.request.method": method, "url.path": path,
                                                  "epd_proxy.request_id": request_id})
        return RequestTrace(self, span)

    def close(self) -> None:
        shutdown = getattr(self.provider, "shutdown", None)
        if shutdown is not None:
            shutdown()


class RequestTrace:
    """One client request's span and its legs' (a leg: from hold to release of an instance)."""

    __slots__ = ("tracing", "span", "_legs")

    def __init__(self, tracing: Tracing, span) -> None:
        self.tracing = tracing
        self.span = span
        self._legs: list = []  # [instance, span]

    def leg(self, inst, stage: str, headers: Headers) -> Headers:
        """Start the leg's span; ``headers`` with its ``traceparent`` instead of the client's."""
        t = self.tracing
        span = t.tracer.start_span(stage, context=t._trace.set_span_in_context(self.span),
                                   kind=t._trace.SpanKind.CLIENT,
                                   attributes={"epd_proxy.stage": stage, "epd_proxy.instance": inst.url})
        self._legs.append([inst, span])
        carrier: dict = {}
        t.propagator.inject(carrier, context=t._trace.set_span_in_context(span))
        out = [h for h in headers if h[0] not in _TRACE_HEADERS]
        out.extend((k.encode(), v.encode()) for k, v in carrier.items())
        return out

    def _span_of(self, inst):
        for entry in reversed(self._legs):
            if entry[0] is inst:
                return entry[1]
        return None

    def status(self, inst, status: int) -> None:
        span = self._span_of(inst)
        if span is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                span.set_status(self.tracing._trace.StatusCode.ERROR)

    def failed(self, inst, reason: str) -> None:
        span = self._span_of(inst)
        if span is not None:
            span.set_status(self.tracing._trace.StatusCode.ERROR, reason)

    def end(self, inst) -> None:
        for i, entry in enumerate(self._legs):
            if entry[0] is inst:
                del self._legs[i]
                entry[1].end()
                return

    def finish(self, status: int, stream: bool, tokens: tuple, outcome: str) -> None:
        """End the request span (and any leg still open)."""
        for inst, span in self._legs:  # decode's leg (the stream) is still open: it gets the counts too
            if inst.role == "decode":
                _tokens(span, tokens)
            span.end()
        self._legs.clear()
        span = self.span
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("epd_proxy.stream", stream)
        span.set_attribute("epd_proxy.outcome", outcome)
        _tokens(span, tokens)
        if status >= 500 or outcome != "ok":
            span.set_status(self.tracing._trace.StatusCode.ERROR, outcome)
        span.end()


def _tokens(span, tokens: tuple) -> None:
    if tokens[0] is not None:
        span.set_attribute("gen_ai.usage.input_tokens", tokens[0])
    if tokens[1] is not None:
        span.set_attribute("gen_ai.usage.output_tokens", tokens[1])
