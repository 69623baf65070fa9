"""One instance and the clock its times are on."""

from __future__ import annotations

import asyncio
import time

from epd_proxy.config import InstanceSpec
from epd_proxy.http.client import ConnectionPool
from epd_proxy.instances.health import HEALTHY
from epd_proxy.instances.instance import Instance, now


async def test_a_new_instance_is_healthy_and_not_yet_in_the_roster():
    inst = Instance(InstanceSpec("http://127.0.0.1:1", "decode"), ConnectionPool("http://127.0.0.1:1"))
    assert inst.state is HEALTHY and inst.healthy and not inst.health.seen_healthy
    assert (inst.source, inst.out_since, inst.leaving) == (None, None, False)
    await inst.connections.close()


def test_the_clock_is_monotonic_without_a_loop():
    before = time.monotonic()
    assert before <= now() <= time.monotonic()


async def test_the_clock_is_the_loops_inside_one():
    loop = asyncio.get_running_loop()
    before = loop.time()
    assert before <= now() <= loop.time()
