import base64
import random

import msgspec
import pytest
from blake3 import blake3

from epd_proxy.encode.encoder_plan import encoder_body, plan_sub_requests
from epd_proxy.encode.multimodal import collect_media, content_uuid
from epd_proxy.wire.blobs import MIN_BLOB, Blob, decode_chat_body, encode_json, is_text, text_bytes


def b64(n: int, seed: int = 0) -> str:
    return base64.b64encode(random.Random(seed).randbytes(n)).decode()


def data_url(n: int = 4000, seed: int = 0, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(n, seed)}"


def chat(*parts, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": list(parts)}], **extra}


def img(url):
    return {"type": "image_url", "image_url": {"url": url}}


def blobs_in(obj) -> list[Blob]:
    if isinstance(obj, Blob):
        return [obj]
    if isinstance(obj, dict):
        return [b for v in obj.values() for b in blobs_in(v)]
    if isinstance(obj, list):
        return [b for v in obj for b in blobs_in(v)]
    return []


BODIES = {
    "one image": chat({"type": "text", "text": "what is this?"}, img(data_url())),
    "three images": chat(img(data_url(seed=1)), img(data_url(seed=2)), {"type": "text", "text": "x"},
                         img(data_url(seed=3))),
    "bare string image": chat({"type": "image_url", "image_url": data_url(seed=4)}),
    "audio, video, input_audio": chat(
        {"type": "audio_url", "audio_url": {"url": data_url(seed=5, mime="audio/wav")}},
        {"type": "video_url", "video_url": {"url": data_url(seed=6, mime="video/mp4")}},
        {"type": "input_audio", "input_audio": {"data": b64(3000, 7), "format": "wav"}}),
    "same image twice": chat(img(data_url(seed=8)), img(data_url(seed=8))),
    "small image": chat(img(data_url(100))),
    "http url": chat(img("https://example.com/cat.png")),
    "image and uuid": chat({**img(data_url(seed=9)), "uuid": "client-key"}),
    "text only": chat({"type": "text", "text": "hello"}),
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_same_as_a_plain_decode(name):
    raw = msgspec.json.encode(BODIES[name])
    plain = msgspec.json.decode(raw)
    body = decode_chat_body(raw)
    assert encode_json(body) == msgspec.json.encode(plain) == raw
    items, plain_items = collect_media(body), collect_media(plain)
    assert [i.uuid for i in items] == [i.uuid for i in plain_items]
    for item, plain_item in zip(items, plain_items):
        assert content_uuid(item.part) == content_uuid(plain_item.part)
    subs = plan_sub_requests(items, [0] * len(items), 0)
    plain_subs = plan_sub_requests(plain_items, [0] * len(plain_items), 0)
    for sub, psub in zip(subs, plain_subs):
        for rewrite in (True, False):
            got = encoder_body(body, sub, rewrite=rewrite, transfer_ids=["t"] * len(sub.items), consumer_zmq="z")
            want = encoder_body(plain, psub, rewrite=rewrite, transfer_ids=["t"] * len(psub.items),
                                consumer_zmq="z")
            assert encode_json(got) == msgspec.json.encode(want)


def test_large_media_strings_are_lifted_and_hashed_in_place():
    url = data_url(seed=11)
    audio = {"type": "input_audio", "input_audio": {"data": b64(2000), "format": "mp3"}}
    body = decode_chat_body(msgspec.json.encode(chat(img(url), audio)))
    blobs = blobs_in(body)
    assert len(blobs) == 2 and all(len(b) > MIN_BLOB for b in blobs)
    image = body["messages"][1]["content"][0]["image_url"]["url"]
    assert isinstance(image, Blob) and image == url and is_text(image)
    assert bytes(text_bytes(image)) == url.encode()
    assert collect_media(body)[0].uuid == blake3(url.encode()).hexdigest()


@pytest.mark.parametrize("raw, payload", [
    # Whitespace and key order as other clients write them.
    (b'{"messages":[{"role":"user","content":[ {"image_url" : { "url" :  "%s" } , "type":"image_url"} ]}]}',
     data_url(5000, 3)),
    (b'{\n  "messages": [\n    {"content": [{"type": "input_audio", "input_audio": {"format": "wav",\n'
     b'      "data" :\t"%s"}}], "role": "user"}]}', b64(5000, 3)),
])
def test_other_layouts(raw, payload):
    raw = raw % payload.encode()
    body = decode_chat_body(raw)
    assert len(blobs_in(body)) == 1
    assert body == msgspec.json.decode(raw) or encode_json(body) == msgspec.json.encode(msgspec.json.decode(raw))


@pytest.mark.parametrize("url", [
    data_url().replace("/", "\\/"),  # escaped solidus: the decoded string differs from the bytes
    "data:image/png;base64," + "é" * 2000,  # not ASCII
])
def test_literals_that_decode_to_other_bytes_are_decoded(url):
    raw = msgspec.json.encode(chat(img("X"))).replace(b'"X"', b'"' + url.encode() + b'"')
    body = decode_chat_body(raw)
    assert blobs_in(body) == []
    assert body == msgspec.json.decode(raw)


def test_data_text_outside_a_media_payload_falls_back():
    text = data_url(seed=12)
    raw = msgspec.json.encode(chat({"type": "text", "text": text}, img(data_url(seed=13)),
                                   data={"data": text}))
    body = decode_chat_body(raw)
    assert blobs_in(body) == []
    assert body == msgspec.json.decode(raw)


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_marker_in_the_client_text_is_just_text(where):
    # The marker's nonce is random per process and never leaves it; even a client
    # that knew it cannot make its own text stand for a lifted literal.
    from epd_proxy.wire import blobs

    forged = img(blobs._MARK + "0")
    parts = [forged, img(data_url(seed=14))] if where == "before" else [img(data_url(seed=14)), forged]
    raw = msgspec.json.encode(chat(*parts))
    body = decode_chat_body(raw)
    assert body == msgspec.json.decode(raw)
    assert blobs_in(body) == []


@pytest.mark.parametrize("raw", [
    b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"%s"}}]}]',  # unclosed
    b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"%s}}]}]}',  # no quote
    b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"%s""}}]}]}',
    b'{"messages":[{"role":"user","content":"text \\\\"%s"}]}',  # an escaped backslash ends the string
])
def test_invalid_json_is_invalid(raw):
    raw = raw % data_url().encode()
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(raw)
    with pytest.raises(msgspec.DecodeError):
        decode_chat_body(raw)


def test_blob_equality_and_repr():
    raw = msgspec.json.encode(chat(img(data_url(seed=15)), img(data_url(seed=15)), img(data_url(seed=16))))
    a, b, c = blobs_in(decode_chat_body(raw))
    assert a == b and a != c and a != 3
    assert "bytes" in repr(a)
    with pytest.raises(TypeError):
        hash(a)


@pytest.mark.parametrize("byte", [0x00, 0x01, 0x09, 0x0A, 0x1F])
@pytest.mark.parametrize("kind", ["image_url", "input_audio"])
def test_a_large_literal_with_a_raw_control_byte_is_invalid_json(byte, kind):
    """The fast path lifts literals without decoding them; one holding a raw control
    byte must not be lifted (and then forwarded as invalid JSON), but rejected."""
    payload = base64.b64encode(bytes(3 * MIN_BLOB)).decode()
    bad = payload[:100] + chr(byte) + payload[100:]
    if kind == "image_url":
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,PLACE"}}
    else:
        part = {"type": "input_audio", "input_audio": {"data": "PLACE", "format": "wav"}}
    raw = msgspec.json.encode({"messages": [{"role": "user", "content": [part]}]})
    raw = raw.replace(b"PLACE", bad.encode())
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(raw)
    with pytest.raises(msgspec.DecodeError):
        decode_chat_body(raw)
    good = raw.replace(bad.encode(), payload.encode())
    body = decode_chat_body(good)
    payload_obj = body["messages"][0]["content"][0][kind]
    assert isinstance(payload_obj["url" if kind == "image_url" else "data"], Blob)
