"""Routing policies: which instance of a role serves a request (or a media item).

The pool filters the candidates by health (healthy, half-open, panic rules);
a policy only picks among them, from two kinds of input:

* a small, pure view of the request (:class:`RequestView`) over the
  already-parsed body, each key computed once, on first use: the conversation
  *anchor* (a hash of the prompt's beginning), the media items' uuids, the
  prompt's size and its chained block hashes;
* each candidate's load: this proxy's in-flight count, plus the instance's
  own queue as last scraped from its ``/metrics`` (``LoadSignals``, read by
  ``instances/load_signals.py``, kept fresh by ``instances/load_scraper.py`` in the
  background).

``cache-aware`` routes by rendezvous (highest-random-weight) hashing of the
anchor (encoders: new media level by estimated work, preferring the item uuid's
rendezvous-top encoder, repeats where they went; ``encoders.py``): every proxy replica and every
``--workers`` process computes the same order from the instance URLs alone,
so they agree without a shared store, and an instance leaving moves only the
keys that were its own. Load bounds it: an instance loaded past the balance
thresholds relative to the least-loaded candidate is passed over, in
rendezvous order. A proxy also keeps each conversation where it sent the
conversation's previous turn, as long as that turn was its own (see
``CacheAware``), so conversations stay where their openings were spread.

Pure: no I/O, no clock; the only state is rotation cursors, a random
generator for ``power-of-two``, and ``cache-aware``'s seeds by URL, counts of
openings and spills, a bounded map of conversations' last instances, and for
encoders the recent work placed per encoder and a bounded map of items' encoders.
"""

from __future__ import annotations

from epd_proxy.config import ConfigErrors, RoutingConfig, check_range
from epd_proxy.routing.cache_aware import CacheAware
from epd_proxy.routing.candidate import RoutingPolicy
from epd_proxy.routing.policies import LeastLoaded, LoadAware, PowerOfTwo, RoundRobin

POLICIES: dict[str, type[RoutingPolicy]] = {
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    "load-aware": LoadAware,
    "power-of-two": PowerOfTwo,
    "cache-aware": CacheAware,
}


def make_policy(name: str, *, balance_abs: float = 4, balance_rel: float = 1.5) -> RoutingPolicy:
    """A policy by its name (``POLICIES``); ValueError names the known ones."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(POLICIES)})")
    if cls is CacheAware:
        return CacheAware(balance_abs, balance_rel)
    return cls()


def check_config(policies: RoutingConfig) -> None:
    """The routing section's policy names and load bound, beside the policies they name."""
    errors: list[str] = []
    for policy in dict.fromkeys((policies.routing, policies.prefill_policy, policies.decode_policy,
                                 policies.encode_policy)):
        if policy is not None and policy not in POLICIES:
            errors.append(f"unknown routing policy {policy!r} (known: {', '.join(POLICIES)})")
    check_range(errors, "--balance-abs", policies.balance_abs, 0)
    check_range(errors, "--balance-rel", policies.balance_rel, 1)
    if errors:
        raise ConfigErrors(errors)
