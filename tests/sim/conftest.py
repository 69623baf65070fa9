"""Fixtures for the simulator's own tests."""

from __future__ import annotations

import pytest
from simhelpers import Http


@pytest.fixture
async def http():
    h = Http()
    try:
        yield h
    finally:
        await h.close()
