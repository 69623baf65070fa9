"""The store a configuration names: Redis/Valkey with ``--state-store``; with ``--workers``
and no URL, the parent over the worker's channel; otherwise none (this process's memory,
as ``TurnStore`` and ``ResponseOwners`` keep it)."""

from __future__ import annotations

import os

from epd_proxy.config import ProxyConfig
from epd_proxy.state.guard import GuardedStore
from epd_proxy.state.parent import Link, ParentStore
from epd_proxy.state.redis_store import RedisStore

PASSWORD_ENV = "EPD_PROXY_STATE_STORE_PASSWORD"


def password(config: ProxyConfig) -> str | None:
    """The store's password: the file's first line, else the environment's (never a flag's
    value, which ``ps`` shows, nor anything a client sends)."""
    if config.state_store_password_file:
        with open(config.state_store_password_file, encoding="utf-8") as f:
            return f.readline().rstrip("\r\n") or None
    return os.environ.get(PASSWORD_ENV) or None


def open_store(config: ProxyConfig, link: Link | None = None) -> GuardedStore | None:
    """The shared store for this process, guarded (``guard.py``); None without one."""
    if config.state_store:
        store = RedisStore(config.state_store, password(config), config.state_store_timeout)
        return GuardedStore(store, config.state_store_prefix, config.state_store_timeout, store.url)
    if link is not None:
        return GuardedStore(ParentStore(link), config.state_store_prefix, config.state_store_timeout)
    return None
