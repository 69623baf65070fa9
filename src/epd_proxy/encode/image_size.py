"""Pure: an inline image's pixel size, read from its header inside the base64 of a ``data:``
URL without decoding the rest.

An encoder's work on an image is set by its pixels (a vision model cuts the resized image
into patches), not by its file size: two photos of one size compress to different byte
counts and cost the encoder the same. Reading the size lets encoder placement
(``routing/encoders.py``) count images of one size as equal work, so sequential new images
spread exactly level. PNG, GIF, WebP and BMP keep the size in their first 30 bytes; a JPEG's
frame header comes after its other segments (EXIF, ICC profile), which are skipped by their
lengths, each read decoding a few base64 characters only. Anything else (another format, a
malformed header, percent-encoded data) is ``None``: the caller estimates from the bytes.
"""

from __future__ import annotations

import binascii
from typing import Callable

# JPEG segments walked before giving up (a JPEG's frame header follows a handful).
JPEG_MAX_SEGMENTS = 64
# JPEG markers that start a frame (SOF0..SOF15 but DHT, JPG and DAC): height and width follow.
_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))

Reader = Callable[[int, int], bytes]  # (offset, length) -> up to length bytes of the image


def base64_reader(text: bytes | memoryview | str, start: int = 0) -> Reader:
    """Random access into the bytes the base64 ``text[start:]`` encodes, decoding only the
    quads that cover each read (nothing else of ``text`` is copied)."""
    def read(offset: int, length: int) -> bytes:
        if offset < 0 or length <= 0:
            return b""
        first = start + 4 * (offset // 3)
        last = start + 4 * ((offset + length + 2) // 3)
        piece = text[first:last]
        chunk = piece.encode("ascii", "replace") if isinstance(piece, str) else bytes(piece)
        try:
            raw = binascii.a2b_base64(chunk, strict_mode=True)
        except (binascii.Error, ValueError):
            return b""
        skip = offset % 3
        return raw[skip:skip + length]
    return read


def image_size(read: Reader) -> tuple[int, int] | None:
    """The (width, height) in pixels of the image ``read`` gives, or ``None`` if its format
    is not one of PNG, GIF, WebP, BMP, JPEG or its header does not say."""
    head = read(0, 30)
    if len(head) < 10:
        return None
    if head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR" and len(head) >= 24:
        return _positive(int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big"))
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return _positive(int.from_bytes(head[6:8], "little"), int.from_bytes(head[8:10], "little"))
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP" and len(head) >= 30:
        return _webp(head)
    if head[:2] == b"BM" and len(head) >= 26:
        return _positive(int.from_bytes(head[18:22], "little", signed=True),
                         abs(int.from_bytes(head[22:26], "little", signed=True)))
    if head[:2] == b"\xff\xd8":
        return _jpeg(read)
    return None


def _webp(head: bytes) -> tuple[int, int] | None:
    kind = head[12:16]
    if kind == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        return _positive(int.from_bytes(head[26:28], "little") & 0x3FFF, int.from_bytes(head[28:30], "little") & 0x3FFF)
    if kind == b"VP8L" and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return _positive((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if kind == b"VP8X":
        return _positive(int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1)
    return None


def _jpeg(read: Reader) -> tuple[int, int] | None:
    at = 2
    for _ in range(JPEG_MAX_SEGMENTS):
        seg = read(at, 9)
        if len(seg) < 4 or seg[0] != 0xFF:
            return None
        marker = seg[1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length
            at += 2
            continue
        if marker in _SOF:
            if len(seg) < 9:
                return None
            return _positive(int.from_bytes(seg[7:9], "big"), int.from_bytes(seg[5:7], "big"))
        if marker in (0xD9, 0xDA):  # end of image, or the scan: no frame header before it
            return None
        at += 2 + int.from_bytes(seg[2:4], "big")
    return None


def _positive(width: int, height: int) -> tuple[int, int] | None:
    return (width, height) if width > 0 and height > 0 else None
