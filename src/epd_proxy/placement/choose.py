"""One leg's instance: the rules that pick among a role's instances, with the reason.

The role's host set (``instances/pool.py``) says which instances may take a request (healthy
ones not excluded, else half-open ones, else every one not draining: panic routing); this
module picks among them, in this order:

* the half-open trial share: every ``HALF_OPEN_SHARE``-th pick of a role with a half-open
  instance goes to it, so a limited share of live traffic decides whether it comes back;
* LoRA affinity: an adapter's requests concentrated on few of its instances
  (``routing/lora_affinity.py``), when the role has it and the request names an adapter;
* the role's routing policy (``routing/``) over the candidates, seeing the request's view;
* never an instance that timed out on this request: another pick without it, or a 504 when
  every instance left did.

Each pick says why (``Choice.reason``): the console's waterfall and the debug log show it.
The host lists read here are replaced, never changed in place, on every change of state, so a
pick reads one consistent snapshot; the only state written is the trial share's counter and
the policies' own (cursors, rendezvous maps).
"""

from __future__ import annotations

from typing import Collection, Sequence

from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import ModelKey
from epd_proxy.instances.pool import InstancePool
from epd_proxy.routing.view import EMPTY_VIEW, RequestView
from epd_proxy.wire.errors import ProxyError

# A half-open instance gets one pick in this many while others are in rotation.
HALF_OPEN_SHARE = 5

# Why a leg went where it went (Placement's reasons).
TRIAL = "half-open trial"
AFFINITY = "adapter affinity"
PANIC = "panic: none in rotation"
UNKNOWN_MODELS = "out of rotation, its models not known yet"
TIMED_OUT = "not the one that timed out"


# One leg's pick: the instance, why, and the candidates it was chosen among (a plain tuple:
# one is made for every leg of every attempt).
Choice = tuple[Instance, str, Sequence[Instance]]


def trial(healthy: Sequence[Instance], half_open: Sequence[Instance], exclude: Collection[Instance],
          tick: int) -> Instance | None:
    """Pure: the half-open instance this pick (the role's ``tick``-th with one) goes to, or None."""
    if healthy and tick % HALF_OPEN_SHARE:
        return None
    for inst in half_open:
        if inst not in exclude:
            return inst
    return None


def pick(pool: InstancePool, exclude: Collection[Instance] = (), view: RequestView = EMPTY_VIEW,
         model: ModelKey | None = None, timed_out: Collection[Instance] = ()) -> Choice:
    """The instance of ``pool``'s role for one leg, why, and the candidates (a :data:`Choice`),
    preferring instances not in ``exclude`` (those that already failed this request), never one
    in ``timed_out``. Never fails for a role with an instance not draining (panic routing), but
    with 504 when every one left timed out."""
    if model is None:
        healthy, half_open = pool.in_rotation, pool.half_open
    else:
        healthy, half_open, _ = pool.hosts(model)
    if half_open:
        pool.picks += 1
        chosen = trial(healthy, half_open, exclude, pool.picks)
        if chosen is not None:
            return _not_timed_out(pool, (chosen, TRIAL, half_open), view, model, timed_out)
    why = None
    if healthy and not exclude:
        candidates = healthy  # the common case: every instance in rotation, none failed this request
    else:
        panics = pool.panics
        candidates = pool.candidates(exclude, model)
        if not healthy:
            why = PANIC if pool.panics != panics else UNKNOWN_MODELS
    if model is not None:
        served = pool.served
        affinity = served.affinity
        if affinity is not None:
            adapter = served.adapter_of(model)
            if adapter is not None:
                served.rehome()
                return _not_timed_out(pool, (affinity.choose(candidates, adapter), AFFINITY, candidates), view,
                                      model, timed_out)
    policy = pool.policy
    chosen = policy.choose(candidates, view)
    choice = (chosen, why or policy.name, candidates)
    return _not_timed_out(pool, choice, view, model, timed_out) if timed_out else choice


def choose(pool: InstancePool, exclude: Collection[Instance] = (), view: RequestView = EMPTY_VIEW,
           model: ModelKey | None = None) -> Instance:
    """:func:`pick`'s instance."""
    return pick(pool, exclude, view, model)[0]


def _not_timed_out(pool: InstancePool, choice: Choice, view: RequestView, model: ModelKey | None,
                   timed_out: Collection[Instance]) -> Choice:
    """``choice``, or another pick without the instances that timed out on this request."""
    if not timed_out or choice[0] not in timed_out:
        return choice
    inst, _, candidates = pick(pool, timed_out, view, model)
    if inst in timed_out:
        raise ProxyError(504, f"no {pool.role} instance answered this request in time")
    return inst, TIMED_OUT, candidates
