"""Run a simulated cluster in its own process for the benchmark.

``python -m epd_proxy.bench.simhost '<json>'`` where the JSON is
``{"counts": {"encode": 1, "prefill": 1, "decode": 1}, "config": {SimConfig fields},
"roles": {"decode": {...}}}``. Prints one JSON line (URLs and prefill identities)
once every instance listens, then runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

from epd_proxy.http import event_loop


def cluster_config(spec: dict):
    from epd_proxy.sim import SimConfig

    fields = dict(spec.get("config") or {})
    roles = spec.get("roles") or {}
    if "fault_kinds" in fields:
        fields["fault_kinds"] = tuple(fields["fault_kinds"])
    return SimConfig(**fields, roles={r: dict(v) for r, v in roles.items()})


def describe(cluster) -> dict:
    out = {role: cluster.urls(role) for role in ("encode", "prefill", "decode", "pd")}
    try:
        out["prefill_identities"] = cluster.prefill_identities()
    except Exception:  # pragma: no cover - older simulator
        out["prefill_identities"] = []
    out["kv_connector"] = cluster.config.kv_connector
    # With ``kv_events`` on: each prefill's and decode's event and replay sockets, by URL.
    out["kv_events"] = {i.url: [i.kv_events.endpoint, i.kv_events.replay_endpoint]
                        for i in cluster.all_instances() if getattr(i, "kv_events", None) is not None}
    return out


async def _main(spec: dict) -> None:
    from epd_proxy.sim import SimCluster

    counts = {k: int(v) for k, v in (spec.get("counts") or {}).items()}
    cluster = SimCluster(**counts, config=cluster_config(spec))  # type: ignore[arg-type]  # role -> int
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with cluster:
        # The simulator is the benchmark's instrument: keep the collector's pauses
        # out of the stage times it serves, as the proxy does (tune_gc).
        from epd_proxy.runtime.serve import tune_gc

        tune_gc()
        print(json.dumps(describe(cluster)), flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0]) if argv else {}
    want = int(spec.get("nofile") or 0)
    if want:
        from epd_proxy.bench.procs import raise_nofile

        raise_nofile(want)
    event_loop.run(_main(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
