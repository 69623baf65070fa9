"""The instance for a routed endpoint, one an instance answers whole (tokenizer, pooling,
scoring, audio, version: ``routing/endpoints.py``'s ``ROUTED``): the placement of a request
with a single leg, made here beside the generation legs' picks, so no instance is chosen
outside ``placement/``.

The pools are the ones the endpoint rule names (``roles_for``), in its order; each offers its
candidates by its own health rules (``InstancePool.candidates``: healthy ones not excluded,
else half-open, else every one not draining: panic routing), among the instances serving the
request's model. Pools with an instance in rotation that has not failed this request come
first; of those, tokenizer work (``spread``) competes across every pool on load, model work
goes to the first pool that has one. The pick among the candidates is the given policy's
(the forwarder's least-loaded: fewest requests in flight from this proxy, ties rotating).
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import ModelKey
from epd_proxy.instances.pool import InstancePool
from epd_proxy.routing.candidate import RoutingPolicy
from epd_proxy.wire.errors import ProxyError


def place_routed(pools: Mapping[str, InstancePool], roles: Sequence[str], policy: RoutingPolicy, *, spread: bool,
                 exclude: Collection[Instance] = (), models: Mapping[str, ModelKey] | None = None,
                 path: str = "") -> Instance:
    """The instance for one attempt at a routed endpoint (``path``, for the 503's words): among
    the candidates of ``roles``' pools serving the request's model (``models``: the key per
    role; None: any instance), never one in ``exclude`` while another is left. 503 when no
    pool has an instance serving it."""
    options: list[tuple[list[Instance], bool]] = []
    for role in roles:
        pool = pools.get(role)
        if not pool:
            continue
        key = None if models is None else models.get(role)
        try:
            candidates = pool.candidates(exclude, key)  # health, half-open, panic: the pool's rules
        except ProxyError:
            continue  # none of this role serves the model (or every one is draining)
        options.append((candidates, pool.reachable(exclude, key)))
    if not options:
        raise ProxyError(503, f"no {' or '.join(roles)} instance{_serving(models)} can answer {path}",
                         retryable=True)
    fresh = [c for c, reachable in options if reachable] or [c for c, _ in options]
    if len(fresh) == 1 or not spread:
        return policy.choose(fresh[0])
    return policy.choose([inst for candidates in fresh for inst in candidates])


def another_routed(pools: Mapping[str, InstancePool], roles: Sequence[str], exclude: Collection[Instance],
                   models: Mapping[str, ModelKey] | None) -> bool:
    """Whether an instance in rotation that serves the model and has not failed this request is
    left in ``roles``' pools: a retry would go somewhere new."""
    return any(pools[role].reachable(exclude, None if models is None else models.get(role))
               for role in roles if role in pools)


def _serving(models: Mapping[str, ModelKey] | None) -> str:
    if not models:
        return ""
    key = models.get("decode")
    return "" if key is None else f" serving model `{key if isinstance(key, str) else key[0]}`"
