import json
import math

from epd_proxy.bench import report
from epd_proxy.bench.lab import summarize_runs
from epd_proxy.bench.scenarios.latency import latency_basis


def run(req_s, cpu, rep=0, verify=0):
    lat = {"count": 10, "mean": 1.0, "min": 0.5, "p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0}
    return {"req_s": req_s, "target_cpu_ms_per_req": cpu, "target_cpu_util": 0.3, "sim_cpu_ms_per_req": 0.5,
            "loadgen_cpu_ms_per_req": 0.4, "load_core_util": 0.4, "tokens_s": 64 * req_s, "foreign_cpu_util": 0.0,
            "ttft_ms": lat, "itl_ms": lat, "e2e_ms": lat, "requests": 100, "errors": 0, "verify_errors": verify,
            "outside_window": {"ok": 5, "errors": 0, "verify_errors": 0}, "repeat": rep,
            "ttft_cdf": [[1.0, 2.0, 3.0], [0.33, 0.66, 1.0]], "e2e_cdf": [[1.0, 2.0], [0.5, 1.0]]}


def synthetic():
    runs = {"direct": [run(300, math.nan, r) for r in range(3)],
            "epd-proxy": [run(295, c, r) for r, c in enumerate((1.1, 1.0, 1.2))],
            "vllm-router": [run(280, 1.5, r) for r in range(3)]}
    comp = {"settings": {"concurrency": 96, "repeat": 3, "sim": {"itl_ms": 5}, "start": "staggered"},
            "wake_write": {"asleep_us": 28.4, "awake_us": 2.1}, "targets": {
        "direct": {"available": True, "note": "d"}, "epd-proxy": {"available": True, "note": "p"},
        "vllm-router": {"available": True, "note": "r"}, "nginx": {"available": False, "note": "not installed"}},
        "workloads": {"stream": {"description": "stream", "runs": runs, "summary": summarize_runs(runs)}},
        "sweep": {"concurrency": [8, 96], "targets": {"epd-proxy": [run(100, 1.3), run(295, 1.1)]}}}
    lat = {"workloads": {"stream": {"ok": 10, "errors": 0, "proxy_ttft_ms": run(0, 0)["ttft_ms"],
                                    "stage_sum_ms": run(0, 0)["ttft_ms"],
                                    "added_ms": {"p50": 0.5, "p90": 1.0, "p99": 2.5},
                                    "stages_ms": {}, "proxy_cpu_ms_per_req": 1.0}}}
    media = {"points": [{"image_mb": 1, "body_mb": 1.33, "target_cpu_ms_per_req": 3.0, "req_s": 10, "errors": 0,
                         "verify_errors": 0, "requests": 10},
                        {"image_mb": 2, "body_mb": 2.67, "target_cpu_ms_per_req": 5.0, "req_s": 5, "errors": 0,
                         "verify_errors": 0, "requests": 10}],
             "fit": {"slope": 2.0, "intercept": 1.0, "r2": 1.0}, "ms_per_mb": 2.0, "ms_per_body_mb": 1.5}
    return {"meta": {"command": "epd-proxy bench --compare", "machine": {"cpus": 2}},
            "scenarios": {"compare": comp, "latency": lat, "media": media, "push": {"error": "RuntimeError: x"}}}


def test_summarize_runs_medians_and_ratio():
    s = synthetic()["scenarios"]["compare"]["workloads"]["stream"]["summary"]
    assert s["epd-proxy"]["target_cpu_ms_per_req"] == {"median": 1.1, "min": 1.0, "max": 1.2, "n": 3}
    assert s["epd-proxy"]["req_s_vs_direct"]["median"] == 295 / 300
    assert s["direct"]["req_s_vs_direct"]["median"] == 1.0
    assert s["epd-proxy"]["requests"] == 300


def test_checks():
    res = synthetic()
    cks = {c["key"] + c["source"]: c for c in report.checks(res)}
    assert cks["cpu_streamcompare/stream"]["met"] is True
    assert cks["cpu_streamcompare/stream"]["measured"] == 1.1
    assert "vllm-router: 1.50" in cks["cpu_streamcompare/stream"]["note"]
    assert cks["reqs_vs_directcompare/stream"]["met"] is True
    assert cks["added_p99latency/stream"]["met"] is True
    assert cks["media_linearmedia"]["met"] is True
    assert cks["verifyall"]["met"] is True


def test_verification_errors_are_counted():
    res = synthetic()
    res["scenarios"]["compare"]["workloads"]["stream"]["runs"]["epd-proxy"][0]["verify_errors"] = 2
    cks = {c["key"]: c for c in report.checks(res)}
    assert cks["verify"]["measured"] == 2 and cks["verify"]["met"] is False


def test_write_markdown_json_and_plots(tmp_path):
    res = synthetic()
    res["checks"] = report.checks(res)
    paths = report.write(res, str(tmp_path))
    md = (tmp_path / "report.md").read_text()
    assert "## Targets" in md and "| epd-proxy | 295" in md
    assert "not installed" in md
    assert "failed: `RuntimeError: x`" in md
    assert "ms per MiB of image" in md
    assert "concurrency 96, first requests spread over the warm-up" in md
    assert "costs the writer 28.4 µs when that process sleeps" in md and "2.1 µs when it is busy" in md
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["scenarios"]["compare"]["workloads"]["stream"]["summary"]["direct"]["target_cpu_ms_per_req"][
        "median"] is None  # NaN -> null
    for name in ("latency_cdf_stream.png", "cpu_per_request.png", "reqs_vs_concurrency.png", "media_cpu.png"):
        f = tmp_path / name
        assert f.exists() and f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md
    assert set(paths["plots"].values()) >= {"cpu_per_request.png", "media_cpu.png"}


def _latency(stolen: int, n: int = 200) -> dict:
    return {"ok": n, "errors": 0, "samples_with_steal": stolen,
            "added_ms": {"count": n, "p50": 0.9, "p90": 1.5, "p99": 4.0},
            "added_without_steal_ms": {"count": n - stolen, "p50": 0.8, "p90": 1.2, "p99": 2.0}}


def test_latency_targets_leave_out_a_few_samples_with_steal():
    key, note = latency_basis(_latency(stolen=10))
    assert key == "added_without_steal_ms"
    assert "10 of 200" in note and "p99 4.00" in note  # the figure over every sample is kept beside it


def test_latency_targets_count_every_sample_when_steal_is_common_or_absent():
    assert latency_basis(_latency(stolen=40))[0] == "added_ms"  # 20 %: too many to leave out
    assert latency_basis(_latency(stolen=0)) == ("added_ms", "")
    old = {"ok": 10, "added_ms": {"p50": 1, "p99": 2}}  # a report from before steal was recorded
    assert latency_basis(old) == ("added_ms", "")
    res = synthetic()
    res["scenarios"]["latency"]["workloads"]["stream"].update(_latency(stolen=40))
    cks = {c["key"] + c["source"]: c for c in report.checks(res)}
    assert cks["added_p99latency/stream"]["measured"] == 4.0 and cks["added_p99latency/stream"]["met"] is False


def test_workers_section_shows_how_often_each_worker_slept(tmp_path):
    def run(req_s, cpu, sleeps):
        lat = {"p50": 1.0, "p90": 2.0, "p99": 3.0, "mean": 1.5}
        return {"req_s": req_s, "target_cpu_ms_per_req": cpu, "errors": 0, "verify_errors": 0, "requests": 10,
                "ttft_ms": lat, "itl_ms": lat, "e2e_ms": lat,
                "outside_window": {"ok": 0, "errors": 0, "verify_errors": 0},
                "worker_cpu_util": [0.2] * len(sleeps), "worker_sleeps_per_s": sleeps}

    runs = {"1": [run(700, 0.29, [0.0]), run(690, 0.3, [1.0])],
            "2": [run(1300, 0.31, [94.0, 151.0]), run(1290, 0.31, [69.0, 130.0])]}
    wk = {"quota_cores_per_worker": 0.2, "tokens": 16, "itl_ms": 1.0, "concurrency": 256, "runs": runs,
          "summary": summarize_runs(runs), "ratio": {"median": 1.86, "min": 1.86, "max": 1.87}}
    res = {"meta": {"command": "epd-proxy bench --scenario workers", "machine": {"cpus": 2}},
           "scenarios": {"workers": wk}}
    res["checks"] = report.checks(res)
    report.write(res, str(tmp_path), plots=False)
    md = (tmp_path / "report.md").read_text()
    assert "| per-worker sleeps/s (each run) |" in md
    assert "| 0, 1 |" in md and "94/151, 69/130" in md
    assert "held to 0.2 core" in md
