"""The multiturn scenario end to end at a tiny size, and vLLM's reference proxy as a target."""

import argparse
import os
import shutil

import pytest

from epd_proxy.bench import reference_proxy
from epd_proxy.bench.scenarios.multiturn.run import run as run_multiturn


def _args(tmp_path, targets: str) -> argparse.Namespace:
    from epd_proxy.bench.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--scenario", "multiturn", "--no-pin", "--itl-ms", "0.5", "--mt-targets", targets,
                      "--mt-workloads", "long", "--mt-rates", "30", "--mt-conversations", "6", "--mt-turns", "3",
                      "--mt-think-s", "0", "--mt-system-words", "40", "--mt-user-words", "8",
                      "--mt-long-tokens", "80", "--mt-prefills", "2", "--mt-decoders", "2", "--no-progress"])
    a.log_dir = str(tmp_path)
    return a


async def test_tiny_multiturn_run_today_s_routing_keeps_decode_blocks(tmp_path):
    out = await run_multiturn(_args(tmp_path, "cache-aware"))
    cell = out["workloads"]["long"]["targets"]["cache-aware"]["rates"]["30.0"]
    assert "error" not in cell, cell
    assert cell["requests"] == 18 and cell["ok"] == 18 and cell["verify_errors"] == 0, cell["error_examples"]
    k = cell["counters"]
    assert k["prefill"]["requests"] == 18 and k["computed_decode"] == 0 and k["computed_prefill"] > 0
    # nothing reads what decodes keep: every finished request's blocks are still held
    assert k["read_from_decode"] == 0 and k["kept_kv_blocks_end"] > 0 and k["decode"]["kv_reuse_reads"] == 0
    assert cell["itl_ms"]["count"] > 0 and cell["held"]["samples"] >= 1


@pytest.mark.skipif(not (shutil.which("redis-server") or shutil.which("valkey-server")),
                    reason="redis-server is not installed (scripts/ensure-system-packages.sh installs it)")
async def test_replicas_taking_turns_reuse_only_with_the_shared_store(tmp_path):
    out = await run_multiturn(_args(tmp_path, "reuse-x3,reuse-x3-store"))
    cells = {n: out["workloads"]["long"]["targets"][n]["rates"]["30.0"] for n in ("reuse-x3", "reuse-x3-store")}
    for cell in cells.values():
        assert "error" not in cell and cell["ok"] == 18 and cell["verify_errors"] == 0, cell
    assert cells["reuse-x3"]["counters"]["read_from_decode"] == 0  # each turn on a replica that kept nothing
    assert cells["reuse-x3-store"]["counters"]["read_from_decode"] > 0


def _cached_reference() -> str | None:
    path = os.path.join(reference_proxy.cache_dir(), reference_proxy.FILE)
    return path if os.path.isfile(path) else None


@pytest.mark.skipif(_cached_reference() is None or bool(reference_proxy.missing_modules()),
                    reason="vLLM's reference proxy is not in the cache (the benchmark fetches it) or fastapi, httpx, "
                           "uvicorn are missing")
async def test_reference_proxy_reads_decode_blocks_with_conversation_id(tmp_path):
    args = _args(tmp_path, "vllm-multiturn")
    args.vllm_multiturn_proxy = _cached_reference()
    out = await run_multiturn(args)
    cell = out["workloads"]["long"]["targets"]["vllm-multiturn"]["rates"]["30.0"]
    assert "error" not in cell and cell.get("available", True), cell
    assert cell["ok"] == 18 and cell["verify_errors"] == 0, cell["error_examples"]
    k = cell["counters"]
    assert k["read_from_decode"] > 0 and k["decode"]["kv_reuse_reads"] > 0 and k["wrong_kv_reads"] == 0


def test_fetch_takes_a_given_file_or_says_why_not(tmp_path):
    f = tmp_path / "proxy.py"
    f.write_text("print()")
    assert reference_proxy.fetch(str(f)) == str(f)
    with pytest.raises(RuntimeError, match="no such file"):
        reference_proxy.fetch(str(tmp_path / "absent.py"))
