"""Pure: model aliases, the cluster file's ``[model_aliases]`` table.

::

    [model_aliases]
    default = "qwen3-8b"           # a name the cluster does not serve goes here (optional)
    listed = "both"                # /v1/models shows: "served" (default), "aliases", "both"

    [model_aliases.names]
    "claude-sonnet-4" = "qwen3-8b" # an agent configured for another vendor's model
    "gpt-4o" = "qwen3-8b-lora-x"   # an alias may name a LoRA adapter

A request's ``model`` is resolved once, before routing (``request/pipeline.py`` and
``request/forward.py``): an alias becomes its target; a name no live instance serves
becomes ``default`` when one is set (while no instance has said what it serves, nothing is
unknown and only aliases apply). The answer keeps the served model's name, as vLLM writes
it. ``/v1/models`` lists what ``listed`` says: the served models, the aliases (each a copy
of its target's card under the alias's id), or both. A key's model list (``[tenants]``) is
checked on the model that runs (:func:`may_use`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epd_proxy.config import ConfigErrors

LISTED = ("served", "aliases", "both")


@dataclass(frozen=True, slots=True)
class ModelAliases:
    names: dict[str, str] = field(default_factory=dict)
    default: str | None = None
    listed: str = "served"

    def resolve(self, model: object, catalog) -> object:
        """The model a request naming ``model`` is served by (``catalog``: the cluster's, its
        ``parents`` every id served, ``open`` while some instance has not said)."""
        if type(model) is not str:
            return model
        target = self.names.get(model)
        if target is not None:
            return target
        if self.default is not None and not catalog.open and model not in catalog.parents:
            return self.default
        return model

    def cards(self, cards: tuple[dict, ...]) -> list[dict]:
        """``/v1/models``' cards: the served ones, the aliases' or both (``listed``)."""
        if self.listed == "served" or not self.names:
            return list(cards)
        by_id = {c.get("id"): c for c in cards}
        aliases = [dict(by_id[target], id=alias) for alias, target in self.names.items() if target in by_id]
        return aliases if self.listed == "aliases" else list(cards) + aliases


def may_use(allowed: frozenset[str], aliases: ModelAliases | None, asked: object, served: object) -> bool:
    """Whether a key whose list is ``allowed`` may run ``served``, the model a request naming
    ``asked`` resolved to: the served model is in the list, or the name asked for is an alias
    in the list whose target it is. A name in the list that resolved elsewhere (an unknown name
    sent to ``[model_aliases] default``) lets nothing through: the list is checked on the model
    that runs."""
    if served in allowed:
        return True
    return asked in allowed and aliases is not None and aliases.names.get(asked) == served


def read_aliases(table: object, source: str = "model_aliases") -> ModelAliases:
    """The ``[model_aliases]`` table; ``ConfigErrors`` lists every mistake."""
    if not isinstance(table, dict):
        raise ConfigErrors([f"{source} must be a table, got {table!r}"])
    errors = [f"{source}: unknown key {k!r} (one of default, listed, names)" for k in table
              if k not in ("default", "listed", "names")]
    names = table.get("names", {})
    if not isinstance(names, dict):
        errors.append(f"{source}.names must be a table of alias = \"served model\", got {names!r}")
        names = {}
    for alias, target in names.items():
        if not isinstance(target, str) or not target:
            errors.append(f"{source}.names.{alias} must name a served model, got {target!r}")
        elif target in names:
            errors.append(f"{source}.names.{alias}: {target!r} is an alias itself (aliases do not chain)")
    default = table.get("default")
    if default is not None and (not isinstance(default, str) or not default):
        errors.append(f"{source}.default must name a served model, got {default!r}")
    listed = table.get("listed", "served")
    if listed not in LISTED:
        errors.append(f"{source}.listed must be one of {', '.join(LISTED)}, got {listed!r}")
    if errors:
        raise ConfigErrors(errors)
    return ModelAliases({k: v for k, v in names.items()}, default, listed)
