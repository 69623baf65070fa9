"""The simulator's self-benchmark: its load generator must see the end of every stream
the simulator sends, or it would report nothing (driven here for a fraction of a second
against an in-process simulator on loopback)."""

import subprocess
import sys

from epd_proxy.bench import selfbench
from epd_proxy.sim import SimCluster, SimConfig


async def test_the_load_generator_counts_completed_streams():
    async with SimCluster(pd=1, config=SimConfig(itl_ms=0, records=False)) as cluster:
        port = cluster.instances("pd")[0].port
        counts = await selfbench._drive(port, concurrency=2, tokens=4, duration=0.3, warmup=0.05)
    assert counts["ok"] > 0
    assert counts["bad"] == 0
    assert counts["bytes"] > 0


def test_the_command_line_entry_runs():
    out = subprocess.run([sys.executable, "-m", "epd_proxy.bench.selfbench", "--help"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    assert "python -m epd_proxy.bench.selfbench" in out.stdout
