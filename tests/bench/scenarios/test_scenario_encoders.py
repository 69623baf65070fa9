"""The encoders scenario's pure parts: the request mix, the spread, the sized images."""

from __future__ import annotations

import math

from epd_proxy.bench.scenarios.encoders import SIZE_CLASSES, image_for, plan_mix, spread
from epd_proxy.sim.tokens import media_metadata, media_tokens


def test_plan_mix_shares_and_repeats() -> None:
    plan = plan_mix(2000, new_share=0.6, hot=5, seed=1)
    assert len(plan) == 2000
    new = [k for k, _ in plan if k.startswith("new")]
    hot = {k for k, _ in plan if k.startswith("hot")}
    assert 0.55 < len(new) / len(plan) < 0.65
    assert len(set(new)) == len(new)  # a new image is never seen again
    assert hot <= {f"hot{i}" for i in range(5)}
    classes = {c.name for c in SIZE_CLASSES}
    assert {c for _, c in plan} <= classes
    # A hot image keeps its class.
    by_key: dict[str, set] = {}
    for k, c in plan:
        by_key.setdefault(k, set()).add(c)
    assert all(len(v) == 1 for v in by_key.values())
    assert plan == plan_mix(2000, new_share=0.6, hot=5, seed=1)
    assert plan != plan_mix(2000, new_share=0.6, hot=5, seed=2)


def test_plan_mix_without_hot_set_is_all_new() -> None:
    plan = plan_mix(50, new_share=0.1, hot=0)
    assert all(k.startswith("new") for k, _ in plan)


def test_spread() -> None:
    assert spread([10.0, 10.0, 10.0]) == 1.0
    assert spread([10.0, 20.0, 12.0]) == 2.0
    assert spread([0.0, 5.0]) == math.inf
    assert spread([0.0, 0.0]) == 1.0
    assert math.isnan(spread([]))


def test_image_for_lands_in_its_class() -> None:
    for cls in SIZE_CLASSES:
        url = image_for("k", cls, seed=3)
        tokens = media_tokens("image", media_metadata({"type": "image_url", "image_url": {"url": url}}))
        assert cls.tokens[0] <= tokens <= cls.tokens[1]
        assert len(url) > cls.kb * 1024 * 4 / 3
