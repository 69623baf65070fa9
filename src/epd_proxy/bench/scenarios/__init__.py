"""The benchmark's scenarios, one module each (the cluster scenario a package): every
scenario brings its flags, its run, its section of the report, its figures and its checks
(:class:`~epd_proxy.bench.scenarios.base.Scenario`). :mod:`epd_proxy.bench.report` only
assembles them.

compare     every workload against direct / epd-proxy / vllm-router / nginx, interleaved, repeated
latency     concurrency 1: TTFT through the proxy minus the stage times measured directly
throughput  fast backends (short token delay, few tokens): what one proxy core sustains
scale       thousands of slow streams: memory and CPU per 1k streams
workers     ``--workers 2`` against one worker, each worker held to a CPU quota
media       big images through the encoder stage: CPU against image size
encoders    encoder placement: new and repeated images of several sizes on 3 encoders, per policy
lora        LoRA adapter placement: adapter swaps and TTFT, affinity against round-robin and vllm-router
push        TTFT in NIXL push mode against pull mode
overload    a burst of slow streams past the admission limit, slowloris and normal traffic alongside
soak        a mixed workload for a long time: RSS growth, errors, mismatches
tenants     three keys at saturation: first come first served against the fair queue; replicas sharing a store
cluster     routing policies on a simulated cluster with caches
multiturn   multi-turn KV reuse between decode and prefill, prefill skipped for short remainders
url         ``--url``: load against one endpoint only
"""

from __future__ import annotations

from epd_proxy.bench.scenarios import (
    compare,
    encoders,
    latency,
    lora,
    media,
    overload,
    push,
    scale,
    soak,
    tenants,
    throughput,
    url,
    workers,
)
from epd_proxy.bench.scenarios.base import Scenario
from epd_proxy.bench.scenarios.cluster import run as cluster
from epd_proxy.bench.scenarios.multiturn import run as multiturn

# In the order of the help text and of ``--scenario all``.
SCENARIOS: dict[str, Scenario] = {m.SCENARIO.name: m.SCENARIO for m in (
    compare, latency, throughput, scale, workers, media, encoders, lora, push, overload, soak, cluster, multiturn,
    tenants, url)}

# The report's targets table lists the checks in the order of its targets, not in
# the order the scenarios ran; a scenario not named here comes after these, in SCENARIOS' order.
TARGETS_ORDER = ("compare", "throughput", "latency", "workers", "scale", "soak", "media", "encoders", "lora", "cluster",
                 "multiturn", "tenants")


def by_name() -> list[str]:
    """The scenarios ``--scenario`` chooses from."""
    return [name for name, s in SCENARIOS.items() if s.by_name]
