"""ProxyError, the one error currency: its envelope, its in-band SSE form and its statuses."""

import msgspec
import pytest

from epd_proxy.wire.errors import (
    ProxyError,
    anthropic_type_for,
    as_anthropic,
    bad_request,
    error_body,
    error_type_for,
)


def test_the_envelope_has_exactly_the_openai_fields():
    err = ProxyError(502, "prefill instance unreachable", param="model", code="upstream")
    assert msgspec.json.decode(err.body()) == {"error": {
        "message": "prefill instance unreachable", "type": "BadGatewayError", "param": "model",
        "code": "upstream"}}
    assert err.content_type() == b"application/json"


def test_code_defaults_to_the_status_and_param_to_null():
    doc = msgspec.json.decode(ProxyError(404, "no route for GET /x").body())
    assert doc["error"]["code"] == 404
    assert doc["error"]["param"] is None
    assert doc["error"]["type"] == "NotFoundError"


@pytest.mark.parametrize("status, name", [
    (400, "BadRequestError"), (401, "AuthenticationError"), (404, "NotFoundError"),
    (405, "MethodNotAllowedError"), (413, "RequestEntityTooLargeError"), (429, "RateLimitError"),
    (500, "InternalServerError"), (502, "BadGatewayError"), (503, "ServiceUnavailableError"),
    (504, "GatewayTimeoutError"),
])
def test_known_statuses_have_their_type(status, name):
    assert error_type_for(status) == name
    assert ProxyError(status, "x").type == name


def test_other_statuses_fall_back_by_class():
    assert error_type_for(418) == "BadRequestError"
    assert error_type_for(451) == "BadRequestError"
    assert error_type_for(507) == "InternalServerError"


def test_an_explicit_type_wins():
    assert ProxyError(400, "x", type="invalid_request_error").type == "invalid_request_error"


def test_the_sse_form_is_one_error_event_then_done():
    err = ProxyError(502, "decode stream broke off")
    event = err.sse_event()
    events = event.split(b"\n\n")
    assert events[-1] == b""  # the stream ends on an event boundary
    assert events[1] == b"data: [DONE]"
    assert events[0].startswith(b"data: ")
    assert msgspec.json.decode(events[0][len(b"data: "):]) == err.envelope()
    assert len(events) == 3


def test_an_upstream_body_is_relayed_as_received():
    raw = b'{"object":"error","message":"too long","type":"BadRequestError","param":null,"code":400}'
    err = ProxyError(400, "too long", upstream_body=raw, upstream_content_type=b"application/json; charset=utf-8")
    assert err.body() is raw
    assert err.content_type() == b"application/json; charset=utf-8"
    # Its in-band form is still the proxy's envelope: a committed stream needs one event shape.
    assert msgspec.json.decode(err.sse_event().split(b"\n\n")[0][6:])["error"]["message"] == "too long"


def test_an_upstream_body_without_a_content_type_is_json():
    assert ProxyError(400, "x", upstream_body=b"{}").content_type() == b"application/json"


def test_not_retryable_unless_said_so():
    assert ProxyError(502, "x").retryable is False
    assert ProxyError(502, "x", retryable=True).retryable is True


def test_bad_request_names_the_param():
    err = bad_request("messages must be a list", "messages")
    assert (err.status, err.param, err.message) == (400, "messages", "messages must be a list")
    assert str(err) == "messages must be a list"


# -- Anthropic's envelope (the /v1/messages family's clients) ---------------------------------

@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (408, "invalid_request_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (431, "invalid_request_error"),
    (500, "api_error"), (502, "api_error"), (503, "overloaded_error"), (504, "api_error"),
    (529, "overloaded_error"),
])
def test_anthropic_types_follow_anthropics_status_table(status, kind):
    assert anthropic_type_for(status) == kind
    doc = msgspec.json.decode(ProxyError(status, "said").body(anthropic=True))
    assert doc == {"type": "error", "error": {"type": kind, "message": "said"}}


def test_the_anthropic_in_band_form_is_one_error_event_and_no_done():
    event = ProxyError(503, "the proxy shut down").anthropic_event()
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n") and event.count(b"\n\n") == 1
    assert msgspec.json.decode(event[len(b"event: error\ndata: "):]) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "the proxy shut down"}}


def test_an_anthropic_upstream_body_is_relayed_as_received_to_anthropic_clients():
    raw = b'{"type":"error","error":{"type":"not_found_error","message":"The model `x` does not exist."}}'
    err = ProxyError(404, "x", upstream_body=raw)
    assert err.body(anthropic=True) is raw and err.body() is raw


def test_vllms_own_type_names_in_anthropics_envelope_are_retyped_by_status():
    # vLLM 0.32's Messages handler: Anthropic's envelope, its ErrorResponse's type names.
    raw = b'{"type":"error","error":{"type":"NotFoundError","message":"The model `x` does not exist."}}'
    assert msgspec.json.decode(ProxyError(404, "x", upstream_body=raw).body(anthropic=True)) == {
        "type": "error", "error": {"type": "not_found_error", "message": "The model `x` does not exist."}}


@pytest.mark.parametrize("raw", [
    # vLLM's request-schema handler: OpenAI's envelope on every route, /v1/messages included.
    b'{"error":{"message":"Field required","type":"Bad Request","param":null,"code":400}}',
    b'{"object":"error","message":"Field required","type":"BadRequestError","param":null,"code":400}',
])
def test_an_openai_shaped_upstream_body_is_translated_for_anthropic_clients(raw):
    err = ProxyError(400, "Field required", upstream_body=raw)
    assert err.body() is raw  # OpenAI's clients: as received
    assert msgspec.json.decode(err.body(anthropic=True)) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "Field required"}}
    assert as_anthropic(413, raw).find(b'"request_too_large"') > 0


@pytest.mark.parametrize("raw", [b"not json", b"[1,2]", b'{"detail":"Not Found"}', b""])
def test_an_unknown_upstream_body_stays_as_received(raw):
    assert as_anthropic(404, raw) is raw


def test_the_front_door_body_in_either_envelope():
    assert msgspec.json.decode(error_body(413, "too big"))["error"]["type"] == "RequestEntityTooLargeError"
    assert msgspec.json.decode(error_body(413, "too big", anthropic=True)) == {
        "type": "error", "error": {"type": "request_too_large", "message": "too big"}}
