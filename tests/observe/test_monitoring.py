"""docs/operations.md and docs/monitoring/: the dashboard asks only for metrics the proxy
exports, every exported family is documented, the scrape config is valid."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import chat_body, stack
from prometheus_client.parser import text_string_to_metric_families

from epd_proxy.observe.metrics import FAMILIES

DOCS = Path(__file__).resolve().parents[2] / "docs"
DASHBOARD = DOCS / "monitoring" / "grafana-dashboard.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
             "info": ("",), "unknown": ("",)}


def _expressions(dashboard: dict) -> list[str]:
    out = []
    for panel in dashboard["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
        for inner in panel.get("panels", []):  # rows
            out += [t["expr"] for t in inner.get("targets", [])]
    return out


def _names_in(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values are not names
    return {m for m in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)
            if m.startswith(("epd_proxy_", "process_", "python_"))}


async def test_every_dashboard_expression_names_an_exported_series():
    async with stack(encode=1) as (cluster, proxy, client):
        assert (await client.chat(chat_body(stream=True, images=["https://example.com/a.png"]))).status == 200
        text = (await client.request("GET", "/metrics")).body.decode()
    exported = set()
    for fam in text_string_to_metric_families(text):
        exported.update(fam.name + s for s in _SUFFIXES[fam.type])
    exprs = _expressions(json.loads(DASHBOARD.read_text()))
    assert len(exprs) >= 20
    used = set().union(*map(_names_in, exprs))
    assert used - exported == set(), f"not exported: {sorted(used - exported)}"
    # What the operator asked to see.
    for name in ("epd_proxy_requests_total", "epd_proxy_time_to_first_token_seconds_bucket",
                 "epd_proxy_inter_token_seconds_bucket", "epd_proxy_stage_duration_seconds_bucket",
                 "epd_proxy_instance_inflight", "epd_proxy_instance_healthy", "epd_proxy_retries_total",
                 "epd_proxy_inflight_requests", "epd_proxy_instance_failures_total"):
        assert name in used, name


def test_a_name_that_is_not_exported_is_caught():
    assert _names_in('sum(rate(epd_proxy_nope_total{status=~"5.."}[5m]))') == {"epd_proxy_nope_total"}


def test_every_family_is_documented():
    doc = (DOCS / "operations.md").read_text()
    missing = [name for name in FAMILIES if f"`{name}" not in doc]
    assert missing == []


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian package "
                                                             "'prometheus'; make test installs it when root)")
def test_the_scrape_config_is_valid():
    out = subprocess.run(["promtool", "check", "config", str(DOCS / "monitoring" / "prometheus.yml")],
                         capture_output=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
