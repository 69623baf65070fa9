import copy
import re

import pytest

from epd_proxy.encode.encoder_plan import (
    SubRequest,
    encoder_body,
    encoder_request_id,
    new_transfer_id,
    plan_sub_requests,
)
from epd_proxy.encode.multimodal import client_key, collect_media, content_uuid, own_media
from epd_proxy.routing.policies import assign_round_robin


def img(url, **extra):
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def body_with(*parts, **extra):
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]},
        ],
        **extra,
    }


def six_images():
    urls = [f"https://x/{c}.jpg" for c in "AACDAF"]
    return body_with(*[img(u) for u in urls])


# ---------------------------------------------------------------- batching


@pytest.mark.parametrize(
    "max_batch, expected",
    [
        (0, [(0, [0, 2, 4]), (1, [1, 3, 5])]),
        (1, [(0, [0]), (1, [1]), (0, [2]), (1, [3]), (0, [4]), (1, [5])]),
        (2, [(0, [0, 2]), (1, [1, 3]), (0, [4]), (1, [5])]),
        (3, [(0, [0, 2, 4]), (1, [1, 3, 5])]),
    ],
)
def test_image_batching_matches_reference(max_batch, expected):
    items = collect_media(six_images())
    encoders, _ = assign_round_robin(0, 2, len(items))
    subs = plan_sub_requests(items, encoders, max_batch)
    assert [(s.encoder, [i.index for i in s.items]) for s in subs] == expected
    # E0 gets images from {A, C}, E1 from {A, D, F}.
    letters = {0: set(), 1: set()}
    for s in subs:
        letters[s.encoder] |= {i.part["image_url"]["url"][-5] for i in s.items}
    assert letters == {0: {"A", "C"}, 1: {"A", "D", "F"}}


def test_non_images_travel_alone_and_order_is_first_index():
    body = body_with(
        img("a"),
        {"type": "audio_url", "audio_url": {"url": "s1"}},
        img("b"),
        {"type": "video_url", "video_url": {"url": "v"}},
        img("c"),
        {"type": "input_audio", "input_audio": {"data": "QQ==", "format": "wav"}},
    )
    items = collect_media(body)
    encoders = [0, 0, 0, 0, 0, 0]
    subs = plan_sub_requests(items, encoders, 0)
    assert [[i.index for i in s.items] for s in subs] == [[0, 2, 4], [1], [3], [5]]
    subs = plan_sub_requests(items, encoders, 2)
    assert [[i.index for i in s.items] for s in subs] == [[0, 2], [1], [3], [4], [5]]


def test_plan_rejects_bad_arguments():
    items = collect_media(six_images())
    with pytest.raises(ValueError):
        plan_sub_requests(items, [0] * 6, -1)
    with pytest.raises(ValueError):
        plan_sub_requests(items, [0] * 5, 0)
    assert plan_sub_requests([], [], 0) == []


# ---------------------------------------------------------------- bodies


def test_encoder_body_with_rewrite():
    body = six_images()
    body.update(
        stream=True,
        max_tokens=64,
        temperature=0.2,
        mm_processor_kwargs={"fps": 1},
        media_io_kwargs={"video": {"num_frames": 8}},
        priority=3,
        session_id="s-1",
    )
    before = copy.deepcopy(body)
    items = collect_media(body)
    sub = SubRequest(0, [items[0], items[2]])
    out = encoder_body(body, sub, rewrite=True, transfer_ids=["t0", "t2"], consumer_zmq=None)
    assert out == {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    img("https://x/A.jpg", uuid=content_uuid(img("https://x/A.jpg"))),
                    img("https://x/C.jpg", uuid=content_uuid(img("https://x/C.jpg"))),
                ],
            }
        ],
        "stream": False,
        "mm_processor_kwargs": {"fps": 1},
        "media_io_kwargs": {"video": {"num_frames": 8}},
        "priority": 3,
        "session_id": "s-1",
    }
    assert "max_tokens" not in out and "ec_transfer_params" not in out
    assert body == before


def test_encoder_body_without_rewrite_sends_no_uuid_and_optional_fields_absent():
    body = six_images()
    del body["model"]
    items = collect_media(body)
    out = encoder_body(
        body, SubRequest(1, [items[1]]), rewrite=False, transfer_ids=["t1"], consumer_zmq=None
    )
    assert out == {
        "messages": [{"role": "user", "content": [img("https://x/A.jpg")]}],
        "stream": False,
    }
    assert out["messages"][0]["content"][0] is not items[1].part


def test_encoder_body_carries_the_client_uuid_namespaced_in_both_modes():
    body, items = own_media(body_with(img("https://x/a.jpg", uuid="mine")))
    for rewrite in (True, False):
        out = encoder_body(body, SubRequest(0, items), rewrite=rewrite, transfer_ids=["t"], consumer_zmq=None)
        assert out["messages"][0]["content"][0]["uuid"] == client_key("mine")


def test_encoder_body_normalises_bare_image_url():
    body = body_with({"type": "image_url", "image_url": "https://x/a.jpg"})
    before = copy.deepcopy(body)
    items = collect_media(body)
    out = encoder_body(body, SubRequest(0, items), rewrite=True, transfer_ids=["t"], consumer_zmq=None)
    assert out["messages"][0]["content"][0]["image_url"] == {"url": "https://x/a.jpg"}
    assert body == before


def test_encoder_body_push_ec_params_in_item_order():
    body = six_images()
    items = collect_media(body)
    sub = SubRequest(1, [items[1], items[3], items[5]])
    out = encoder_body(
        body, sub, rewrite=True, transfer_ids=["a", "b", "c"], consumer_zmq="tcp://10.0.0.5:19019"
    )
    assert out["ec_transfer_params"] == {
        "consumer_zmq": "tcp://10.0.0.5:19019",
        "ec_items": [{"transfer_id": "a"}, {"transfer_id": "b"}, {"transfer_id": "c"}],
    }
    with pytest.raises(ValueError):
        encoder_body(body, sub, rewrite=True, transfer_ids=["a"], consumer_zmq="tcp://x:1")


def test_encoder_request_id_and_transfer_ids():
    assert encoder_request_id("rid", 4, "a1b2c3") == "rid:4:a1b2c3"
    ids = [new_transfer_id() for _ in range(100)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in ids)
    assert len(set(ids)) == 100


# ------------------------------------------------------------------ the bound on items in flight


def test_within_bound_admits_in_order_up_to_each_encoders_room():
    from epd_proxy.encode.encoder_plan import within_bound

    encoders = ["a", "a", "b", "a", "b", "c"]
    assert within_bound(encoders, {}, 0) == [True] * 6  # 0: no bound
    assert within_bound(encoders, {}, 2) == [True, True, True, False, True, True]
    # Items already in flight count: "a" has one slot left, "b" none.
    assert within_bound(encoders, {"a": 1, "b": 2}, 2) == [True, False, False, False, False, True]
    assert within_bound([], {"a": 5}, 1) == []
