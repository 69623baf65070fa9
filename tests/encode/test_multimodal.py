import copy

import msgspec
import pytest
from blake3 import blake3

# ---------------------------------------------------------------- constants
from chat_parts import body_with, digest, img

from epd_proxy.encode.multimodal import (
    EMBEDS_TYPES,
    MEDIA_TYPES,
    client_key,
    collect_media,
    content_uuid,
    own_media,
)
from epd_proxy.wire.errors import ProxyError


def test_media_and_embeds_types():
    assert MEDIA_TYPES == ("image_url", "audio_url", "input_audio", "video_url")
    assert EMBEDS_TYPES == {
        "image_url": "image_embeds",
        "audio_url": "audio_embeds",
        "input_audio": "audio_embeds",
        "video_url": "video_embeds",
    }


# ---------------------------------------------------------------- content_uuid


def test_content_uuid_is_the_blake3_of_the_url():
    assert content_uuid(img("https://x/a.jpg")) == digest("https://x/a.jpg")
    assert content_uuid({"type": "audio_url", "audio_url": {"url": "u"}}) == digest("u")
    assert content_uuid({"type": "video_url", "video_url": {"url": "v"}}) == digest("v")
    assert content_uuid({"type": "image_url", "image_url": "https://bare"}) == digest(
        "https://bare"
    )


def test_content_uuid_input_audio_is_sorted_json_hash_and_stable():
    a = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    b = {"input_audio": {"format": "wav", "data": "AAAA"}, "type": "input_audio"}
    expected = blake3(msgspec.json.encode(a, order="sorted")).hexdigest()
    assert content_uuid(a) == expected
    assert content_uuid(b) == expected
    other = {"type": "input_audio", "input_audio": {"data": "BBBB", "format": "wav"}}
    assert content_uuid(other) != expected


def test_content_uuid_is_request_independent():
    assert content_uuid(img("https://x/a.jpg")) == content_uuid(img("https://x/a.jpg"))
    assert content_uuid(img("https://x/a.jpg")) != content_uuid(img("https://x/b.jpg"))


# ---------------------------------------------------------------- collect_media


def test_collect_media_global_order_and_positions():
    body = {
        "messages": [
            {"role": "system", "content": "sys"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    img("https://x/a.jpg"),
                    {"type": "audio_url", "audio_url": {"url": "https://x/s.wav"}},
                ],
            },
            {"role": "assistant", "content": None},
            {"role": "assistant"},
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
                    {"type": "input_audio", "input_audio": {"data": "QQ==", "format": "wav"}},
                ],
            },
        ]
    }
    items = collect_media(body)
    assert [(i.index, i.message_index, i.part_index, i.type) for i in items] == [
        (0, 1, 1, "image_url"),
        (1, 1, 2, "audio_url"),
        (2, 4, 0, "video_url"),
        (3, 4, 1, "input_audio"),
    ]
    assert items[0].part is body["messages"][1]["content"][1]
    assert items[0].uuid == digest("https://x/a.jpg")
    assert items[3].uuid == content_uuid(body["messages"][4]["content"][1])


def test_collect_media_honours_client_uuid_namespaced():
    body = body_with(img("https://x/a.jpg", uuid="client-key"), img("https://x/b.jpg", uuid=""))
    items = collect_media(body)
    assert items[0].uuid == client_key("client-key") == "client-" + digest("client-key")
    assert items[1].uuid == digest("https://x/b.jpg")


def test_a_client_uuid_can_never_be_a_content_key():
    """The attack of issue 13.1: the uuid is the victim's content key."""
    victim = content_uuid(img("https://victim/secret.png"))
    (item,) = collect_media(body_with(img("https://attacker/evil.png", uuid=victim)))
    assert item.uuid != victim and item.uuid == client_key(victim)
    assert not all(c in "0123456789abcdef" for c in item.uuid)


def test_collect_media_can_ignore_client_uuids():
    body = body_with(img("https://x/a.jpg", uuid="mine"))
    (item,) = collect_media(body, ignore_client_uuids=True)
    assert item.uuid == digest("https://x/a.jpg")


def test_client_key_is_a_safe_file_name_of_bounded_length():
    key = client_key("../../etc/passwd" + "x" * 10_000)
    assert len(key) == len("client-") + 64 and "/" not in key and "." not in key


@pytest.mark.parametrize("value", [1, ["a"], {"a": 1}, True])
def test_a_non_string_uuid_is_a_400(value):
    with pytest.raises(ProxyError) as exc:
        collect_media(body_with(img("https://x/a.jpg", uuid=value)))
    assert exc.value.status == 400 and exc.value.param == "messages[1].content[0].uuid"


def test_own_media_without_uuids_returns_the_body_itself():
    body = body_with(img("https://x/a.jpg"), {"type": "text", "text": "hi"})
    out, items = own_media(body)
    assert out is body and items[0].part is body["messages"][1]["content"][0]


@pytest.mark.parametrize("ignore", [False, True])
def test_own_media_replaces_every_client_uuid_without_touching_the_client_body(ignore):
    embeds = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": "victim"}
    body = body_with(img("https://x/a.jpg", uuid="mine"), img("https://x/b.jpg", uuid=None), embeds)
    before = copy.deepcopy(body)
    out, items = own_media(body, ignore_client_uuids=ignore)
    assert body == before
    content = out["messages"][1]["content"]
    if ignore:
        assert all("uuid" not in part for part in content)
        assert items[0].uuid == digest("https://x/a.jpg")
    else:
        assert content[0]["uuid"] == items[0].uuid == client_key("mine")
        assert "uuid" not in content[1] and items[1].uuid == digest("https://x/b.jpg")
        assert content[2]["uuid"] == client_key("victim")
    assert [i.part for i in items] == content[:2]
    assert all(i.part is content[k] for k, i in enumerate(items))
    assert out["messages"][0] is body["messages"][0]  # untouched messages are shared


def test_collect_media_accepts_bare_string_image_url():
    body = body_with({"type": "image_url", "image_url": "https://x/a.jpg"})
    (item,) = collect_media(body)
    assert item.uuid == digest("https://x/a.jpg")


def test_collect_media_no_media_and_passive_parts():
    body = body_with(
        {"type": "text", "text": "t"},
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}},
        {"type": "refusal", "refusal": "no"},
    )
    assert collect_media(body) == []


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": 5}]}]}, "messages[0].content[0]"),
        (body_with({"type": "text", "text": "a"}, {"type": "image_url"}), "messages[1].content[1]"),
        (body_with({"type": "image_url", "image_url": {"uri": "x"}}), "messages[1].content[0]"),
        (body_with({"type": "audio_url", "audio_url": "https://x"}), "messages[1].content[0]"),
        (body_with({"type": "video_url", "video_url": {"url": 7}}), "messages[1].content[0]"),
        (body_with({"type": "input_audio", "input_audio": {"format": "wav"}}), "messages[1].content[0]"),
        (body_with({"type": "input_audio", "input_audio": "QQ=="}), "messages[1].content[0]"),
    ],
)
def test_collect_media_validation_errors(body, param):
    with pytest.raises(ProxyError) as exc:
        collect_media(body)
    assert exc.value.status == 400
    assert exc.value.param == param
    assert exc.value.envelope()["error"]["type"] == "BadRequestError"


def test_collect_media_rejects_unknown_part_type():
    body = body_with({"type": "text", "text": "a"}, {"type": "hologram", "hologram": {}})
    with pytest.raises(ProxyError) as exc:
        collect_media(body)
    assert exc.value.status == 400
    assert exc.value.param == "messages[1].content[1]"
    assert "unknown content part type" in exc.value.message
    assert "hologram" in exc.value.message


def test_collect_media_rejects_non_object_body():
    with pytest.raises(ProxyError) as exc:
        collect_media([])
    assert exc.value.status == 400
