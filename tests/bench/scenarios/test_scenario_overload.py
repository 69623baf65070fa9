"""The overload scenario at a tiny size (seconds), so it cannot rot."""

from epd_proxy.bench import report
from epd_proxy.bench.scenarios import overload
from epd_proxy.cli import build_parser


def _args(tmp_path, *extra):
    args = build_parser().parse_args(["bench", "--no-pin", "--no-progress", "--variants", "2",
                                      "--image-kb", "4", "--max-tokens", "4", *extra])
    args.log_dir = str(tmp_path)
    args.partial = {}
    return args


async def test_overload_sheds_the_burst_and_recovers(tmp_path):
    args = _args(tmp_path, "--overload-streams", "40", "--overload-tokens", "4", "--overload-itl-ms", "100",
                 "--overload-max-inflight", "8", "--overload-queue-size", "4", "--overload-queue-timeout", "0.2",
                 "--overload-slowloris", "5", "--overload-slowloris-interval", "0.2",
                 "--overload-normal-concurrency", "2", "--overload-baseline", "0.3", "--overload-after", "1",
                 "--overload-sample", "0.2")
    r = await overload.run(args)
    assert r["burst_unfinished"] == 0 and r["burst_verify_errors"] == 0
    assert r["burst_shed_429"] > 0 and r["burst_ok"] > 0
    assert r["burst_ok"] + r["burst_shed_429"] == 40, r["burst_statuses"]
    assert r["proxy_shed_total"] >= r["burst_shed_429"]
    assert r["rss_peak_mb"] > 0 and r["fds_peak"] > 0
    assert r["recovery_s"] >= 0 and r["normal_baseline_ms"]["count"] >= 5
    assert "## Overload" in report.markdown({"scenarios": {"overload": r}})
