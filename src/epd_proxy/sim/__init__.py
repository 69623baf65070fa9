"""Simulated vLLM instances for tests, demos and benchmarks.

They speak vLLM's OpenAI-compatible HTTP API and its disaggregation protocols
(NIXL pull and push, Mooncake, EC transfer) with real KV/EC hand-off between
instances, fault injection and request records. See README.md in this package.

    from epd_proxy.sim import SimCluster, SimConfig, expected_text

    async with SimCluster(encode=2, prefill=1, decode=2, config=SimConfig(itl_ms=0)) as cluster:
        cluster.urls("decode")
"""

from epd_proxy.sim.cluster import SimCluster
from epd_proxy.sim.config import SimConfig
from epd_proxy.sim.ec_store import EcStore
from epd_proxy.sim.faults import FaultSyntaxError
from epd_proxy.sim.faults import parse as parse_faults
from epd_proxy.sim.instance import SimInstance
from epd_proxy.sim.records import SimRecord, Stats
from epd_proxy.sim.tokens import (
    VOCAB,
    content_hash,
    engine_hash,
    expected_text,
    expected_tokens,
    media_metadata,
    prompt_tokens,
)

__all__ = [
    "SimCluster", "SimConfig", "SimInstance", "SimRecord", "Stats", "EcStore", "expected_text",
    "expected_tokens", "prompt_tokens", "media_metadata", "engine_hash", "content_hash", "VOCAB",
    "parse_faults", "FaultSyntaxError",
]
