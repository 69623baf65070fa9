import copy

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_proxy.request.legs.stage_bodies import (
    NIXL_PREFILL_PARAMS,
    decode_body,
    nixl_prefill_request_params,
    prefill_body,
    prompt_once,
)
from epd_proxy.wire.blobs import decode_chat_body, encode_json

P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def client_body(**extra):
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 64,
        "max_completion_tokens": 64,
        "min_tokens": 10,
        "min_completion_tokens": 10,
        "n": 2,
        "temperature": 0.2,
        **extra,
    }


def test_nixl_prefill_params():
    assert nixl_prefill_request_params() == P_PARAMS
    assert nixl_prefill_request_params("xfer-1") == {**P_PARAMS, "transfer_id": "xfer-1"}
    a = nixl_prefill_request_params()
    a["remote_host"] = "h"
    assert nixl_prefill_request_params() == P_PARAMS
    assert dict(NIXL_PREFILL_PARAMS) == P_PARAMS


def test_prefill_body_sanitises():
    body = client_body(kv_transfer_params={"stale": True}, ec_transfer_params={"e": 1})
    before = copy.deepcopy(body)
    kv = nixl_prefill_request_params()
    out = prefill_body(body, kv)
    assert out == {
        "model": "m",
        "messages": body["messages"],
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "n": 1,
        "temperature": 0.2,
        "kv_transfer_params": P_PARAMS,
        "ec_transfer_params": {"e": 1},
    }
    assert out["messages"] is body["messages"]
    assert body == before


def test_prefill_body_does_not_add_absent_fields():
    body = {"model": "m", "prompt": "Red Hat is ", "stream": False}
    out = prefill_body(body, None)
    assert out == {"model": "m", "prompt": "Red Hat is ", "stream": False, "max_tokens": 1}
    assert "max_completion_tokens" not in out and "n" not in out


def test_prefill_body_none_removes_client_kv_params():
    body = {"model": "m", "prompt": "x", "kv_transfer_params": {"remote_block_ids": [1]}}
    out = prefill_body(body, None)
    assert "kv_transfer_params" not in out
    assert body["kv_transfer_params"] == {"remote_block_ids": [1]}


def test_decode_body_omitted_keeps_client_values():
    body = client_body(kv_transfer_params={"client": 1}, ec_transfer_params={"client": 2})
    before = copy.deepcopy(body)
    out = decode_body(body)
    assert out == body and out is not body
    out = decode_body(body, ec={"ec_items": []})
    assert out["kv_transfer_params"] == {"client": 1}
    assert out["ec_transfer_params"] == {"ec_items": []}
    assert body == before


def test_decode_body_sets_and_removes():
    body = client_body(kv_transfer_params={"stale": 1}, ec_transfer_params={"stale": 2})
    before = copy.deepcopy(body)
    kv = {"remote_block_ids": [2]}
    out = decode_body(body, kv=kv, ec=None)
    assert out["kv_transfer_params"] is kv
    assert "ec_transfer_params" not in out
    # D keeps the client's sampling and stream settings.
    for key in ("stream", "stream_options", "max_tokens", "min_tokens", "n", "temperature"):
        assert out[key] == body[key]
    out = decode_body(body, kv=None)
    assert "kv_transfer_params" not in out
    assert out["ec_transfer_params"] == {"stale": 2}
    assert body == before


def test_retry_does_not_inherit_previous_params():
    """Attempt 2 with nothing from P/E carries no stale params (docs/protocol.md §5.1)."""
    body = client_body()
    before = copy.deepcopy(body)
    first = decode_body(body, kv={"remote_block_ids": [1]}, ec={"ec_items": [], "h": {}})
    assert first["kv_transfer_params"] == {"remote_block_ids": [1]}
    second = decode_body(body, kv=None, ec=None)
    assert "kv_transfer_params" not in second and "ec_transfer_params" not in second
    p2 = prefill_body(body, nixl_prefill_request_params())
    assert p2["kv_transfer_params"] == P_PARAMS
    assert body == before


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                     max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(prompt=_json, key=st.sampled_from(["messages", "prompt"]), extra=st.dictionaries(st.text(), _json, max_size=3))
def test_the_prompt_encoded_once_gives_both_legs_the_same_bytes(prompt, key, extra):
    body = {**extra, "model": "m", key: prompt, "max_tokens": 8}
    kv = msgspec.Raw(b'{"remote_engine_id":"p0"}')
    once = prompt_once(body)
    for made in (lambda b: prefill_body(b, nixl_prefill_request_params()), lambda b: decode_body(b, kv=kv)):
        assert encode_json(made(once)) == encode_json(made(body))
    assert body[key] is prompt  # the client body untouched (a retry starts from it)


def test_a_media_literal_in_the_prompt_is_written_back_verbatim():
    data = "data:image/png;base64," + "A" * 5000
    raw = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data}}]}]})
    body = decode_chat_body(raw)  # the literal left as a Blob
    once = prompt_once(body)
    assert isinstance(once["messages"], msgspec.Raw)
    assert encode_json(decode_body(once, kv=None)) == encode_json(decode_body(body, kv=None)) == raw


def test_a_body_without_a_prompt_is_left_as_it_is():
    body = {"model": "m"}
    assert prompt_once(body) is body
