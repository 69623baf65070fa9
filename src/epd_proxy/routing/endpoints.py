"""Which pool answers each of vLLM's endpoints besides generation: the rule as one table.

Generation (chat, completions) runs the pipeline's E→P→D path. Every other endpoint the
proxy routes is answered by one instance, and what it needs decides the pool:

* ``tokenizer``: the model's tokenizer, which every prefill and decode instance has: the
  least loaded of the two pools' choices answers (an encoder may run only the vision part);
* ``model``: the whole model run to an answer (pooling, scoring, audio transcription): the
  decode pool, whose instances run the full model (in PD and E+PD they are the PD
  instances); prefill instances as a fallback when decode has none;
* ``any``: facts about the deployment (``/version``): any instance, decode first.

Within those pools, only the instances serving the request's model answer (its ``model``:
a JSON body's field, a multipart body's form field; a GET route names none): the forwarder
asks the cluster's catalog for the key each role must serve, as generation does.

Pure: a table, a lookup, and the model read from a body without copying it (a form's
fields by ``wire/multipart.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from epd_proxy.wire.errors import ProxyError
from epd_proxy.wire.multipart import form_fields


class Endpoint(NamedTuple):
    method: str
    need: str  # tokenizer | model | any


ROUTED: dict[str, Endpoint] = {
    "/tokenize": Endpoint("POST", "tokenizer"),
    "/detokenize": Endpoint("POST", "tokenizer"),
    "/v1/messages/count_tokens": Endpoint("POST", "tokenizer"),
    "/tokenizer_info": Endpoint("GET", "tokenizer"),
    "/v1/embeddings": Endpoint("POST", "model"),
    "/v2/embed": Endpoint("POST", "model"),
    "/pooling": Endpoint("POST", "model"),
    "/classify": Endpoint("POST", "model"),
    "/score": Endpoint("POST", "model"),
    "/v1/score": Endpoint("POST", "model"),
    "/rerank": Endpoint("POST", "model"),
    "/v1/rerank": Endpoint("POST", "model"),
    "/v2/rerank": Endpoint("POST", "model"),
    "/v1/audio/transcriptions": Endpoint("POST", "model"),
    "/v1/audio/translations": Endpoint("POST", "model"),
    "/generative_scoring": Endpoint("POST", "model"),
    "/version": Endpoint("GET", "any"),
}

# The pools to consider, in order of preference, per need.
_ROLES = {
    "tokenizer": ("decode", "prefill"),
    "model": ("decode", "prefill"),
    "any": ("decode", "prefill", "encode"),
}


def roles_for(path: str) -> tuple[str, ...]:
    """The roles whose instances may answer ``path``, preferred first. KeyError for a path
    that is not routed."""
    return _ROLES[ROUTED[path].need]


def least_loaded_first(path: str) -> bool:
    """Whether the candidates of every role compete on load (any instance gives the same
    answer and the work is small), rather than the first role with an instance winning."""
    return ROUTED[path].need == "tokenizer"


class _Named(msgspec.Struct):
    """A JSON body as far as routing reads it: every other field is skipped, not built."""

    model: object = None


_DECODE_NAMED = msgspec.json.Decoder(_Named).decode


def request_model(body: bytes, content_type: bytes | None) -> object:
    """The model a routed request names: a JSON object's ``model`` (whatever its type: the
    instance validates it), a multipart form's ``model`` field (audio), else None (no body,
    not JSON, no such field). ProxyError 400 for a form naming it twice: a server may take
    another than the one checked and routed on."""
    if not body:
        return None
    if content_type is not None and content_type[:19].lower() == b"multipart/form-data":
        values = form_fields(body, content_type, b"model")
        if len(values) > 1:
            raise ProxyError(400, "the form has more than one 'model' field; send it once", param="model")
        return values[0] if values else None
    try:
        return _DECODE_NAMED(body).model
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
