"""What a simulated instance's request handlers read of the instance that holds them.

``generation.py`` (with ``answers.py``) and ``observability.py`` are given the whole
``SimInstance`` but name it through ``SimHost``, the part of it they use, so that none
imports the instance module that builds them. (``kv_channel.py`` reads less, the instance's identity, and
names that beside itself: ``KvOwner``; this module types the instance's ``kv``.)
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, Protocol

from epd_proxy.sim.config import SimConfig
from epd_proxy.sim.ec_store import EcStore
from epd_proxy.sim.encoder_cache import EncoderCache
from epd_proxy.sim.engine import Engine
from epd_proxy.sim.faults import FaultSource
from epd_proxy.sim.kv_channel import KvSideChannel
from epd_proxy.sim.kv_events import KvEventPublisher
from epd_proxy.sim.kv_reuse import KvReuse
from epd_proxy.sim.lora import LoraSlots
from epd_proxy.sim.prefix_cache import PrefixCache
from epd_proxy.sim.records import SimRecord, Stats
from epd_proxy.sim.validation import ApiError


class SimHost(Protocol):
    """The instance as its generation handler and its observability views see it."""

    # identity
    name: str
    role: str
    engine_id: str
    host: str
    port: int
    created: int
    created_bytes: bytes
    system_fingerprint: str | None
    fingerprint_json: bytes
    config: SimConfig
    # state and collaborators
    crashed: bool
    stats: Stats
    engine: Engine | None
    kv: KvSideChannel
    kv_reuse: KvReuse
    lora: LoraSlots
    prefix_cache: PrefixCache | None
    kv_events: KvEventPublisher | None
    encoder_cache: EncoderCache | None
    ec_store: EcStore
    faults: FaultSource

    @property
    def url(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    def new_record(self, req, t: float) -> SimRecord | None: ...

    def send_error(self, writer, rec: SimRecord | None, exc: ApiError, headers=None,
                   body: bytes | None = None) -> None: ...

    def set_unhealthy_for(self, seconds: float) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task: ...

    async def crash_and_restart(self, after: float | None) -> None: ...
