"""The soak scenario at a tiny size (seconds), so it cannot rot."""

from epd_proxy.bench import report
from epd_proxy.bench.scenarios import soak
from epd_proxy.cli import build_parser


def _args(tmp_path, *extra):
    args = build_parser().parse_args(["bench", "--no-pin", "--no-progress", "--variants", "2",
                                      "--image-kb", "4", "--max-tokens", "4", *extra])
    args.log_dir = str(tmp_path)
    args.partial = {}
    return args


async def test_soak_reports_memory_growth_errors_and_mismatches(tmp_path):
    args = _args(tmp_path, "--soak-duration", "2", "--soak-concurrency", "4")
    r = await soak.run(args)
    assert r["requests"] > 0 and r["errors"] == 0 and r["verify_errors"] == 0
    assert r["rss_start_mb"] > 0 and r["rss_end_mb"] > 0
    assert isinstance(r["rss_growth_pct"], float)
    assert len(r["samples"]) >= 2
    res = {"scenarios": {"soak": r}}
    res["checks"] = report.checks(res)
    assert any(c["key"] == "soak_flat" for c in res["checks"])
    assert "## Soak" in report.markdown(res)
