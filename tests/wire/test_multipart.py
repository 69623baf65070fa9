"""A form's field read in place (pure)."""

from epd_proxy.wire.multipart import form_field


def _form(boundary: bytes, *parts: tuple[bytes, bytes]) -> bytes:
    out = b""
    for head, value in parts:
        out += b"--" + boundary + b"\r\n" + head + b"\r\n\r\n" + value + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


def test_a_field_after_a_file_part_holding_its_bytes():
    audio = bytes(range(256)) * 16 + b'name="model"\r\n\r\nfake'
    body = _form(b"b", (b'content-disposition: form-data; name="file"; filename="a.wav"', audio),
                 (b'content-disposition: form-data; name="model"', b"whisper"),
                 (b'content-disposition: form-data; name="language"', b"de"))
    ctype = b"multipart/form-data; boundary=b"
    assert form_field(body, ctype, b"model") == "whisper"
    assert form_field(body, ctype, b"language") == "de"
    assert form_field(body, ctype, b"prompt") is None


def test_a_broken_form_names_no_model():
    ctype = b"multipart/form-data; boundary=q"
    assert form_field(b'--q\r\ncontent-disposition: form-data; name="model"\r\n\r\nm', ctype, b"model") is None
    assert form_field(b"--q--\r\n", ctype, b"model") is None
    assert form_field(b"whatever", b"multipart/form-data", b"model") is None  # no boundary
    assert form_field(_form(b"q", (b'content-disposition: form-data; name="model"', b"\xff")), ctype,
                      b"model") is None
