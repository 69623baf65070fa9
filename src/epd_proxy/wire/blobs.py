"""Large media strings kept as the bytes they arrived as.

A chat body with one 150 KB image is about 200 KB of JSON, nearly all of it
one base64 ``data:`` URL. Decoding it into a Python ``str``, hashing that
string for the content uuid and encoding it again into the encoder's
sub-request were three passes over the same bytes, each on the request's
critical path, and none of them changes a byte.

:func:`decode_chat_body` lifts such string literals out of the raw body
before the (now small) rest is decoded, and puts a :class:`Blob` where each
was: a view of the literal in the client's own buffer. The content uuid
hashes the view in place, and :func:`encode_json` writes the literal back
verbatim wherever the part goes (encoder, prefill, decode).

Only literals that JSON-decode to exactly their own bytes are lifted: ASCII,
no backslash, and valid JSON (checked by msgspec without building a ``str``:
a raw control byte would otherwise travel on as invalid JSON). A literal that
fails stays in the body, whose decode then fails as a plain decode would.
The rest of the body is decoded and validated as before. Anything
unexpected — a lifted literal
that is not a media payload, a non-chat body — falls back to a plain decode,
so the result is always what :func:`msgspec.json.decode` would have given,
with ``Blob`` in place of some ``str``.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

# Literals shorter than this are decoded normally: lifting them saves nothing.
MIN_BLOB = 1024

# What replaces a lifted literal in the JSON that is decoded. The nonce keeps
# a client from naming one in its own text.
_MARK = "\x00" + os.urandom(8).hex() + ":"
_MARK_JSON = b'"\\u0000' + _MARK[1:].encode() + b"%d" + b'"'

_OPEN = b'"data'
# Media whose payload is {"url": ...} (and, for images, also a bare string).
URL_MEDIA_TYPES = ("image_url", "audio_url", "video_url")


class Blob:
    """A JSON string literal of the client's body, quotes included, unparsed.

    Stands where the decoded ``str`` would be: :func:`is_text` accepts it,
    :attr:`value` is the string's UTF-8 (which, for a lifted literal, is the
    literal without its quotes) and :func:`encode_json` writes it back as is.
    """

    __slots__ = ("literal",)

    def __init__(self, literal: memoryview) -> None:
        self.literal = literal

    @property
    def value(self) -> memoryview:
        return self.literal[1:-1]

    def __len__(self) -> int:
        return len(self.literal) - 2

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Blob):
            return self.literal == other.literal
        if isinstance(other, str):
            return self.value == other.encode("utf-8")
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = bytes(self.value[:32]).decode("ascii", "replace")
        return f"Blob({head!r}... {len(self)} bytes)"


def is_text(value: object) -> bool:
    """A JSON string in a decoded body: a ``str`` or a lifted :class:`Blob`."""
    return isinstance(value, (str, Blob))


def text_bytes(value: str | Blob) -> bytes | memoryview:
    """The UTF-8 of a JSON string, without a copy for a :class:`Blob`."""
    return value.value if isinstance(value, Blob) else value.encode("utf-8")


def _enc_hook(obj: object) -> Any:
    if isinstance(obj, Blob):
        return msgspec.Raw(obj.literal)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)
# Validates one string literal (a raw control byte is the only way an ASCII literal
# without a backslash can be invalid) in one pass, without decoding it.
_check_literal = msgspec.json.Decoder(msgspec.Raw).decode
_sorted_encoder = msgspec.json.Encoder(enc_hook=_enc_hook, order="sorted")

encode_json = _encoder.encode
"""``msgspec.json.encode`` that writes a :class:`Blob` back verbatim."""

encode_json_sorted = _sorted_encoder.encode
"""The same, with object keys sorted (for content hashes)."""


def _lift(raw: bytes) -> tuple[bytes, list[memoryview]] | None:
    """``raw`` with each large ``"data…"`` literal replaced by a marker, and the
    literals (views into ``raw``), or None when there is none to lift."""
    find = raw.find
    pos = find(_OPEN)
    if pos < 0:
        return None
    view = memoryview(raw)
    ascii_body = raw.isascii()  # one pass, no copy; else each literal is checked on its own
    pieces: list = []
    literals: list[memoryview] = []
    start = 0
    while pos >= 0:
        # "data:..." (a data URL) or "data": "..." (input_audio's payload).
        after = raw[pos + 5:pos + 6]
        opening = -1
        if after == b":":
            opening = pos
        elif after == b'"' and raw[pos - 1:pos] != b"\\":
            opening = find(b'"', pos + 6)
            if opening >= 0 and raw[pos + 6:opening].strip(b" \t\r\n") != b":":
                opening = -1
        if opening < 0:
            pos = find(_OPEN, pos + 5)
            continue
        end = find(b'"', opening + 1)
        if end < 0:
            break
        if (end - opening > MIN_BLOB and raw[opening - 1:opening] != b"\\"
                and find(b"\\", opening, end) < 0 and (ascii_body or raw[opening:end].isascii())
                and _valid(view[opening:end + 1])):
            pieces.append(view[start:opening])
            pieces.append(_MARK_JSON % len(literals))
            literals.append(view[opening:end + 1])
            start = end + 1
        pos = find(_OPEN, end + 1)
    if not literals:
        return None
    pieces.append(view[start:])
    return b"".join(pieces), literals


def _valid(literal: memoryview) -> bool:
    try:
        _check_literal(literal)
    except msgspec.DecodeError:
        return False
    return True


def _restore(body: Any, literals: list[memoryview]) -> bool:
    """Put each literal back, as a :class:`Blob`, where its marker is; True if
    every marker was found exactly once, and only in a media payload."""
    if not isinstance(body, dict):
        return False
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    seen = [False] * len(literals)
    clash = False

    def take(value: object) -> Blob | None:
        nonlocal clash
        if not isinstance(value, str) or not value.startswith(_MARK):
            return None
        try:
            i = int(value[len(_MARK):])
        except ValueError:
            i = -1
        if not 0 <= i < len(literals) or seen[i]:
            clash = True  # a marker this decode did not write
            return None
        seen[i] = True
        return Blob(literals[i])

    def put(container: dict, key: str) -> None:
        blob = take(container.get(key))
        if blob is not None:
            container[key] = blob

    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            payload = part.get(kind) if kind in URL_MEDIA_TYPES or kind == "input_audio" else None
            if isinstance(payload, dict):
                put(payload, "data" if kind == "input_audio" else "url")
            elif kind == "image_url":
                put(part, kind)
    return not clash and all(seen)


def decode_chat_body(raw: bytes) -> Any:
    """``msgspec.json.decode(raw)``, with large media strings left as :class:`Blob`.

    Raises :class:`msgspec.DecodeError` exactly when a plain decode would.
    """
    lifted = _lift(raw)
    if lifted is not None:
        small, literals = lifted
        try:
            body = msgspec.json.decode(small)
        except msgspec.DecodeError:
            body = None
        if body is not None and _restore(body, literals):
            return body
    return msgspec.json.decode(raw)
