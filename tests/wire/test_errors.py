"""ProxyError, the one error currency: its envelope, its in-band SSE form and its statuses."""

import msgspec
import pytest

from epd_proxy.wire.errors import ProxyError, bad_request, error_type_for


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
