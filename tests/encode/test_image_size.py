"""An inline image's pixel size read from its header inside the base64, every format the
reader knows; anything else says nothing (the caller estimates from the bytes)."""

import base64

import pytest
from image_files import bmp, gif, jpeg, png, webp_vp8, webp_vp8l, webp_vp8x

from epd_proxy.encode.image_size import base64_reader, image_size


def size_of(data: bytes):
    return image_size(base64_reader(memoryview(base64.b64encode(data))))


@pytest.mark.parametrize("build", [png, gif, bmp, webp_vp8x, webp_vp8l, webp_vp8, jpeg])
def test_each_format_gives_its_size(build):
    assert size_of(build(640, 480)) == (640, 480)
    assert size_of(build(1, 3000)) == (1, 3000)


def test_a_jpeg_frame_header_is_found_past_a_large_exif_segment():
    assert size_of(jpeg(1024, 768, exif=60000, payload=5000)) == (1024, 768)


def test_every_offset_of_the_base64_reads_the_bytes_it_encodes():
    data = bytes(range(256)) * 3
    read = base64_reader(base64.b64encode(data))
    for offset in range(0, 40):
        for length in range(1, 9):
            assert read(offset, length) == data[offset:offset + length]
    assert read(len(data) - 2, 10) == data[-2:]
    assert read(-1, 4) == b"" and read(0, 0) == b""
    # within a longer text (a data: URL's), bytes or str alike
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for text in (url, url.encode(), memoryview(url.encode())):
        read = base64_reader(text, url.index(",") + 1)
        assert read(7, 5) == data[7:12] and read(0, 3) == data[:3]


@pytest.mark.parametrize("data", [
    b"",
    b"not an image at all, long enough to read",
    b"\xff\xd8\xff\xda\x00\x08" + b"\x00" * 40,  # a scan before any frame header
    b"\xff\xd8" + b"\xff\xe1\xff\xff" + b"\x00" * 20,  # a segment running past the end
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + b"\x00" * 12,  # zero by zero
])
def test_what_the_header_does_not_say_is_none(data):
    assert size_of(data) is None


def test_malformed_base64_is_none():
    assert image_size(base64_reader(b"%%%%not base64 at all%%%%%%%%%%%%%%")) is None
