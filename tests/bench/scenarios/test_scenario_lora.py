"""The lora scenario's pure parts: the adapter mix, the requests and their expected text, the
report section and the swap check."""

from __future__ import annotations

from collections import Counter

import msgspec

from epd_proxy.bench.scenarios import SCENARIOS
from epd_proxy.bench.scenarios.lora import adapter_path, build_requests, checks, plan_adapters, section
from epd_proxy.sim import expected_text


def test_plan_is_skewed_and_deterministic() -> None:
    plan = plan_adapters(4000, 8, zipf=1.0, seed=1)
    counts = Counter(plan)
    assert set(counts) == {f"adapter-{k}" for k in range(8)}
    assert counts["adapter-0"] > 2 * counts["adapter-7"]
    assert plan == plan_adapters(4000, 8, zipf=1.0, seed=1) != plan_adapters(4000, 8, zipf=1.0, seed=2)
    flat = Counter(plan_adapters(4000, 4, zipf=0.0, seed=1))
    assert max(flat.values()) < 1.2 * min(flat.values())


def test_requests_expect_their_adapters_output() -> None:
    reqs = build_requests(["adapter-1", "adapter-2"], seed=0, max_tokens=8, verify=True)
    for r, name in zip(reqs, ("adapter-1", "adapter-2")):
        body = msgspec.json.decode(r.body)
        assert body["model"] == name and r.stream
        assert r.expected == expected_text(body, lora_path=adapter_path(name)) != expected_text(body)


def test_section_and_check() -> None:
    result = {"rate": 20.0, "duration": 15.0, "adapters": 8, "zipf": 1.0, "slots": 2, "swap_ms": 40.0,
              "results": [{"target": "affinity", "requests": 300, "swaps": [3, 4, 3, 4], "swaps_total": 14,
                           "ttft_p50": 5.0, "ttft_p99": 45.0, "errors": 0, "verify_errors": 0},
                          {"target": "round-robin", "requests": 300, "swaps": [60, 61, 60, 59], "swaps_total": 240,
                           "ttft_p50": 44.0, "ttft_p99": 90.0, "errors": 0, "verify_errors": 0}],
              "skipped": {"vllm-router": "not installed"}}
    text = "\n".join(section(result, {}))
    assert "| affinity | 300 | 14 | 3 / 4 / 3 / 4 |" in text and "vllm-router: not run" in text
    (check,) = checks(result)
    assert check["met"] is True and abs(check["measured"] - 14 / 240) < 1e-9
    assert "lora" in SCENARIOS
