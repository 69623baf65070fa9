"""Raw HTTP fuzzing of the proxy in front of a simulated cluster (real loopback sockets).

Malformed request lines, chunked framing, CL+TE, huge headers and trailers, pipelining
and Upgrade. Whatever arrives, the proxy answers no 5xx, never hangs (every connection
ends within a bound: the test shortens the header, body and keep-alive timeouts),
answers every 4xx with the OpenAI envelope, forwards no request the client did not
get an answer for (no smuggling), and serves a normal request after each case.

The proxy runs on its own event loop in a thread; each case is one connection driven
from the test's thread with the strict reader of ``httpkit``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
from helpers import stack  # noqa: E402
from httpkit import Incomplete, read_response, read_to_eof  # noqa: E402

CHAT = b'{"model":"sim-model","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}'
NORMAL = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\n\r\n%b" % (len(CHAT), CHAT))
NORMAL_CLOSE = NORMAL.replace(b"Host: t\r\n", b"Host: t\r\nConnection: close\r\n")
WAIT = 5.0  # no case may keep its connection longer than this


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def proxy():
    """A simulated P/D cluster and the proxy, on an event loop in another thread."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}

    async def main():
        async with stack(header_timeout=0.15, body_timeout=0.15, max_body_size=256 * 1024) as (cluster, p, _):
            p.server.limits.keep_alive_timeout = 0.05
            p.server.limits.max_header_bytes = 8 * 1024
            state.update(cluster=cluster, port=p.server.port, stop=asyncio.Event())
            ready.set()
            await state["stop"].wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    errors = _Errors()
    logging.getLogger("epd_proxy").addHandler(errors)
    thread.start()
    assert ready.wait(10)
    state["errors"] = errors
    yield state
    loop.call_soon_threadsafe(state["stop"].set)
    thread.join(10)
    logging.getLogger("epd_proxy").removeHandler(errors)
    assert not errors.records, [r.getMessage() for r in errors.records]


# -- strategies ----------------------------------------------------------------------------------
def mostly(usual, *odd):
    """``usual`` most of the time, else one of ``odd``: most cases stay close to a valid
    request, so the fuzzing reaches past the request line."""
    # (hypothesis favours the ends of a range: the odd values sit in its middle)
    return st.integers(0, 19).flatmap(lambda i: st.sampled_from(odd) if i in (6, 13) else st.just(usual))


METHODS = mostly(b"POST", b"GET", b"PUT", b"DELETE", b"OPTIONS", b"CONNECT", b"PRI", b"get", b"G\x00T", b"")
TARGETS = mostly(b"/v1/chat/completions", b"/v1/completions", b"/health", b"/v1/models", b"/ready", b"*",
                 b"http://x/v1/chat/completions", b"/%00", b"/\xff", b"", b"/" + b"a" * 9000)
VERSIONS = mostly(b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.2", b"HTTP/11", b"http/1.1",
                  b"HTTP/1.1 ", b"")
SEPS = mostly(b" ", b"  ", b"\t", b"")
EOLS = mostly(b"\r\n", b"\n", b"\r", b"\r\r\n")
NAMES = st.sampled_from([b"Host", b"Content-Length", b"Transfer-Encoding", b"Connection", b"Upgrade", b"Expect",
                         b"X-Request-Id", b"Content-Type", b"Traceparent", b"Host ", b" Host", b"X", b""])
VALUES = st.one_of(
    st.sampled_from([b"t", b"0", b"5", b"-1", b"99999999999999999999", b"chunked", b"chunked, identity",
                     b" chunked", b"gzip, chunked", b"close", b"keep-alive", b"Upgrade", b"h2c", b"websocket",
                     b"100-continue", b"application/json", b"a\x00b", b"\xff\xfe", b"x" * 9000]),
    st.binary(max_size=24))
HEADERS = st.integers(0, 4).flatmap(lambda n: st.lists(st.tuples(NAMES, VALUES), max_size=3) if n == 2 else st.just([]))
CHUNK_SIZES = st.sampled_from([b"zz", b"-1", b"fffffffffffffffffff", b"0x5", b"5 ", b"5;ext=1", b" 5", b""])
KINDS = mostly("cl", "none", "cl-short", "cl-long", "chunked", "chunked", "chunked-bad", "cl+te", "trailers",
               "huge-trailer")
PAYLOADS = mostly(CHAT, b"{}", b"{", b"null", b"x" * 300_000, b"\xff\x00")


@st.composite
def body(draw):
    """(framing headers, body bytes) of one message."""
    payload = draw(PAYLOADS)
    kind = draw(KINDS)
    cl = [(b"Content-Length", b"%d" % len(payload))]
    te = [(b"Transfer-Encoding", b"chunked")]
    if kind == "none":
        return [], b""
    if kind == "cl":
        return cl, payload
    if kind == "cl-short":
        return [(b"Content-Length", b"%d" % (len(payload) + 7))], payload
    if kind == "cl-long":
        return [(b"Content-Length", b"%d" % max(0, len(payload) - 3))], payload
    cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=3)))
    pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)]) if b > a]
    chunks = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces)
    if kind == "chunked":
        return te, chunks + b"0\r\n\r\n"
    if kind == "chunked-bad":
        return te, draw(CHUNK_SIZES) + b"\r\n" + payload[:5] + b"\r\n0\r\n\r\n"
    if kind == "cl+te":
        return cl + te, chunks + b"0\r\n\r\n"
    if kind == "trailers":
        return te, chunks + b"0\r\nX-Request-Id: evil\r\nContent-Type: text/evil\r\n\r\n"
    return te, chunks + b"0\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"


@st.composite
def message(draw):
    line = draw(METHODS) + draw(SEPS) + draw(TARGETS) + draw(SEPS) + draw(VERSIONS)
    eol = draw(EOLS)
    framing, payload = draw(body())
    headers = [] if draw(st.integers(0, 9)) == 5 else [(b"Host", b"t")]
    if draw(st.integers(0, 9)) != 5:
        headers.append((b"Content-Type", b"application/json"))
    headers += framing + draw(HEADERS)
    if draw(st.integers(0, 9)) == 5:
        headers.append((b"X-Huge", b"h" * 20_000))
    if draw(st.integers(0, 9)) == 4:
        headers.append((b"Connection", b"close"))
    head = line + eol + b"".join(n + b": " + v + eol for n, v in draw(st.permutations(headers))) + eol
    return head + payload


@st.composite
def case(draw):
    """One connection's bytes: 1-3 messages, maybe a normal request pipelined after
    them (what a smuggler would hide), maybe cut short."""
    data = b"".join(draw(st.lists(message(), min_size=1, max_size=3)))
    if draw(st.booleans()):
        data += NORMAL
    if draw(st.integers(0, 9)) == 5:
        data = data[:draw(st.integers(0, len(data)))]
    return data


# -- the exchange ----------------------------------------------------------------------------------
async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, then read until the proxy closes the connection (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        try:
            await writer.drain()
        except ConnectionError:
            pass  # refused while still sending: what it answered is still read
        return await asyncio.wait_for(read_to_eof(reader), WAIT)
    finally:
        writer.close()


async def _responses(raw: bytes) -> list:
    reader = asyncio.StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    out = []
    while not reader.at_eof():
        out.append(await read_response(reader))
    return out


def _decode_records(cluster) -> int:
    return len(cluster.records("decode"))


def check(proxy, data: bytes) -> None:
    cluster, port = proxy["cluster"], proxy["port"]
    before = _decode_records(cluster)
    try:
        raw = asyncio.run(_exchange(port, data))
    except asyncio.TimeoutError:
        raise AssertionError(f"the proxy kept the connection open for more than {WAIT} s") from None
    try:
        responses = asyncio.run(_responses(raw))
    except Incomplete as exc:
        raise AssertionError(f"a response was cut short: {raw[-300:]!r}") from exc
    for resp in responses:
        assert resp.status < 500, (resp.status, resp.body[:300])
        if resp.status >= 400:
            assert resp.header(b"content-type") == b"application/json", resp.raw_head
            err = json.loads(resp.body)["error"]
            assert {"message", "type", "param", "code"} <= set(err), err
    # Every request that reached an instance was answered to this client: nothing
    # was smuggled past the front door.
    forwarded = _decode_records(cluster) - before
    assert forwarded <= sum(1 for r in responses if r.status == 200 or r.status >= 400), (forwarded, responses)
    # And the proxy still serves a normal request.
    normal = asyncio.run(_responses(asyncio.run(_exchange(port, NORMAL_CLOSE))))
    assert [r.status for r in normal] == [200]


FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@FUZZ
@given(data=case())
def test_raw_http_cases(proxy, data):
    check(proxy, data)


@pytest.mark.parametrize("data", [
    # CL+TE with a complete request hidden in the chunked body (llhttp refuses CL+TE).
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"%x\r\n%b\r\n0\r\n\r\n" % (len(NORMAL), NORMAL),
    # TE, then a Content-Length body that is really a second request.
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n"
    b"0\r\n\r\n%b" % (len(NORMAL) + 5, NORMAL),
    # An Upgrade request whose body is another request.
    b"POST /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: %d\r\n\r\n%b"
    % (len(NORMAL), NORMAL),
    # 300 pipelined Upgrade requests.
    b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n" * 300,
], ids=["cl+te", "te+cl", "upgrade-body", "many-upgrades"])
def test_known_smuggling_shapes(proxy, data):
    check(proxy, data)
