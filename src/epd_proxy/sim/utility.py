"""The simulator's endpoints besides generation that vLLM 0.32 answers in one piece:
``/tokenize``, ``/detokenize`` and ``/v1/embeddings``, with vLLM's shapes
(``serve/tokenize/protocol.py``, ``pooling/embed/protocol.py``).

The tokenizer is ``tokens.py``'s: ``/tokenize`` gives the ids the prefix cache uses and the
count generation reports as ``prompt_tokens``. The simulated chat template renders no
generation prompt there; a chat ``/tokenize`` that asks for one by name
(``add_generation_prompt: true``, without ``continue_final_message``) gets the assistant
message's header, its role token, at the end, as a real template's generation prompt is the
header a final assistant message continued with ``continue_final_message`` starts with (so the
difference of the two is the continued text's tokens). A word's id is a crc32, so ``/detokenize``
reads ids back through the words tokenized so far in this process (every instance of a
cluster shares them, as they share one real tokenizer); the ids below ``len(VOCAB)`` are the
output tokens. An id never seen is out of vocabulary: vLLM's 400. Pure functions of the body
(and that table): each returns ``(status, body)``.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import time
import zlib

import msgspec

from epd_proxy.sim.config import SimConfig
from epd_proxy.sim.responses import api_error_body
from epd_proxy.sim.tokens import VOCAB, PromptError, analyze, prompt_token_ids
from epd_proxy.sim.validation import ApiError

_encode = msgspec.json.encode
EMBEDDING_DIM = 8  # the simulated model's hidden size
_MAX_KNOWN = 1 << 16  # words remembered for /detokenize (a test cluster's vocabulary)
_words: dict[int, str] = {}
PATHS = ("/tokenize", "/detokenize", "/v1/embeddings")


def answer(path: str, raw: bytes, config: SimConfig, request_id: str) -> tuple[int, bytes]:
    """The answer to a POST on one of ``PATHS``."""
    if path == "/v1/embeddings":
        return embeddings(raw, config, request_id)
    return tokenize(raw, config) if path == "/tokenize" else detokenize(raw, config)


def _remember(ids: list[int], texts: list[str]) -> None:
    """The words just tokenized, kept for /detokenize: the latest ``_MAX_KNOWN``, the oldest
    forgotten first (a long-lived simulator keeps reading back what it tokenized lately)."""
    for t, text in zip(ids, texts):
        _words.pop(t, None)
        _words[t] = text
    while len(_words) > _MAX_KNOWN:
        del _words[next(iter(_words))]


def _bad(message: str, param: str | None = None) -> tuple[int, bytes]:
    return 400, api_error_body(ApiError(400, message, "BadRequestError", param))


def _decode(raw: bytes) -> dict | tuple[int, bytes]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return _bad(f"JSON decode error: {exc}")
    if not isinstance(body, dict):
        return _bad("the request body must be a JSON object")
    return body


def _model_error(body: dict, config: SimConfig) -> tuple[int, bytes] | None:
    model = body.get("model")
    if config.check_model and model is not None and model not in config.served_names:
        return 404, api_error_body(ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model"))
    return None


def tokenize(raw: bytes, config: SimConfig) -> tuple[int, bytes]:
    """``POST /tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    body = _decode(raw)
    if isinstance(body, tuple):
        return body
    refused = _model_error(body, config)
    if refused is not None:
        return refused
    chat = "messages" in body
    if not chat and not isinstance(body.get("prompt"), str):
        return _bad("'prompt' must be a string", "prompt")
    try:
        prompt = analyze(body, chat)
    except PromptError as exc:
        return _bad(str(exc))
    ids = prompt_token_ids(body, chat, prompt)
    strs = _token_strs(body, chat)
    if chat and body.get("add_generation_prompt") is True and body.get("continue_final_message") is not True:
        ids.append(zlib.crc32(b"\x00role:assistant"))
        strs.append("<|assistant|>")
    if len(strs) == len(ids):
        _remember(ids, strs)
    return 200, _encode({"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids,
                         "token_strs": strs if body.get("return_token_strs") is True else None})


def _token_strs(body: dict, chat: bool) -> list[str]:
    """The text of each id ``prompt_token_ids`` gives, for the words and the role markers."""
    if not chat:
        return body["prompt"].split() or [""]
    out: list[str] = []
    for msg in body["messages"]:
        out.append(f"<|{msg['role']}|>")
        content = msg.get("content")
        if isinstance(content, str):
            out += content.split()
        elif isinstance(content, list):
            for part in content:
                if part.get("type") == "text":
                    out += part["text"].split()
                else:
                    return []  # media placeholders: not remembered
    return out


def detokenize(raw: bytes, config: SimConfig) -> tuple[int, bytes]:
    """``POST /detokenize``: ``{"prompt"}``, the words tokenized before joined by spaces,
    output tokens as they are."""
    body = _decode(raw)
    if isinstance(body, tuple):
        return body
    refused = _model_error(body, config)
    if refused is not None:
        return refused
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return _bad("'tokens' must be a list of non-negative integers", "tokens")
    pieces: list[str] = []
    for t in ids:
        if t < len(VOCAB):
            pieces.append(VOCAB[t])
        elif t in _words:
            pieces.append((" " if pieces else "") + _words[t])
        else:
            return _bad(f"Token id {t} is out of vocabulary", "tokens")
    return 200, _encode({"prompt": "".join(pieces)})


def embeddings(raw: bytes, config: SimConfig, request_id: str) -> tuple[int, bytes]:
    """``POST /v1/embeddings``: one unit vector per input, derived from its text or ids."""
    body = _decode(raw)
    if isinstance(body, tuple):
        return body
    refused = _model_error(body, config)
    if refused is not None:
        return refused
    inputs = body.get("input")
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and all(isinstance(t, int) for t in inputs)):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, (str, list)) for i in inputs):
        return _bad("'input' must be a string, a list of strings or token ids", "input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        return _bad("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    data, tokens = [], 0
    for index, item in enumerate(inputs):
        key = item.encode("utf-8") if isinstance(item, str) else b",".join(b"%d" % t for t in item)
        tokens += max(len(item.split()), 1) if isinstance(item, str) else len(item)
        vector = _unit_vector(key)
        embedding: list[float] | str = vector
        if fmt == "base64":
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"index": index, "object": "embedding", "embedding": embedding})
    return 200, _encode({"id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
                         "model": config.model, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                   "prompt_tokens_details": None}})


def _unit_vector(key: bytes) -> list[float]:
    digest = hashlib.sha256(key).digest()
    values = [(zlib.crc32(digest + bytes([i])) / 0xFFFFFFFF) * 2 - 1 for i in range(EMBEDDING_DIM)]
    norm = sum(v * v for v in values) ** 0.5 or 1.0
    return [v / norm for v in values]
