"""request/apis.py's error forms, pure: which envelope a path's clients read, and the in-band
error of a committed stream in each API's own form."""

import msgspec
import pytest

from epd_proxy.request.apis import (
    GENERATE,
    GENERATION_APIS,
    MESSAGES,
    RESPONSES,
    GenerationApi,
    created_response,
    front_door_error_body,
    speaks_anthropic,
)
from epd_proxy.wire.errors import ProxyError


@pytest.mark.parametrize("path, anthropic", [
    ("/v1/messages", True), ("/v1/messages/count_tokens", True), ("/v1/messages/batches", True),
    ("/v1/messagesx", False), ("/v1/chat/completions", False), ("/v1/completions", False),
    ("/v1/responses", False), ("/inference/v1/generate", False), ("/tokenize", False), ("", False),
])
def test_the_messages_family_speaks_anthropic(path, anthropic):
    assert speaks_anthropic(path) is anthropic
    doc = msgspec.json.decode(front_door_error_body(413, "too big", path))
    assert (doc.get("type") == "error") is anthropic
    assert (doc["error"]["type"] == "request_too_large") is anthropic


def sse(body: bytes) -> list[tuple[str | None, dict | bytes]]:
    out: list[tuple[str | None, dict | bytes]] = []
    for event in body.split(b"\n\n"):
        if not event:
            continue
        name = None
        if event.startswith(b"event: "):
            head, _, event = event.partition(b"\n")
            name = head[7:].decode()
        data = event[len(b"data: "):]
        out.append((name, data if data == b"[DONE]" else msgspec.json.decode(data)))
    return out


def test_messages_in_band_error_is_anthropics_error_event():
    err = ProxyError(502, "decode stream broke off")
    events = sse(GENERATION_APIS[MESSAGES].in_band_error(err, b"event: content_block_delta\ndata: {}\n\n"))
    assert events == [("error", {"type": "error", "error": {"type": "api_error",
                                                             "message": "decode stream broke off"}})]


CREATED = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m", "status": "in_progress",
           "output": [], "error": None}
HEAD = (b"event: response.created\ndata: " + msgspec.json.encode(
    {"type": "response.created", "sequence_number": 0, "response": CREATED}) + b"\n\n"
        b'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1}\n\n')


def test_responses_in_band_error_is_an_error_event_then_response_failed():
    last = b'event: response.output_text.delta\ndata: {"delta":"x","sequence_number":7}\n\n'
    events = sse(GENERATION_APIS[RESPONSES].in_band_error(ProxyError(502, "broke off"), last, HEAD))
    assert events[0] == ("error", {"type": "error", "code": "server_error", "message": "broke off", "param": None,
                                   "sequence_number": 8})
    name, failed = events[1]
    assert name == "response.failed" and failed["type"] == "response.failed" and failed["sequence_number"] == 9
    assert failed["response"] == dict(CREATED, status="failed", incomplete_details=None,
                                      error={"code": "server_error", "message": "broke off"})
    assert len(events) == 2


def test_responses_in_band_error_without_the_created_event_is_the_error_event_alone():
    events = sse(GENERATION_APIS[RESPONSES].in_band_error(ProxyError(503, "shut down"), b"", b""))
    assert [name for name, _ in events] == ["error"] and events[0][1]["sequence_number"] == 0
    assert created_response(b"event: response.created\ndata: {not json\n\n") is None


@pytest.mark.parametrize("api", [GenerationApi(), GENERATION_APIS[GENERATE]])
def test_chat_completions_and_generate_end_with_the_envelope_then_done(api):
    events = sse(api.in_band_error(ProxyError(504, "stalled"), b""))
    assert events == [(None, {"error": {"message": "stalled", "type": "GatewayTimeoutError", "param": None,
                                        "code": 504}}), (None, b"[DONE]")]


def test_decodes_own_messages_error_is_retyped_and_nothing_else_changes():
    api = GENERATION_APIS[MESSAGES]
    event = b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"boom"}}\n\n'
    assert event.find(api.foreign_error) >= 0
    assert sse(api.own_error_event(event)) == [("error", {"type": "error",
                                                          "error": {"type": "api_error", "message": "boom"}})]
    # A model's text spelling it is escaped in its JSON string: never matched.
    delta = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":'
             b'{"type":"text_delta","text":"\\"type\\":\\"internal_error\\""}}\n\n')
    assert delta.find(api.foreign_error) < 0
    assert not GENERATION_APIS[RESPONSES].foreign_error and not GENERATION_APIS[GENERATE].foreign_error
