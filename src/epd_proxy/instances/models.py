"""Pure: what an instance serves and which instances a request's model may go to.

An instance's models come from its own ``GET /v1/models`` (served names, and LoRA
adapters with ``parent``), optionally restricted by its ``models`` attribute; until it
has answered, it may take a request for any model the cluster serves (``None``), so a
cluster that has just started is not refused. A model no instance has listed is 404 at
once (the request's fault, never a reason to try instances that are out), unless a role
a request needs has not answered at all yet (503, not ready). The cluster's
:class:`ModelCatalog` is rebuilt when an instance's models or the roster change, never per
request: a request asks it once which filter key its legs use (``route``), and with one
set of models everywhere (the common case) the answer is "none" and the pools route as
if models did not exist.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Union

import msgspec

from epd_proxy.wire.errors import ProxyError

# What a leg's candidates must serve: a model id, or (adapter id, its base) when the
# other leg's instance showed which base the adapter sits on (KV computed with an
# adapter is valid only with that adapter on that base).
ModelKey = Union[str, tuple[str, str]]

# The roles whose models decide whether a request's model exists (an encoder serves a base
# its decodes list too).
DECIDING_ROLES = ("prefill", "decode")
# Model ids a 404 names at most.
NAMED_IN_404 = 20

_MISSING = object()


@dataclass(frozen=True, slots=True)
class Served:
    """What one instance serves: each id with its parent (None for a base model), and the
    model cards as it reported them (for the cluster's /v1/models)."""

    parents: dict[str, str | None]
    cards: tuple[dict, ...] = ()

    @property
    def names(self) -> list[str]:
        return list(self.parents)


def pinned(names: Iterable[str]) -> Served:
    """An instance's ``models`` attribute before it has answered /v1/models."""
    return Served({n: None for n in names}, tuple(_card(n) for n in names))


def card_key(card: dict) -> tuple:
    """What identifies a model card: vLLM makes ``created`` and each permission's id anew on
    every answer, so two answers about the same model differ only there."""
    parent = card.get("parent")
    return (card["id"], parent if isinstance(parent, str) else None, str(card.get("root")),
            str(card.get("max_model_len")), str(card.get("owned_by")))


def parse_models(body: bytes, only: tuple[str, ...] = (), held: dict[tuple, dict] | None = None) -> Served:
    """A ``/v1/models`` answer (vLLM's ``ModelList``); with ``only`` (the ``models``
    attribute), just those ids and the adapters whose parent is one of them. ``held``: the
    cards already held (``card_key`` → card), so that every instance reporting a model keeps
    the same card and id objects (hundreds of instances × their adapters would otherwise each
    keep a copy), and an answer that says nothing new equals the last one. ValueError when
    the body is not a model list."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        raise ValueError("no 'data' list")
    parents: dict[str, str | None] = {}
    kept = []
    for card in cards:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str) or card["id"] in parents:
            continue
        parent = card.get("parent") if isinstance(card.get("parent"), str) else None
        if only and card["id"] not in only and parent not in only:
            continue
        if held is not None:
            card = held.setdefault(card_key(card), card)
        parents[card["id"]] = parent
        kept.append(card)
    return Served(parents, tuple(kept))


def serves(served: Served | None, key: ModelKey) -> bool:
    """Whether an instance may take a leg for ``key`` (unknown models: it may)."""
    if served is None:
        return True
    if isinstance(key, str):
        return key in served.parents
    name, parent = key
    return served.parents.get(name, _MISSING) == parent


def paired_key(key: ModelKey, served: Served | None) -> ModelKey:
    """The key of the other leg once one instance is chosen: an adapter must sit on the same
    base there (a base model, or an instance whose models are unknown, adds nothing)."""
    if served is None or not isinstance(key, str):
        return key
    parent = served.parents.get(key)
    return key if parent is None else (key, parent)


@dataclass(frozen=True, slots=True)
class ModelCatalog:
    """The models of the live instances, as one request needs them."""

    parents: dict[str, str | None] = field(default_factory=dict)  # every id known, first parent seen
    cards: tuple[dict, ...] = ()  # the union, each id once
    open: bool = True  # an instance whose models are not known yet (or no instance at all)
    uniform: bool = True  # every known instance serves the same ids on the same bases
    waiting: tuple[str, ...] = ()  # DECIDING_ROLES with instances none of which has answered yet

    @property
    def bases(self) -> list[str]:
        return [n for n, p in self.parents.items() if p is None]

    def route(self, model: object) -> dict[str, ModelKey] | None:
        """The key each role's candidates must serve for a request naming ``model`` (the
        body's, None when it has none); None when every candidate serves it anyway and it is
        no adapter (an adapter's key is what its placement reads: ``routing/lora_affinity.py``).
        404 for a model no instance serves, 400 without a model when there is a choice; 503
        for a model not listed while a role has not said what it serves yet."""
        if type(model) is str:
            if model in self.parents:  # an adapter's legs are keyed even so: its placement reads the key
                return None if self.uniform and self.parents[model] is None else self._keys(model)
            if not self.parents:  # nothing known at all: every instance may serve it, and answers
                return None
            if self.waiting:
                roles = " or ".join(self.waiting)
                raise ProxyError(503, f"not ready: no {roles} instance has said which models it serves yet, "
                                      f"and none that has lists `{model}`; retry shortly", param="model")
            raise self.not_found(model)
        if model is not None:
            return None  # not a string: the instance's validation answers it
        bases = self.bases
        if len(bases) == 1 or (not bases and self.open):
            return None if self.uniform or not bases else self._keys(bases[0])
        raise ProxyError(400, f"the request names no model and this cluster serves several: "
                              f"{', '.join(bases)}; give one in 'model'", param="model")

    def not_found(self, model: str, names: list[str] | None = None) -> ProxyError:
        """vLLM's 404 for ``model``, naming (the first ``NAMED_IN_404`` of) the ids served, or of
        ``names`` (those the caller's key may use)."""
        names = list(self.parents) if names is None else names
        served = ", ".join(names[:NAMED_IN_404])
        if len(names) > NAMED_IN_404:
            served += f" and {len(names) - NAMED_IN_404} more"
        listed = f" This cluster serves: {served} (GET /v1/models lists them)." if names else ""
        return ProxyError(404, f"The model `{model}` does not exist.{listed}", type="NotFoundError", param="model",
                          code="model_not_found")

    def _keys(self, model: str) -> dict[str, ModelKey]:
        """Per role: decode and prefill serve the id itself; an encoder, its base."""
        parent = self.parents.get(model)
        return {"decode": model, "prefill": model, "encode": parent or model}

    def card(self, model: str) -> dict | None:
        for card in self.cards:
            if card.get("id") == model:
                return card
        return None


NOTHING_KNOWN = ModelCatalog()


def catalog_of(served: Iterable[Served | None], waiting: tuple[str, ...] = ()) -> ModelCatalog:
    """The catalog over the live instances' models (None: not known yet); ``waiting``: the
    deciding roles none of whose instances has answered yet."""
    parents: dict[str, str | None] = {}
    cards: list[dict] = []
    open_ = False
    first: dict[str, str | None] | None = None
    uniform = True
    count = 0
    for s in served:
        count += 1
        if s is None:
            open_ = True
            continue
        if first is None:
            first = s.parents
        elif s.parents != first:
            uniform = False
        for card in s.cards:
            if card["id"] not in parents:
                parents[card["id"]] = s.parents[card["id"]]
                cards.append(card)
        for name, parent in s.parents.items():  # pinned names without a card
            parents.setdefault(name, parent)
    return ModelCatalog(parents, tuple(cards), open_ or count == 0, uniform, waiting)


def models_list(cards: Iterable[dict]) -> bytes:
    """The ``/v1/models`` answer over ``cards``, in vLLM's shape."""
    return msgspec.json.encode({"object": "list", "data": list(cards)})


def _card(name: str) -> dict:
    """A model card for a pinned name its instance has not described yet."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": name,
            "parent": None, "max_model_len": None, "permission": []}
