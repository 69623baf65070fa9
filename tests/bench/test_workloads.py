import base64

import msgspec
import pytest

from epd_proxy.bench.workloads import (
    CHAT_PATH,
    chat_body,
    image_data_url,
    make_workload,
    prepare,
    prompt_text,
    simulator_expected,
)


def test_prompt_text_size():
    import random

    t = prompt_text(600, random.Random(1))
    assert 550 <= len(t.encode()) <= 600
    assert prompt_text(600, random.Random(1)) == t


def test_image_data_url_size():
    import random

    url = image_data_url(150, random.Random(0))
    assert url.startswith("data:image/png;base64,")
    raw = base64.b64decode(url.split(",", 1)[1])
    assert len(raw) == 150 * 1024
    assert raw.startswith(b"\x89PNG")


@pytest.mark.parametrize("name,stream,images", [("stream", True, 0), ("nonstream", False, 0), ("mm", True, 1)])
def test_components(name, stream, images):
    (w,) = make_workload(name)
    assert w.stream is stream and w.images == images
    body = chat_body(w, 3, seed=1)
    assert body["stream"] is stream
    assert body["max_tokens"] == 64
    assert body["model"] == "sim-model"
    content = body["messages"][0]["content"]
    if images:
        assert [p["type"] for p in content] == ["text", "image_url"]
    else:
        assert isinstance(content, str) and 550 <= len(content) <= 600


def test_a_workload_named_with_its_length():
    (w,) = make_workload("stream@32", max_tokens=64)
    assert w.stream is True and w.max_tokens == 32 and w.name == "stream"
    assert chat_body(w, 0)["max_tokens"] == 32
    (n,) = make_workload("nonstream@96")
    assert n.stream is False and n.max_tokens == 96
    for bad in ("stream@", "stream@x", "stream@0"):
        with pytest.raises(ValueError):
            make_workload(bad)


def test_mm_with_k_images():
    (w,) = make_workload("mm", images=3, image_kb=10)
    body = chat_body(w, 0)
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text"] + ["image_url"] * 3
    urls = {p["image_url"]["url"] for p in parts[1:]}
    assert len(urls) == 3  # distinct images


def test_prepare_is_deterministic_and_distinct():
    a = prepare(make_workload("stream", variants=8), seed=3)
    b = prepare(make_workload("stream", variants=8), seed=3)
    c = prepare(make_workload("stream", variants=8), seed=4)
    assert [p.body for p in a] == [p.body for p in b]
    assert a[0].body != c[0].body
    assert len({p.body for p in a}) == 8
    assert all(p.path == CHAT_PATH and p.stream for p in a)
    assert msgspec.json.decode(a[0].body) == a[0].obj


def test_mixed_interleaves_in_proportion():
    reqs = prepare(make_workload("mixed", variants=4))
    kinds = [p.kind for p in reqs]
    assert len(kinds) == 16
    assert kinds[:4] == ["stream", "stream", "nonstream", "mm"]
    assert kinds.count("stream") == 8 and kinds.count("nonstream") == 4 and kinds.count("mm") == 4


def test_expected_from_simulator():
    expected = simulator_expected()
    assert expected is not None
    reqs = prepare(make_workload("stream", variants=2, max_tokens=5), expected=expected)
    for p in reqs:
        assert p.expected == expected(p.obj)
        assert p.expected
    # Without an oracle nothing is verified.
    assert prepare(make_workload("stream", variants=1))[0].expected is None


def test_unknown_workload():
    with pytest.raises(ValueError):
        make_workload("bogus")
