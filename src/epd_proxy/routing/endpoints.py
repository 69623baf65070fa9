"""Which pool answers each of vLLM's endpoints besides generation: the rule as one table.

Generation (chat, completions) runs the pipeline's E→P→D path. Every other endpoint the
proxy routes is answered by one instance, and what it needs decides the pool:

* ``tokenizer``: the model's tokenizer, which every prefill and decode instance has: the
  least loaded of the two pools' choices answers (an encoder may run only the vision part);
* ``model``: the whole model run to an answer (pooling, scoring, audio transcription): the
  decode pool, whose instances run the full model (in PD and E+PD they are the PD
  instances); prefill instances as a fallback when decode has none;
* ``any``: facts about the deployment (``/version``): any instance, decode first.

Pure: a table and a lookup, so the choice can take the request's model later.
"""

from __future__ import annotations

from typing import NamedTuple


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


def roles_for(path: str, model: str | None = None) -> tuple[str, ...]:
    """The roles whose instances may answer ``path``, preferred first (``model``: for the
    model-aware choice to come; every instance serves the one model today). KeyError for a
    path that is not routed."""
    return _ROLES[ROUTED[path].need]


def least_loaded_first(path: str) -> bool:
    """Whether the candidates of every role compete on load (any instance gives the same
    answer and the work is small), rather than the first role with an instance winning."""
    return ROUTED[path].need == "tokenizer"
