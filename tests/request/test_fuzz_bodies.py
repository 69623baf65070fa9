"""Fuzzed request bodies: what the proxy must survive whatever a client sends.

Through the proxy in front of a simulated E+P+D cluster (so the encoder fan-out runs):
random JSON, and valid OpenAI chat / completions bodies mutated with wrong types, deep
nesting, huge numbers, odd and invalid data URLs, invalid UTF-8, stray transfer params
and uuids. The proxy must never answer a 5xx of its own making, never hang, give every
4xx of its own the OpenAI error envelope, and keep serving normal requests. The pure
parts (``decode_chat_body``, ``encode_json``, ``own_media``) are fuzzed beside them.

Bounded: one cluster for the module, a fixed example count, no deadline (the
machine's speed varies).
"""

from __future__ import annotations

import asyncio
import base64
import copy

import msgspec
import pytest
from helpers import chat_body, stack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_proxy.encode.multimodal import collect_media, own_media
from epd_proxy.wire.blobs import MIN_BLOB, decode_chat_body, encode_json
from epd_proxy.wire.errors import ProxyError

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PURE = settings(SETTINGS, max_examples=100)

# -- strategies ---------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=16)

_B64 = base64.b64encode(bytes(range(256)) * 8).decode()  # 2.7 KB: large enough to be lifted
data_urls = st.sampled_from([
    "data:image/png;base64," + _B64,
    "data:image/png;base64,AAAA",
    "data:",
    "data:,",
    "data:image/png;base64,",
    "data:;;;,%%%",
    "data:image/png;base64," + _B64[:1500] + "\\u0000" + _B64[1500:],  # an escape: not lifted
    "DATA:image/png;base64," + _B64,
    "data:image/png;base64," + _B64 + "é",
])
media_urls = data_urls | st.sampled_from([
    "https://x/a.png", "http://example.com/b.jpg", "file:///etc/passwd", "http://127.0.0.1/a.png",
    "http://[::1]/", "http://0x7f000001/", "gopher://x/", "", "not a url", "http://[::1", "https://",
])
uuids = st.none() | st.sampled_from(["", "mine", "x" * 300, "../../etc/passwd", "0" * 64]) | json_values


@st.composite
def media_parts(draw):
    kind = draw(st.sampled_from(["image_url", "audio_url", "video_url", "input_audio", "image_embeds", "text"]))
    if kind == "text":
        part = {"type": "text", "text": draw(st.text(max_size=20))}
    elif kind == "input_audio":
        part = {"type": kind, kind: {"data": draw(st.sampled_from([_B64, "AAAA", ""]) | json_values),
                                     "format": "wav"}}
    elif kind == "image_embeds":
        part = {"type": kind, kind: draw(json_values)}
    elif kind == "image_url" and draw(st.booleans()):
        part = {"type": kind, kind: draw(media_urls)}
    else:
        part = {"type": kind, kind: {"url": draw(media_urls)}}
    if draw(st.booleans()):
        part["uuid"] = draw(uuids)
    return part


FIELDS = ["model", "messages", "stream", "max_tokens", "max_completion_tokens", "stream_options", "min_tokens",
          "temperature", "seed", "kv_transfer_params", "ec_transfer_params", "mm_processor_kwargs", "prompt",
          "logprobs", "stop"]
# ``n`` only small or ill-typed: the simulator makes every choice's tokens up front, so a huge
# ``n`` would keep it busy for minutes (the proxy passes ``n`` on untouched either way).
small_n = st.integers(-2, 3) | st.none() | st.text(max_size=3) | st.floats(-2, 3)


def _deep(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


@st.composite
def chat_bodies(draw):
    parts = draw(st.lists(media_parts(), max_size=5))
    body = chat_body(draw(st.text(max_size=30)) or "hi", stream=draw(st.booleans()), max_tokens=4)
    if parts:
        body["messages"][0]["content"] = [{"type": "text", "text": "look"}, *parts]
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(FIELDS))
        body[key] = draw(json_values | st.sampled_from([10 ** 30, -1, 2 ** 63, 1e308, _deep(50)]))
    if draw(st.booleans()):
        body["n"] = draw(small_n)
    if draw(st.booleans()):
        body["kv_transfer_params"] = {"remote_host": "10.9.9.9", "do_remote_prefill": True}
        body["ec_transfer_params"] = {"ec_items": [{"mm_hash": "evil"}]}
    return body


@st.composite
def completion_bodies(draw):
    body = {"model": "sim-model", "prompt": draw(st.text(max_size=20) | json_values), "max_tokens": 4,
            "stream": draw(st.booleans())}
    for _ in range(draw(st.integers(0, 3))):
        body[draw(st.sampled_from(FIELDS))] = draw(json_values)
    if draw(st.booleans()):
        body["n"] = draw(small_n)
    return body


@st.composite
def raw_bodies(draw):
    """Encoded bodies, some then damaged at the byte level."""
    path, body = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"])), None
    choice = draw(st.integers(0, 3))
    if choice == 0:
        body = draw(json_values)
    elif path == "/v1/chat/completions":
        body = draw(chat_bodies())
    else:
        body = draw(completion_bodies())
    raw = encode_json(body)
    damage = draw(st.sampled_from(["none", "none", "utf8", "control", "truncate", "deep"]))
    if damage == "utf8" and b'"' in raw:
        i = raw.index(b'"') + 1
        raw = raw[:i] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])) + raw[i:]
    elif damage == "control":
        at = raw.find(b"base64,")
        at = at + 100 if at >= 0 else len(raw) // 2
        raw = raw[:at] + draw(st.sampled_from([b"\x00", b"\x01", b"\n", b"\x1f"])) + raw[at:]
    elif damage == "truncate":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif damage == "deep":
        depth = draw(st.sampled_from([64, 500, 995, 5000]))
        raw = b'{"messages": [{"role": "user", "content": "hi"}], "prompt": "x", "d": ' + b"[" * depth \
            + b"]" * depth + b"}"
    return path, raw


# -- the proxy in front of a simulated E+P+D cluster, shared by the module ------------------------

@pytest.fixture(scope="module")
def running():
    loop = asyncio.new_event_loop()
    cm = stack(encode=1)
    cluster, proxy, client = loop.run_until_complete(cm.__aenter__())
    try:
        yield loop, cluster, client
    finally:
        loop.run_until_complete(cm.__aexit__(None, None, None))
        loop.close()


def _check_reply(cluster, reply) -> None:
    records = cluster.records()
    upstream = {r.status for r in records if r.status is not None}
    upstream_failed = any((r.status or 0) >= 500 or r.error for r in records)
    assert reply.status != 500, reply.body
    if reply.status >= 500:
        # Only a failure the simulator made may surface as a 5xx (a relayed 502/504).
        assert reply.status in (502, 504) and upstream_failed, (reply.status, reply.body)
    elif reply.status >= 400 and reply.status not in upstream:
        err = msgspec.json.decode(reply.body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
        assert err["code"] == reply.status
    for rec in records:
        assert b"10.9.9.9" not in rec.body and b'"evil"' not in rec.body


def _exchange(running, path: str, raw: bytes):
    loop, cluster, client = running
    cluster.clear_records()
    reply = loop.run_until_complete(client.request("POST", path, raw, [(b"content-type", b"application/json")],
                                                   timeout=10))
    _check_reply(cluster, reply)
    return reply


def _still_serves(running) -> None:
    loop, cluster, client = running
    ok = loop.run_until_complete(client.chat(chat_body(images=["https://x/ok.png"]), timeout=10))
    assert ok.status == 200, ok.body


@SETTINGS
@given(case=raw_bodies())
def test_fuzzed_bodies_never_make_the_proxy_fail(running, case):
    path, raw = case
    _exchange(running, path, raw)
    _still_serves(running)


@SETTINGS
@given(body=chat_bodies())
def test_fuzzed_chat_bodies_with_media(running, body):
    _exchange(running, "/v1/chat/completions", encode_json(body))
    _still_serves(running)


# -- the pure parts ----------------------------------------------------------------------------------

big_literals = st.sampled_from(["data:image/png;base64," + _B64, _B64, "data:" + "A" * MIN_BLOB])


@st.composite
def bodies_with_blobs(draw):
    body = draw(chat_bodies())
    if draw(st.booleans()) and isinstance(body.get("messages"), list):
        body["messages"].append({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": draw(big_literals)}},
            {"type": "input_audio", "input_audio": {"data": draw(big_literals), "format": "wav"}},
            {"type": "text", "text": draw(big_literals)}]})
    return body


@PURE
@given(body=bodies_with_blobs(), damage=st.sampled_from([None, b"\x00", b"\x7f", b"\xff"]))
def test_decode_chat_body_is_a_plain_decode_and_encode_json_round_trips(body, damage):
    raw = encode_json(body)
    if damage is not None:
        at = raw.find(b"base64,")
        raw = raw[:at + 50] + damage + raw[at + 50:] if at >= 0 else raw
    try:
        plain = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        with pytest.raises(msgspec.DecodeError):
            decode_chat_body(raw)
        return
    fast = decode_chat_body(raw)
    assert msgspec.json.decode(encode_json(fast)) == plain
    assert encode_json(fast) == encode_json(plain)


@PURE
@given(body=json_values | chat_bodies(), ignore=st.booleans())
def test_collect_and_own_media_either_answer_or_400_and_never_mutate(body, ignore):
    before = copy.deepcopy(body)
    try:
        collected = collect_media(body, ignore_client_uuids=ignore)
    except ProxyError as err:
        assert err.status == 400 and err.message
        with pytest.raises(ProxyError):
            own_media(body, ignore_client_uuids=ignore)
        return
    out, items = own_media(body, ignore_client_uuids=ignore)
    assert body == before
    assert [(i.index, i.type, i.uuid) for i in items] == [(i.index, i.type, i.uuid) for i in collected]
    for item in items:
        part = out["messages"][item.message_index]["content"][item.part_index]
        assert part is item.part
        assert part.get("uuid") in (None, item.uuid)
        assert len(item.uuid) <= len("client-") + 64
