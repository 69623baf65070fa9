"""StreamRelay's framing rules, as a unit (the socket path is covered in test_pipeline)."""

from epd_proxy.request.relay import StreamRelay
from epd_proxy.wire.errors import ProxyError


class Writer:
    def __init__(self):
        self.out = []
        self.ended = False

    def write(self, data):
        self.out.append(data)

    def end(self, data=b""):
        if data:
            self.out.append(data)
        self.ended = True


class Resp:
    paused = False

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False


def test_whole_events_pass_through_as_received():
    w = Writer()
    r = StreamRelay(w, Resp())
    r.on_data(b"data: 1\n\ndata: 2\n\n")
    assert w.out == [b"data: 1\n\ndata: 2\n\n"]


def test_partial_event_is_held_until_its_end_and_bytes_are_unchanged():
    w = Writer()
    r = StreamRelay(w, Resp())
    event = "data: {\"t\": \"你好🚀\"}\n\n".encode()
    r.on_data(b"data: 0\n\n" + event[:12])  # split inside a multibyte character
    assert w.out == [b"data: 0\n\n"]
    r.on_data(event[12:])
    r.on_end()
    assert b"".join(w.out) == b"data: 0\n\n" + event
    assert w.ended


def test_failure_drops_the_partial_event_and_ends_in_band():
    w = Writer()
    r = StreamRelay(w, Resp())
    r.on_data(b"data: 0\n\ndata: {\"cut")
    r.on_error(ConnectionResetError("reset"))
    body = b"".join(w.out)
    assert body.startswith(b"data: 0\n\ndata: {\"error\": {") or body.startswith(b"data: 0\n\ndata: {\"error\":{")
    assert body.endswith(b"data: [DONE]\n\n")
    assert b"cut" not in body
    assert w.ended


def test_only_one_ending():
    w = Writer()
    r = StreamRelay(w, Resp())
    r.on_end()
    r.fail(ProxyError(502, "late"))
    assert w.out == []


def test_slow_client_pauses_the_upstream():
    resp = Resp()
    r = StreamRelay(Writer(), resp)
    r.pause()
    assert resp.paused
    r.resume()
    assert not resp.paused
