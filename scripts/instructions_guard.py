"""The hot path's guard: the proxy's instructions per request for a fixed request mix, against
the baseline recorded in scripts/instructions-baseline.json. Fails when a workload grew by more
than the recorded margin.

Instructions (callgrind, user space) are the measure because they do not move with the
machine's speed or with other load, where CPU time on this kind of host moves by up to 40 %
between runs; a few per cent over a few hundred requests is within their spread.

    python scripts/instructions_guard.py            # check (make instructions-check)
    python scripts/instructions_guard.py --record   # write the current counts as the baseline
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASELINE = HERE / "instructions-baseline.json"
# Each workload's mode for instructions.sh and how many measured requests: enough that the
# per-request figure settles within about 1 %, few enough that the whole mix takes a minute.
MIX = {"nonstream": 400, "stream": 200, "messages": 200, "responses": 200}
FLAGS = ["--shutdown-grace", "0"]


def measure(mode: str, n: int, src: Path) -> int:
    """One workload's count; tried twice, since instructions.sh picks free ports by binding and
    releasing them, and another process may take one in between."""
    env = dict(os.environ, PY=os.environ.get("PY", sys.executable))
    for attempt in (1, 2):
        run = subprocess.run(["bash", str(HERE / "instructions.sh"), str(src), mode, str(n), *FLAGS],
                             capture_output=True, text=True, env=env)
        found = re.search(r"(\d+) instructions per request", run.stdout)
        if run.returncode == 0 and found:
            return int(found.group(1))
        print(f"{mode}: attempt {attempt} failed (exit {run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-2000:]}",
              file=sys.stderr)
    raise SystemExit(f"{mode}: instructions.sh failed twice")


def compare(baseline: dict, counts: dict[str, int]) -> list[str]:
    """The workloads over the baseline's margin, as lines to print (pure)."""
    margin = baseline["margin"]
    over = []
    for mode, count in counts.items():
        base = baseline["counts"][mode]
        if count > base * (1 + margin):
            over.append(f"{mode}: {count:,} instructions per request, {count / base - 1:+.1%} "
                        f"over the baseline {base:,} (margin {margin:.0%})")
    return over


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="write the counts as the new baseline")
    parser.add_argument("--src", type=Path, default=REPO / "src", help="the package's source folder")
    args = parser.parse_args()
    counts = {mode: measure(mode, n, args.src) for mode, n in MIX.items()}
    for mode, count in counts.items():
        print(f"{mode}: {count:,} instructions per request")
    if args.record:
        old = json.loads(BASELINE.read_text()) if BASELINE.exists() else {"margin": 0.03}
        BASELINE.write_text(json.dumps({"margin": old["margin"], "counts": counts}, indent=2) + "\n")
        print(f"recorded in {BASELINE.relative_to(REPO)}")
        return 0
    over = compare(json.loads(BASELINE.read_text()), counts)
    for line in over:
        print("over:", line)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
