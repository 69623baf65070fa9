"""The cluster's models: one :class:`~epd_proxy.instances.models.ModelCatalog` over every pool's
live instances, rebuilt when an instance's models or a pool's states change (the pools
say so), so a request reads a ready answer (``current``) and never walks the roster; and
each model's readiness as ``/status`` shows it (``model_readiness``, pure)."""

from __future__ import annotations

from typing import Protocol, Sequence

from epd_proxy.instances.health import DRAINING
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import DECIDING_ROLES, NOTHING_KNOWN, ModelCatalog, card_key, catalog_of


class Members(Protocol):
    """A pool, as far as the catalog reads it."""

    @property
    def role(self) -> str: ...
    @property
    def instances(self) -> Sequence[Instance]: ...


class ModelDirectory:
    """What the pools serve together. A draining instance serves nothing new, so its models
    leave the catalog with it; an ejected one still counts (it may come back, and panic
    routing may need it)."""

    def __init__(self) -> None:
        self._pools: list[Members] = []
        self.current: ModelCatalog = NOTHING_KNOWN
        # The model cards the instances hold, each once (models.parse_models): what a new answer
        # is matched against. Rebuilt from the cards still held when it has grown past twice
        # their number, so it never outgrows what the instances serve, however often adapters
        # come and go.
        self.cards: dict[tuple, dict] = {}

    def track(self, pool: Members) -> None:
        """A pool whose instances count (it calls ``changed`` on every change)."""
        self._pools.append(pool)
        self.changed()

    def changed(self) -> None:
        self.current = catalog_of((inst.served for pool in self._pools for inst in pool.instances
                                   if inst.health.state is not DRAINING), self._waiting())
        served = [inst.served for pool in self._pools for inst in pool.instances if inst.served is not None]
        held = {id(card): card for s in served for card in s.cards}
        if len(self.cards) > 2 * len(held) + 64:  # stale cards: rebuilt from the ones held
            self.cards = {card_key(card): card for card in held.values()}

    def _waiting(self) -> tuple[str, ...]:
        """The deciding roles that have instances (not draining), none of which has said what it serves."""
        out = []
        for pool in self._pools:
            if pool.role in DECIDING_ROLES and pool.role not in out:
                live = [i for i in pool.instances if i.health.state is not DRAINING]
                if live and all(i.served is None for i in live):
                    out.append(pool.role)
        return tuple(out)


def model_readiness(pools: dict[str, list[dict]], parents: dict[str, str | None],
                    required: Sequence[str]) -> dict[str, dict]:
    """Per model, for ``/status``: which roles have an instance serving it, in rotation or out
    (ejected, half-open; draining ones serve nothing new and are not counted), and whether a
    request for it can be served now. Pure, over ``pools`` as ``/status`` shows them (each
    instance's ``state``, ``healthy`` and ``models``; merged across ``--workers``, where
    ``healthy`` means in every worker's rotation), ``parents`` (the catalog's: an adapter's
    encoders are its base's) and ``required``, the topology's roles.

    ``ready``: every role a text request uses (the required ones but the encoders) has an
    instance serving the model in rotation; ``media``: the encoders serving its base have one
    too (None without an encode stage); ``why``: what is missing, else None."""
    counts: dict[str, dict[str, list[int]]] = {}  # model -> role -> [in rotation, out]
    unknown: dict[str, int] = {}  # role -> instances whose models are not known yet
    for role, instances in pools.items():
        for inst in instances:
            if inst["state"] == DRAINING:
                continue
            names = inst.get("models")
            if names is None:
                unknown[role] = unknown.get(role, 0) + 1
                continue
            slot = 0 if inst["healthy"] else 1
            for name in names:
                n = counts.setdefault(name, {}).setdefault(role, [0, 0])
                n[slot] += 1
    text_roles = [r for r in required if r != "encode"]
    out: dict[str, dict] = {}
    for name, by_role in counts.items():
        parent = parents.get(name)
        roles = {role: {"in_rotation": n[0], "out": n[1]} for role, n in by_role.items()}
        encoders = counts.get(parent or name, {}).get("encode")
        if encoders is not None:
            roles["encode"] = {"in_rotation": encoders[0], "out": encoders[1]}
        why = [_missing(role, roles.get(role)) for role in text_roles]
        media = None
        if "encode" in required:
            media_why = _missing("encode", roles.get("encode"))
            media = media_why is None
            if media_why is not None:
                why.append(media_why + " (requests with media are refused)")
        reasons = [w for w in why if w is not None]
        if reasons and unknown:
            reasons.append(f"instances that have not said what they serve yet may: "
                           f"{', '.join(f'{n} {r}' for r, n in unknown.items())}")
        ready = all(_missing(role, roles.get(role)) is None for role in text_roles)
        out[name] = {"parent": parent, "ready": ready, "media": media, "roles": roles,
                     "why": "; ".join(reasons) or None}
    return out


def _missing(role: str, n: dict | None) -> str | None:
    if n is None:
        return f"no {role} instance serves it"
    if not n["in_rotation"]:
        return f"no {role} instance serving it is in rotation ({n['out']} out)"
    return None
