"""Fixtures for the HTTP layer tests: real loopback sockets, no mocks.

Every test here runs twice, on the stock asyncio loop and on uvloop (the loop the
proxy runs on in production), because the two transports differ in exactly the
corners these tests poke at (writes on closing transports, EOF handling, ...).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

try:
    import epd_proxy  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from httpkit import RawServer  # noqa: E402

from epd_proxy.http.server import HttpServer  # noqa: E402
from epd_proxy.http.server_limits import ServerLimits  # noqa: E402
from epd_proxy.wire.errors import error_body  # noqa: E402


def _factories():
    factories = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a hard dependency on Linux
        pass
    else:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def pytest_asyncio_loop_factories(config, item):
    return _factories()


@pytest.fixture
async def raw_server():
    """Start raw asyncio servers for a test; all are closed at the end."""
    servers: list[RawServer] = []

    async def start(handler) -> RawServer:
        srv = RawServer(handler)
        await srv.start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        await srv.close()


@pytest.fixture
async def http_server():
    """Start HttpServer instances for a test; all are closed at the end."""
    servers: list[HttpServer] = []

    async def start(handler, **limits) -> HttpServer:
        srv = HttpServer(handler, error_body=lambda status, message, path: error_body(status, message),
                         limits=ServerLimits(**limits) if limits else None)
        await srv.start("127.0.0.1", 0)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        await srv.close()
