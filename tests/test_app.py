"""The app's own switches."""

from __future__ import annotations

import logging

from helpers import chat_body, stack


async def test_log_requests_logs_one_line_per_request(caplog):
    """--log-requests (the reference's flag): one debug line per request, with its status."""
    caplog.set_level(logging.DEBUG, logger="epd_proxy.app")
    async with stack(log_requests=True) as (cluster, proxy, client):
        assert (await client.chat(chat_body(), headers=[(b"x-request-id", b"rid-1")])).status == 200
        assert (await client.request("GET", "/nowhere")).status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "epd_proxy.app"]
    assert any(m.startswith("POST /v1/chat/completions -> 200") and "rid-1" in m for m in lines), lines
    assert any(m.startswith("GET /nowhere -> 404") for m in lines), lines


async def test_no_request_lines_by_default(caplog):
    caplog.set_level(logging.DEBUG, logger="epd_proxy.app")
    async with stack() as (cluster, proxy, client):
        assert (await client.chat(chat_body())).status == 200
    assert not [r for r in caplog.records if r.name == "epd_proxy.app" and "->" in r.getMessage()]
