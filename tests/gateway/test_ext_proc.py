"""The external processing protocol's translation (gateway/ext_proc.py), message by message: what
Envoy's messages become for the picker and what its answers become for Envoy. The picker here is
a recorder standing in for ``EndpointPicker`` (no socket is involved); tests/gateway/
test_envoy_gateway.py runs the same code between a real Envoy and the real picker."""

from __future__ import annotations

import pytest

pb = pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402

from epd_proxy.gateway import ext_proc  # noqa: E402
from epd_proxy.gateway.pick import Pick  # noqa: E402
from epd_proxy.gateway.picker import Refusal, Routed  # noqa: E402

MODE = processing_mode_pb2.ProcessingMode


class _Endpoints(Pick):
    def __init__(self, endpoints: list[str]) -> None:
        super().__init__((), ())
        object.__setattr__(self, "_names", endpoints)

    @property
    def endpoints(self) -> list[str]:
        return self._names  # type: ignore[attr-defined]


class Recorder:
    """Answers every request with ``answer``; records what the adapter told it."""

    max_body = 64

    def __init__(self, answer) -> None:
        self.answer = answer
        self.asks: list = []
        self.served_calls: list = []
        self.chunks: list[bytes] = []
        self.ends = 0

    async def decide(self, ask):
        self.asks.append(ask)
        return self.answer

    def served(self, lease, address, status):
        self.served_calls.append((address, status))

    def answered(self, lease, chunk):
        self.chunks.append(chunk)

    def ended(self, lease, complete=True):
        self.ends += 1
        self.complete = complete

    def too_large(self, target):
        return Refusal(413, b'{"error":{"message":"too large"}}', [])

    def failed(self, target):
        return Refusal(500, b'{"error":{"message":"failed"}}', [])


def _routed(endpoints=("10.0.0.1:8000", "10.0.0.2:8000"), body: bytes | None = None) -> Routed:
    return Routed(object(), _Endpoints(list(endpoints)), body)  # type: ignore[arg-type]


def _headers(eos: bool, mode: int | None, subset=None, extra=()) -> pb.ProcessingRequest:
    hs = [base_pb2.HeaderValue(key=k, raw_value=v) for k, v in
          [(":method", b"POST"), (":path", b"/v1/chat/completions"), ("content-type", b"application/json"),
           *extra]]
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs),
                                                              end_of_stream=eos))
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({ext_proc.SUBSET: subset})
        msg.metadata_context.filter_metadata[ext_proc.SUBSET_NAMESPACE].CopyFrom(hint)
    return msg


def _body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def _mutation(common) -> dict[str, tuple[bytes, int]]:
    return {h.header.key: (h.header.raw_value, h.append_action) for h in common.header_mutation.set_headers}


async def test_streamed_the_headers_wait_for_the_whole_body_then_destination_and_body_go_back():
    picker = Recorder(_routed())
    x = ext_proc.Exchange(picker)  # type: ignore[arg-type]
    assert await x.on(_headers(False, MODE.FULL_DUPLEX_STREAMED, extra=[("x-api-key", b"k")])) == []
    assert await x.on(_body(b'{"model":', False)) == []
    answers = await x.on(_body(b'"m"}', True))
    ask = picker.asks[0]
    assert (ask.method, ask.target, ask.body, ask.subset) == ("POST", b"/v1/chat/completions", b'{"model":"m"}', None)
    assert ask.headers[b"x-api-key"] == b"k" and b":path" not in ask.headers
    head, body = answers
    common = head.request_headers.response
    assert _mutation(common) == {ext_proc.DESTINATION: (b"10.0.0.1:8000,10.0.0.2:8000", ext_proc._OVERWRITE)}
    assert common.clear_route_cache
    lb = head.dynamic_metadata.fields[ext_proc.LB_NAMESPACE].struct_value
    assert lb.fields[ext_proc.DESTINATION].string_value == "10.0.0.1:8000,10.0.0.2:8000"
    streamed = body.request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b'{"model":"m"}', True)


async def test_streamed_a_rewritten_body_goes_back_in_pieces_with_its_length():
    big = b"x" * (ext_proc.PIECE + 10)
    x = ext_proc.Exchange(Recorder(_routed(body=big)))  # type: ignore[arg-type]
    await x.on(_headers(False, MODE.FULL_DUPLEX_STREAMED))
    head, first, last = await x.on(_body(b"{}", True))
    assert _mutation(head.request_headers.response)["content-length"][0] == str(len(big)).encode()
    pieces = [m.request_body.response.body_mutation.streamed_response for m in (first, last)]
    assert b"".join(p.body for p in pieces) == big and [p.end_of_stream for p in pieces] == [False, True]


async def test_buffered_the_headers_pass_at_once_and_the_body_answer_carries_the_destination():
    x = ext_proc.Exchange(Recorder(_routed(body=b'{"model":"served"}')))  # type: ignore[arg-type]
    [head] = await x.on(_headers(False, MODE.BUFFERED))
    assert head.WhichOneof("response") == "request_headers" and not head.request_headers.HasField("response")
    [answer] = await x.on(_body(b'{"model":"alias"}', True))
    common = answer.request_body.response
    assert common.body_mutation.body == b'{"model":"served"}' and common.clear_route_cache
    assert _mutation(common)["content-length"][0] == b"18"
    assert ext_proc.LB_NAMESPACE in answer.dynamic_metadata.fields


async def test_a_request_without_a_body_is_answered_on_its_headers():
    x = ext_proc.Exchange(Recorder(_routed(["10.0.0.1:8000"])))  # type: ignore[arg-type]
    [head] = await x.on(_headers(True, MODE.FULL_DUPLEX_STREAMED))
    assert _mutation(head.request_headers.response)[ext_proc.DESTINATION][0] == b"10.0.0.1:8000"


async def test_a_refusal_is_an_immediate_response_with_its_status_headers_and_body():
    refusal = Refusal(429, b'{"error":{}}', [(b"retry-after", b"1")])
    x = ext_proc.Exchange(Recorder(refusal))  # type: ignore[arg-type]
    await x.on(_headers(False, MODE.BUFFERED))
    [answer] = await x.on(_body(b"{}", True))
    immediate = answer.immediate_response
    assert (immediate.status.code, immediate.body) == (429, b'{"error":{}}')
    assert {h.header.key: h.header.raw_value for h in immediate.headers.set_headers} == {
        "content-type": b"application/json", "retry-after": b"1"}


@pytest.mark.parametrize("value, want", [(["10.0.0.1:8000", "10.0.0.2:8000"], {"10.0.0.1:8000", "10.0.0.2:8000"}),
                                         ("10.0.0.1:8000, 10.0.0.2:8000", {"10.0.0.1:8000", "10.0.0.2:8000"}),
                                         ([], set())])
async def test_the_subset_hint_is_read_as_a_list_or_a_comma_string(value, want):
    picker = Recorder(_routed())
    x = ext_proc.Exchange(picker)  # type: ignore[arg-type]
    await x.on(_headers(True, None, subset=value))
    assert picker.asks[0].subset == frozenset(want)


async def test_the_answer_is_reported_echoed_when_streamed_and_the_lease_ended_once():
    picker = Recorder(_routed())
    x = ext_proc.Exchange(picker)  # type: ignore[arg-type]
    await x.on(_headers(True, MODE.FULL_DUPLEX_STREAMED))
    served = struct_pb2.Struct()
    served.update({ext_proc.SERVED: "10.0.0.2:8000"})
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])))
    msg.metadata_context.filter_metadata[ext_proc.LB_NAMESPACE].CopyFrom(served)
    [head] = await x.on(msg)
    assert head.WhichOneof("response") == "response_headers"
    assert picker.served_calls == [("10.0.0.2:8000", 200)]
    [echo] = await x.on(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n", end_of_stream=False)))
    assert echo.response_body.response.body_mutation.streamed_response.body == b"data: 1\n\n"
    await x.on(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
    x.close()
    assert picker.chunks == [b"data: 1\n\n"] and picker.ends == 1 and picker.complete


async def test_a_body_past_the_limit_is_refused_before_it_is_all_held():
    picker = Recorder(_routed())
    x = ext_proc.Exchange(picker)  # type: ignore[arg-type]
    await x.on(_headers(False, MODE.FULL_DUPLEX_STREAMED))
    assert await x.on(_body(b"x" * 60, False)) == []
    [refused] = await x.on(_body(b"x" * 10, False))
    assert refused.immediate_response.status.code == 413
    assert await x.on(_body(b"x", True)) == [] and picker.asks == []


async def test_the_pickers_own_failure_is_answered_not_a_failed_stream():
    class Broken(Recorder):
        async def decide(self, ask):
            raise RuntimeError("a bug")

    x = ext_proc.Exchange(Broken(None))  # type: ignore[arg-type]
    await x.on(_headers(False, MODE.BUFFERED))
    [answer] = await x.on(_body(b"{}", True))
    assert answer.immediate_response.status.code == 500


async def test_a_clients_sidecar_headers_are_taken_out_of_every_placed_request():
    x = ext_proc.Exchange(Recorder(_routed()))  # type: ignore[arg-type]
    [head] = await x.on(_headers(True, MODE.FULL_DUPLEX_STREAMED, extra=[("x-prefiller-host-port", b"10.9.9.9:1")]))
    mutation = head.request_headers.response.header_mutation
    assert set(mutation.remove_headers) == {ext_proc.PREFILLER, ext_proc.ENCODERS, "x-data-parallel-host-port",
                                            "x-kv-cache-source-host-port"}


async def test_without_lb_metadata_the_upstream_address_attribute_names_the_served_endpoint():
    picker = Recorder(_routed())
    x = ext_proc.Exchange(picker)  # type: ignore[arg-type]
    await x.on(_headers(True, MODE.FULL_DUPLEX_STREAMED))
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"503")])))
    attrs = struct_pb2.Struct()
    attrs.update({"upstream.address": "10.0.0.1:8000"})
    msg.attributes[ext_proc.FILTER].CopyFrom(attrs)
    await x.on(msg)
    assert picker.served_calls == [("10.0.0.1:8000", 503)]


async def test_a_body_ended_by_trailers_goes_back_open_then_the_trailers_pass():
    x = ext_proc.Exchange(Recorder(_routed()))  # type: ignore[arg-type]
    await x.on(_headers(False, MODE.FULL_DUPLEX_STREAMED))
    assert await x.on(_body(b"{}", False)) == []
    head, body, trailers = await x.on(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert head.WhichOneof("response") == "request_headers"
    streamed = body.request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b"{}", False)
    assert trailers.WhichOneof("response") == "request_trailers"
