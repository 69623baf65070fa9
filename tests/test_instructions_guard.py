"""scripts/instructions_guard.py's verdict (pure): which workloads grew past the margin. The
measurement itself runs as `make instructions-check` (callgrind, about half a minute)."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "scripts" / "instructions_guard.py"
_SPEC = importlib.util.spec_from_file_location("instructions_guard", _PATH)
assert _SPEC and _SPEC.loader
guard = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(guard)

BASELINE = {"margin": 0.03, "counts": {"nonstream": 400_000, "stream": 1_000_000}}


def test_within_the_margin_passes():
    assert guard.compare(BASELINE, {"nonstream": 411_999, "stream": 990_000}) == []


def test_growth_past_the_margin_is_named():
    over = guard.compare(BASELINE, {"nonstream": 412_001, "stream": 1_000_000})
    assert len(over) == 1 and over[0].startswith("nonstream: 412,001") and "+3.0%" in over[0]


def test_the_recorded_baseline_covers_the_mix():
    import json
    recorded = json.loads((_PATH.parent / "instructions-baseline.json").read_text())
    assert set(recorded["counts"]) == set(guard.MIX) and 0 < recorded["margin"] < 0.1
