"""A field of a ``multipart/form-data`` body (RFC 7578), read in place.

vLLM's audio endpoints (``/v1/audio/transcriptions``, ``/v1/audio/translations``) take a form:
the audio file and, beside it, the ``model`` the request is routed by. The proxy reads that
field (every occurrence of it: a form naming it twice is refused by the router) without
parsing the form into parts, so a file part's bytes are scanned, never copied. Pure.
"""

from __future__ import annotations

import re

_BOUNDARY = re.compile(rb'boundary=(?:"([^"]+)"|([^\s;]+))', re.IGNORECASE)
_FIELD_NAME = re.compile(rb'(?:^|\r\n)content-disposition:[^\r\n]*?;\s*name="([^"]*)"', re.IGNORECASE)


def form_field(body: bytes, content_type: bytes, name: bytes) -> str | None:
    """The text of form field ``name`` in a ``multipart/form-data`` body (RFC 7578): its first
    (:func:`form_fields`); None when the body has no such field or is not a well-formed form."""
    values = form_fields(body, content_type, name, first=True)
    return values[0] if values else None


def form_fields(body: bytes, content_type: bytes, name: bytes, first: bool = False) -> list[str | None]:
    """The texts of every form field ``name`` in a ``multipart/form-data`` body (RFC 7578),
    read in place: the parts are walked by their delimiter with ``bytes.find`` (a file part's
    bytes are scanned, never copied); only the fields' own values are sliced out (None for one
    that is not UTF-8). Empty when the body has none or is not a well-formed form; ``first``:
    stop at the first."""
    out: list[str | None] = []
    m = _BOUNDARY.search(content_type)
    if m is None:
        return out
    dash = b"--" + (m.group(1) or m.group(2))
    delimiter = b"\r\n" + dash
    if body.startswith(dash):  # the first delimiter may open the body without the CRLF before it
        at = len(dash)
    else:
        at = body.find(delimiter)
        if at < 0:
            return out
        at += len(delimiter)
    while body[at:at + 2] == b"\r\n":
        head_end = body.find(b"\r\n\r\n", at)
        if head_end < 0:
            return out
        end = body.find(delimiter, head_end)
        if end < 0:
            return out
        field = _FIELD_NAME.search(body, at, head_end)
        if field is not None and field.group(1) == name:
            try:
                out.append(body[head_end + 4:end].decode())
            except UnicodeDecodeError:
                out.append(None)
            if first:
                return out
        at = end + len(delimiter)
    return out
