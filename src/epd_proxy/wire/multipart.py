"""One field of a ``multipart/form-data`` body (RFC 7578), read in place.

vLLM's audio endpoints (``/v1/audio/transcriptions``, ``/v1/audio/translations``) take a form:
the audio file and, beside it, the ``model`` the request is routed by. The proxy reads that
one field without parsing the form into parts, so a file part's bytes are scanned, never
copied. Pure.
"""

from __future__ import annotations

import re

_BOUNDARY = re.compile(rb'boundary=(?:"([^"]+)"|([^\s;]+))', re.IGNORECASE)
_FIELD_NAME = re.compile(rb'(?:^|\r\n)content-disposition:[^\r\n]*?;\s*name="([^"]*)"', re.IGNORECASE)


def form_field(body: bytes, content_type: bytes, name: bytes) -> str | None:
    """The text of form field ``name`` in a ``multipart/form-data`` body (RFC 7578), read in
    place: the parts are walked by their delimiter with ``bytes.find`` (a file part's bytes
    are scanned, never copied); only the field's own value is sliced out. None when the body
    has no such field or is not a well-formed form."""
    m = _BOUNDARY.search(content_type)
    if m is None:
        return None
    dash = b"--" + (m.group(1) or m.group(2))
    delimiter = b"\r\n" + dash
    if body.startswith(dash):  # the first delimiter may open the body without the CRLF before it
        at = len(dash)
    else:
        at = body.find(delimiter)
        if at < 0:
            return None
        at += len(delimiter)
    while body[at:at + 2] == b"\r\n":
        head_end = body.find(b"\r\n\r\n", at)
        if head_end < 0:
            return None
        end = body.find(delimiter, head_end)
        if end < 0:
            return None
        field = _FIELD_NAME.search(body, at, head_end)
        if field is not None and field.group(1) == name:
            try:
                return body[head_end + 4:end].decode()
            except UnicodeDecodeError:
                return None
        at = end + len(delimiter)
    return None
