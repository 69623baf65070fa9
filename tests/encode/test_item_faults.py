"""Which items two encoders failed alike (item_faults.py), and a sub-request's timeout by its
items (encoder_plan.sub_request_timeout): pure."""

from __future__ import annotations

import pytest

from epd_proxy.encode.encoder_plan import sub_request_timeout
from epd_proxy.encode.item_faults import EncodeFailures
from epd_proxy.encode.multimodal import MediaItem


def test_two_encoders_failing_an_item_alike_make_it_the_items_fault():
    f = EncodeFailures()
    assert f.failed("A", [0, 1], held="A timed out") == []
    assert f.blamed() == ["A timed out"]
    # Item 1 alone goes to B, which times out too: item 1 is the cause; A's failure (which
    # held it) is let go with B's.
    assert f.failed("B", [1], held="B timed out") == [1]
    assert f.blamed() == []
    assert f.encoders == {"A", "B"}


def test_an_item_another_encoder_encodes_leaves_the_failure_the_encoders():
    f = EncodeFailures()
    f.failed("A", [0], held="A timed out")
    f.failed("B", [1], held="B: 500")  # another item: no verdict on either
    assert f.blamed() == ["A timed out", "B: 500"]


def test_the_same_encoder_twice_or_an_encoders_own_failure_is_no_verdict():
    f = EncodeFailures()
    assert f.failed("A", [0], held="A timed out") == []
    assert f.failed("A", [0], held="A timed out again") == []
    # A refused connection is the encoder's alone (held None): it never makes an item at fault.
    assert f.failed("B", [0]) == []
    assert f.blamed() == ["A timed out", "A timed out again"]
    assert f.encoders == {"A", "B"}


def _item(kind: str, index: int = 0) -> MediaItem:
    return MediaItem(index, 0, index, kind, {"type": kind}, f"u{index}")


@pytest.mark.parametrize(("kinds", "seconds"), [
    (["image_url"], 10.0),
    (["image_url"] * 8, 17.0),
    (["input_audio"], 20.0),
    (["audio_url"], 20.0),
    (["video_url"], 40.0),
])
def test_a_sub_requests_timeout_scales_with_its_items(kinds, seconds):
    items = [_item(k, i) for i, k in enumerate(kinds)]
    assert sub_request_timeout(items, 10.0) == pytest.approx(seconds)
