"""The endpoint → pool rule (pure)."""

import pytest

from epd_proxy.routing.endpoints import ROUTED, least_loaded_first, request_model, roles_for
from epd_proxy.wire.errors import ProxyError
from epd_proxy.wire.multipart import form_field, form_fields


def test_tokenizer_endpoints_go_to_prefill_or_decode_by_load():
    for path in ("/tokenize", "/detokenize", "/v1/messages/count_tokens", "/tokenizer_info"):
        assert roles_for(path) == ("decode", "prefill")
        assert least_loaded_first(path)


def test_model_endpoints_prefer_the_decode_pool():
    for path in ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                 "/v2/rerank", "/v1/audio/transcriptions", "/v1/audio/translations", "/generative_scoring"):
        assert roles_for(path)[0] == "decode"
        assert "encode" not in roles_for(path)
        assert not least_loaded_first(path)


def test_version_may_come_from_any_instance():
    assert roles_for("/version") == ("decode", "prefill", "encode")
    assert ROUTED["/version"].method == "GET"


def test_generation_and_unknown_paths_are_not_routed_here():
    for path in ("/v1/chat/completions", "/v1/completions", "/nope"):
        with pytest.raises(KeyError):
            roles_for(path)


# -- the request's model, read from the body ---------------------------------------------------

def _form(boundary: bytes, *parts: tuple[bytes, bytes], preamble: bytes = b"") -> bytes:
    out = preamble
    for head, value in parts:
        out += b"--" + boundary + b"\r\n" + head + b"\r\n\r\n" + value + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


def test_a_json_bodys_model_whatever_else_it_holds():
    assert request_model(b'{"input": ["x", {"y": [1, 2]}], "model": "emb"}', b"application/json") == "emb"
    assert request_model(b'{"model": 7}', None) == 7  # not a name: the instance's validation answers it
    for body in (b'{"input": "x"}', b"[1, 2]", b"not json", b""):
        assert request_model(body, b"application/json") is None


def test_a_forms_model_field_in_any_order():
    audio = bytes(range(256)) * 64 + b'name="model"\r\n\r\nfake'  # a file holding the field's own bytes
    file_part = (b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\nContent-Type: audio/wav', audio)
    model_part = (b'content-disposition: form-data; name="model"', b"whisper-b")
    for parts in ((file_part, model_part), (model_part, file_part)):
        body = _form(b"XyZ", *parts)
        assert request_model(body, b"multipart/form-data; boundary=XyZ") == "whisper-b"
        assert request_model(body, b'Multipart/Form-Data; boundary="XyZ"; charset=utf-8') == "whisper-b"
    body = _form(b"b1", file_part, preamble=b"a preamble\r\n")
    assert request_model(body, b"multipart/form-data; boundary=b1") is None
    with_model = _form(b"b1", file_part, model_part, preamble=b"a preamble\r\n")
    assert request_model(with_model, b"multipart/form-data; boundary=b1") == "whisper-b"


def test_a_form_naming_its_model_twice_is_refused():
    model_part = (b'content-disposition: form-data; name="model"', b"whisper-b")
    other = (b'content-disposition: form-data; name="model"', b"whisper-x")
    file_part = (b'content-disposition: form-data; name="file"; filename="a.wav"', b"RIFF")
    ctype = b"multipart/form-data; boundary=q"
    with pytest.raises(ProxyError) as err:
        request_model(_form(b"q", model_part, file_part, other), ctype)
    assert err.value.status == 400 and err.value.param == "model"
    assert form_fields(_form(b"q", model_part, file_part, other), ctype, b"model") == ["whisper-b", "whisper-x"]
    assert form_field(_form(b"q", model_part, other), ctype, b"model") == "whisper-b"
