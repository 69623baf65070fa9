"""Small image files built by hand, for the tests that read an image's size from its header:
their pixel sizes are what the test says, their byte sizes as different as it asks."""

import base64
import random
import struct
import zlib


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A valid RGB PNG; ``seed`` sets how much of it is noise, so files of one size differ in bytes."""
    rnd = random.Random(seed)
    noise = rnd.random()
    rows = b"".join(b"\x00" + bytes(rnd.randrange(256) if rnd.random() < noise else 128 for _ in range(width * 3))
                    for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _png_chunk(b"IDAT", zlib.compress(rows)) + _png_chunk(b"IEND", b""))


def jpeg(width: int, height: int, exif: int = 0, payload: int = 100) -> bytes:
    """A JPEG's segments as a decoder walks them: SOI, an APP1 of ``exif`` bytes and a comment
    before the frame header (SOF0), then a scan of ``payload`` bytes."""
    app1 = b"\xff\xe1" + struct.pack(">H", exif + 2) + b"E" * exif if exif else b""
    com = b"\xff\xfe" + struct.pack(">H", 7) + b"hello"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    sos = b"\xff\xda" + struct.pack(">H", 8) + b"\x01\x01\x00\x00\x3f\x00"
    return b"\xff\xd8" + app1 + com + sof + sos + b"\x55" * payload + b"\xff\xd9"


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00" + b"\x3b"


def bmp(width: int, height: int) -> bytes:
    return b"BM" + b"\x00" * 16 + struct.pack("<ii", width, -height) + b"\x00" * 30


def webp_vp8x(width: int, height: int) -> bytes:
    return (b"RIFF" + struct.pack("<I", 30) + b"WEBP" + b"VP8X" + struct.pack("<I", 10) + b"\x00" * 4
            + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little"))


def webp_vp8l(width: int, height: int) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    return b"RIFF" + struct.pack("<I", 30) + b"WEBP" + b"VP8L" + struct.pack("<I", 10) + b"\x2f" \
        + struct.pack("<I", bits) + b"\x00" * 5


def webp_vp8(width: int, height: int) -> bytes:
    return (b"RIFF" + struct.pack("<I", 30) + b"WEBP" + b"VP8 " + struct.pack("<I", 10) + b"\x00" * 3
            + b"\x9d\x01\x2a" + struct.pack("<HH", width, height) + b"\x00" * 4)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()
