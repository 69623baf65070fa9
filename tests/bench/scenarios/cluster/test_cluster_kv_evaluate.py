"""The KV events comparison's figures and targets (pure)."""

import math

import pytest

from epd_proxy.bench.scenarios.cluster.kv_cases import parse_case
from epd_proxy.bench.scenarios.cluster.kv_evaluate import figures, targets
from epd_proxy.bench.scenarios.cluster.kv_section import kv_section


def _cell(hit, p50, p99, cpu=0.2, n=100, **kw):
    return {"prefix_hit_rate": hit, "ttft_ms": {"p50": p50, "p99": p99}, "proxy_cpu_s": cpu, "requests": n,
            "proxy_cpu_ms_per_req": 1000 * cpu / n if cpu is not None else None, "prefill_tokens_computed": 1000,
            "errors": 0, "verify_errors": 0, **kw}


def _kv(cells_by_case: dict) -> dict:
    cases = {}
    for name, cells in cells_by_case.items():
        c = parse_case(name)
        of = "evict" if name.startswith("evict") and "oracle" not in cells else name
        cases[name] = {"case": c.__dict__.copy(), "oracle_of": of, "cache_ratio": 0.15 if c.evictions else 1.0,
                       "prefix_cache_blocks_per_instance": 10, "cells": cells}
    return {"exact": "exact", "today": "cache-aware", "router": "vllm-router:cache_aware", "rate": 40,
            "workload": "text", "working_set": {"requests": 100, "blocks": 70}, "cases": cases}


def _by_key(ts):
    return {t["key"]: t for t in ts}


def test_targets_met():
    kv = _kv({
        "evict": {"cache-aware": _cell(0.60, 20, 80), "exact": _cell(0.70, 15, 60, cpu=0.3),
                  "vllm-router:cache_aware": _cell(0.55, 25, 90, cpu=None), "oracle": _cell(0.71, 14, 50, cpu=None)},
        "evict+r3": {"cache-aware": _cell(0.50, 22, 90), "exact": _cell(0.70, 16, 70, cpu=0.3),
                     "vllm-router:cache_aware": _cell(0.40, 30, 99, cpu=None)},
        "roomy": {"cache-aware": _cell(0.80, 10, 40), "exact": _cell(0.80, 10.4, 39, cpu=0.3),
                  "oracle": _cell(0.80, 9, 30, cpu=None)},
        # not a target case: a restart where exact does badly changes none of the verdicts
        "roomy+restart": {"cache-aware": _cell(0.80, 10, 40), "exact": _cell(0.10, 99, 999),
                          "oracle": _cell(0.80, 9, 30, cpu=None)},
    })
    t = _by_key(targets(kv))
    assert t["kv_hit_rate"]["met"] and t["kv_hit_rate"]["measured"] == pytest.approx(0.70 / 0.71)
    assert t["kv_ttft_today"]["met"] and t["kv_ttft_today"]["measured"] == pytest.approx(70 / 90)
    assert t["kv_ttft_router"]["met"] and t["kv_ttft_router"]["measured"] == pytest.approx(70 / 99)
    assert t["kv_roomy_hit_rate"]["met"] and t["kv_roomy_ttft"]["met"]
    assert t["kv_roomy_ttft"]["measured"] == pytest.approx(1.04)
    assert t["kv_cpu"]["met"] is None and t["kv_cpu"]["measured"] == pytest.approx(1.1 / 0.8)  # reported, no limit
    rows = {(f["case"], f["policy"]): f for f in figures(kv)}
    assert rows[("evict+r3", "exact")]["vs_oracle"] == pytest.approx(0.70 / 0.71)  # the evict case's oracle
    assert rows[("roomy", "oracle")]["vs_oracle"] == 1.0


def test_targets_missed_and_unmeasured():
    kv = _kv({
        "evict": {"cache-aware": _cell(0.60, 20, 80), "exact": _cell(0.65, 21, 60),
                  "oracle": _cell(0.70, 14, 50, cpu=None)},
        "roomy": {"cache-aware": _cell(0.80, 10, 40), "exact": {"error": "RuntimeError: boom"}},
    })
    t = _by_key(targets(kv))
    assert t["kv_hit_rate"]["met"] is False and t["kv_hit_rate"]["measured"] == pytest.approx(0.65 / 0.70)
    assert t["kv_ttft_today"]["met"] is False and "p50" in t["kv_ttft_today"]["note"]
    assert t["kv_ttft_router"]["met"] is None  # no vllm-router cell
    assert t["kv_roomy_hit_rate"]["met"] is None and t["kv_roomy_ttft"]["met"] is None  # exact's cell failed
    rows = {(f["case"], f["policy"]): f for f in figures(kv)}
    assert rows[("roomy", "exact")]["error"] == "RuntimeError: boom"
    assert math.isnan(rows[("roomy", "cache-aware")]["vs_oracle"])  # roomy has no oracle here
    text = "\n".join(kv_section({"kv": kv}))
    assert "#### roomy" in text and "RuntimeError: boom" in text and "| exact | 65.0 | 0.929 |" in text
    assert kv_section({}) == []
