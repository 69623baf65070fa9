"""Envoy's external processing protocol (``envoy.service.ext_proc.v3.ExternalProcessor``) as
the Gateway API inference extension's endpoint picker speaks it: one gRPC stream per HTTP
request, translated to an ``Ask`` for the picker (``picker.py``) and its answer back to
Envoy's messages. Nothing here decides.

The two body modes, told apart by the first message's ``protocol_config``:

- ``FULL_DUPLEX_STREAMED`` (what the inference extension configures): the request's headers
  are answered only after its whole body arrived, with the destination; the body then goes
  back as ``streamed_response`` pieces (rewritten if the picker changed it), and each answer
  chunk is echoed as it comes. Envoy sends the body upstream chunked.
- ``BUFFERED`` (Envoy fails open only in this mode): the headers are answered at once, empty;
  the destination, the route cache's clearing and a changed body (with its
  ``Content-Length``) ride on the body's answer.

The destination is the header ``x-gateway-destination-endpoint`` (overwriting a client's) and
the same value in the dynamic metadata ``envoy.lb``; the gateway's subset hint is read from
the filter metadata ``envoy.lb.subset_hint``; the endpoint that served from ``envoy.lb`` on
the answer's headers. A refusal is an ``ImmediateResponse`` with its status and body.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator, Iterable

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from epd_proxy.gateway.pick import endpoint
from epd_proxy.gateway.picker import Ask, EndpointPicker, Lease, Refusal, Routed

log = logging.getLogger("epd_proxy.epp")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
# llm-d's P/D convention: the serving decode's sidecar runs the prefill (and encoders) named here.
# Only the picker sets them: a client's are taken out of every request it places.
PREFILLER = "x-prefiller-host-port"
ENCODERS = "x-encoder-hosts-ports"
# llm-d's other two steering headers (its routing sidecar's data-parallel rank's and KV source's
# address): the picker never names them, and no client may, so they are taken out of every request.
STEERING = ("x-data-parallel-host-port", "x-kv-cache-source-host-port")
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
FILTER = "envoy.filters.http.ext_proc"  # the attributes' key
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# A rewritten body goes back in pieces no larger than this (gRPC's default message bound is 4 MiB).
PIECE = 1 << 20


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The gRPC service: one :class:`Exchange` per stream."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest], context
                      ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange(self.picker)
        try:
            async for message in request_iterator:
                for answer in await exchange.on(message):
                    yield answer
        finally:
            exchange.close()


class Exchange:
    """One HTTP request's messages, in order."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.streamed = False  # FULL_DUPLEX_STREAMED (else BUFFERED, or no body sent at all)
        self.method = "GET"
        self.target = b"/"
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.subset: frozenset[str] | None = None
        self.lease: Lease | None = None
        self.decided = False
        self.had_body = False  # a body message came (then Envoy waits for the body's answer)
        self.size = 0  # the body's bytes so far (bounded by --max-body-size)

    async def on(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if message.HasField("protocol_config"):
            self.streamed = message.protocol_config.request_body_mode == _FULL_DUPLEX
        if kind == "request_headers":
            return await self._request_headers(message)
        if kind == "request_body":
            if self.decided:  # refused already (too large): Envoy stops at the immediate answer
                return []
            piece = message.request_body.body
            self.body.append(piece)
            self.size += len(piece)
            self.had_body = True
            if self.size > self.picker.max_body:
                self.decided, self.body = True, []
                return [immediate(self.picker.too_large(self.target))]
            if not message.request_body.end_of_stream:
                return []
            return await self._decide()
        if kind == "request_trailers":
            answers = [] if self.decided else await self._decide(trailers=True)
            return answers + [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "response_trailers":
            self.close(complete=True)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def close(self, complete: bool = False) -> None:
        """The stream is over: the answer ``complete`` (its end seen), or the client gone, or Envoy
        reset it. Where the answer's body does not pass through (BUFFERED here), its end is not
        seen, and the answer counts as complete."""
        if self.lease is not None:
            lease, self.lease = self.lease, None
            self.picker.ended(lease, complete=complete or not self.streamed)

    # -- the request ---------------------------------------------------------------------------
    async def _request_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        for h in message.request_headers.headers.headers:
            name = h.key.lower().encode("latin-1")
            value = h.raw_value or h.value.encode("latin-1")
            if name == b":method":
                self.method = value.decode("latin-1")
            elif name == b":path":
                self.target = value
            elif name[:1] != b":":
                have = self.headers.get(name)
                self.headers[name] = value if have is None else have + b", " + value
        self.subset = subset_hint(message.metadata_context)
        if message.request_headers.end_of_stream:
            return await self._decide()
        if self.streamed:
            return []  # answered once the whole body is here
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    async def _decide(self, trailers: bool = False) -> list[pb.ProcessingResponse]:
        """``trailers``: the body ended with the request's trailers (its last piece then does not end it)."""
        self.decided = True
        body = b"".join(self.body)
        self.body = []
        try:
            decision = await self.picker.decide(Ask(self.method, self.target, self.headers, body, self.subset))
        except Exception:  # the picker's own bug: answered, never a failed stream (which may fail open)
            log.exception("the endpoint picker failed on %s", self.target[:200])
            return [immediate(self.picker.failed(self.target))]
        if isinstance(decision, Refusal):
            return [immediate(decision)]
        self.lease = decision.lease
        return routed(decision, body, self.streamed, headers_only=not self.had_body, trailers=trailers)

    # -- the answer ----------------------------------------------------------------------------
    def _response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        status = 0
        for h in message.response_headers.headers.headers:
            if h.key == ":status":
                value = h.raw_value or h.value.encode()
                status = int(value) if value.isdigit() else 0
                break
        if self.lease is not None:
            served = served_endpoint(message.metadata_context) or upstream_address(message.attributes)
            self.picker.served(self.lease, served, status)
        if message.response_headers.end_of_stream:
            self.close(complete=True)
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def _response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.lease is not None and body.body:
            self.picker.answered(self.lease, body.body)
        if body.end_of_stream:
            self.close(complete=True)
        if self.streamed:
            return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=body.body, end_of_stream=body.end_of_stream)))))]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]


def routed(decision: Routed, body: bytes, streamed: bool, *, headers_only: bool,
           trailers: bool = False) -> list[pb.ProcessingResponse]:
    """The destination (header and metadata, the route cache cleared) and the body as it goes on."""
    value = ",".join(decision.endpoints)
    new_body = decision.body
    sets = [_header(DESTINATION, value)]
    removes = list(STEERING)
    prefill, encoders = decision.pick.prefill, decision.pick.encoders
    if prefill is not None:
        sets.append(_header(PREFILLER, endpoint(prefill)))
    else:
        removes.append(PREFILLER)
    if encoders:
        sets.append(_header(ENCODERS, ",".join(endpoint(e) for e in encoders)))
    else:
        removes.append(ENCODERS)
    if new_body is not None:
        sets.append(_header("content-length", str(len(new_body))))
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets, remove_headers=removes),
                               clear_route_cache=True)
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: value}})
    if headers_only:
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)]
    if not streamed:  # BUFFERED: the headers were answered already
        if new_body is not None:
            common.body_mutation.body = new_body
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)]
    out = [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)]
    data = new_body if new_body is not None else body
    for at in range(0, max(len(data), 1), PIECE):
        piece = data[at:at + PIECE]
        out.append(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=piece, end_of_stream=not trailers and at + PIECE >= len(data)))))))
    return out


def immediate(refusal: Refusal) -> pb.ProcessingResponse:
    """The gateway answers the client itself: the refusal's status, headers and body."""
    headers = [_header("content-type", "application/json")]
    headers += [_header(n.decode("latin-1"), v.decode("latin-1")) for n, v in refusal.headers]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=refusal.status),
        headers=pb.HeaderMutation(set_headers=headers), body=refusal.body,
        details=f"epd_proxy_epp_{refusal.status}"))


def _header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name, raw_value=value.encode("latin-1")),
                                      append_action=_OVERWRITE)


def subset_hint(metadata) -> frozenset[str] | None:
    """The endpoints the gateway restricts the pick to (``envoy.lb.subset_hint``), None when it
    does not; a list of ``ip:port`` or one comma-separated string."""
    namespace = metadata.filter_metadata.get(SUBSET_NAMESPACE) if metadata is not None else None
    if namespace is None or SUBSET not in namespace.fields:
        return None
    value = namespace.fields[SUBSET]
    kind = value.WhichOneof("kind")
    items: Iterable[str] = ()
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        items = value.string_value.split(",")
    return frozenset(s.strip() for s in items if s.strip())


def served_endpoint(metadata) -> str | None:
    """The endpoint that served, as the gateway reports it on the answer (``envoy.lb``)."""
    namespace = metadata.filter_metadata.get(LB_NAMESPACE) if metadata is not None else None
    if namespace is None or SERVED not in namespace.fields:
        return None
    return namespace.fields[SERVED].string_value or None


def upstream_address(attributes) -> str | None:
    """The endpoint that served as the filter's ``response_attributes: [upstream.address]`` gives
    it, where the cluster reports no ``envoy.lb`` metadata (an ``ORIGINAL_DST`` cluster)."""
    ours = attributes.get(FILTER) if attributes is not None else None
    if ours is None or "upstream.address" not in ours.fields:
        return None
    return ours.fields["upstream.address"].string_value or None
