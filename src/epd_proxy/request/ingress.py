"""The front door of one request: the body parsed (with the fields the proxy owns dropped)
and the request's ids, before any upstream work."""

from __future__ import annotations

import sys

import msgspec

from epd_proxy.http.response import Request
from epd_proxy.wire.blobs import decode_chat_body
from epd_proxy.wire.errors import ProxyError, bad_request
from epd_proxy.wire.ids import hex_id

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# Body fields that are the proxy's own protocol with the engines (docs/protocol.md §2.4, §2.5): a client's
# value would steer a KV or EC transfer (e.g. make decode pull KV from a host of the
# client's choosing), so it is dropped on every path, not rejected: vLLM's own request
# model serialises both as ``null``, and clients built on it must keep working.
PROXY_OWNED_FIELDS = ("kv_transfer_params", "ec_transfer_params")

# Python frames the request path may add above ``parse_body`` before it encodes the body
# again (msgspec recurses on nesting and counts against the recursion limit): a body is
# decoded only if it could be re-encoded that much deeper.
_DEPTH_HEADROOM = 100


def _decode_json(raw: bytes, chat: bool):
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit - _DEPTH_HEADROOM)
    try:
        return decode_chat_body(raw) if chat else msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    finally:
        sys.setrecursionlimit(limit)


def parse_body(req: Request, path: str) -> dict:
    """The client's JSON body, validated just enough to route it (vLLM validates the rest).

    Fields the proxy owns (:data:`PROXY_OWNED_FIELDS`) are removed here, once, so no
    stage can pass a client's value on.
    """
    ctype = (req.headers.get(b"content-type") or b"").split(b";", 1)[0].strip().lower()
    if ctype != b"application/json":
        raise ProxyError(415, "Content-Type must be application/json")
    body = _decode_json(req.body, path == CHAT)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    for key in PROXY_OWNED_FIELDS:
        body.pop(key, None)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_request("'prompt' is required", "prompt")
        if not isinstance(prompt, (str, list)):
            raise bad_request("'prompt' must be a string or a list", "prompt")
    return body


# A client's X-Request-Id is echoed and sent to every stage only if it is a short token
# (no spaces, commas, quotes or bytes outside ASCII): it ends up in engine request ids,
# log lines and our own derived ids (``<rid>:<k>:<rand>``).
MAX_REQUEST_ID = 128
_REQUEST_ID_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.:~+=@"


def client_request_id(req: Request) -> bytes | None:
    """The client's ``X-Request-Id`` if it is safe to echo and pass on byte for byte."""
    raw = req.headers.get(b"x-request-id")
    if raw and len(raw) <= MAX_REQUEST_ID and not raw.translate(None, _REQUEST_ID_CHARS):
        return raw
    return None


def request_id(req: Request) -> str:
    """The client's ``X-Request-Id`` if it is safe, else a fresh one."""
    raw = client_request_id(req)
    return raw.decode("ascii") if raw is not None else hex_id()
