"""What the pools and the roster tell ``/metrics``: collectors registered with the metrics
(``observe/metrics.py``), read at scrape time, so a request pays nothing for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from epd_proxy.instances.health import FAILURE_KINDS
from epd_proxy.observe.metrics import Collector

if TYPE_CHECKING:  # pragma: no cover
    from epd_proxy.instances.adapters import Adapters
    from epd_proxy.instances.membership import Membership
    from epd_proxy.instances.pool import InstancePool


def pool_collector(pools: dict[str, InstancePool], worker: int) -> Collector:
    """Each instance's state and counts, and each pool's routing counts (``worker``: the
    label of this process's own view)."""
    label = str(worker)

    def collect(f: dict[str, list]) -> None:
        for role, pool in pools.items():
            for inst in pool.instances:
                url = inst.url
                f["epd_proxy_instance_healthy"].append([role, url, label, 1 if inst.healthy else 0])
                f["epd_proxy_instance_inflight"].append([role, url, inst.inflight])
                f["epd_proxy_instance_requests"].append([role, url, inst.requests])
                errors = inst.health.errors
                for kind in FAILURE_KINDS:
                    f["epd_proxy_instance_failures"].append([role, url, kind, errors.get(kind, 0)])
                for kind, n in errors.items():
                    if kind not in FAILURE_KINDS:
                        f["epd_proxy_instance_failures"].append([role, url, kind, n])
                f["epd_proxy_instance_retries"].append([role, url, 0])  # the metrics' own counts add to it
                f["epd_proxy_instance_ejections"].append([role, url, inst.health.ejections])
                f["epd_proxy_instance_other_requests"].append([role, url, label, inst.signals.others])
                if role == "prefill":
                    f["epd_proxy_kv_stranded"].append([role, url, inst.stranded])
                served = inst.served
                if served is not None:  # what it serves: its base models by name, its adapters counted
                    adapters = 0
                    for name, parent in served.parents.items():
                        if parent is None:
                            f["epd_proxy_instance_model_info"].append([role, url, name, 1])
                        else:
                            adapters += 1
                    f["epd_proxy_instance_adapters"].append([role, url, adapters])
            f["epd_proxy_routing_spills"].append([role, getattr(pool.policy, "spills", 0)])
            f["epd_proxy_routing_exact"].append([role, getattr(pool.policy, "exact", 0)])
            f["epd_proxy_panic_routing"].append([role, pool.panics])
            if role == "decode":
                for outcome, n in pool.wedged_routing.items():
                    f["epd_proxy_wedged_routing"].append([role, outcome, n])
            f["epd_proxy_local_errors"].append([role, pool.outliers.local_errors])
    return collect


# Why an instance leaves the roster (membership.py).
REMOVAL_REASONS = ("unregistered", "drained", "forgotten")


def roster_collector(membership: Membership) -> Collector:
    """The roster's size by role and state, and its joins and leaves."""
    def collect(f: dict[str, list]) -> None:
        f["epd_proxy_roster_instances"] = [[r, st, n] for (r, st), n in membership.counts().items()]
        # Every role's counts from the start (0 until the first join or leave).
        roles = set(membership.pools) | set(membership.registrations)
        f["epd_proxy_registrations"] = [[r, membership.registrations.get(r, 0)] for r in roles]
        removals = dict.fromkeys(((r, why) for r in roles for why in REMOVAL_REASONS), 0)
        removals.update(membership.removals)
        f["epd_proxy_removals"] = [[r, why, n] for (r, why), n in removals.items()]
    return collect


def adapters_collector(adapters: Adapters) -> Collector:
    """LoRA adapter loads and unloads the proxy made on instances, by trigger and outcome."""
    def collect(f: dict[str, list]) -> None:
        f["epd_proxy_lora_calls"] += [[t, v, o, n] for (t, v, o), n in adapters.calls.items()]
        f["epd_proxy_lora_loads_pending"].append([adapters.pending])
    return collect
