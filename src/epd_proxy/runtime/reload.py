"""Reloading at run time: SIGHUP, and a change to the cluster file, re-read what may change.

There is one reload path: SIGHUP. Under ``--workers`` the parent process
handles it (and watches the cluster file) and passes it on to every worker;
a single process does both itself. A reload re-reads the cluster file (the
command line's flags still override it) and applies the instances as a
roster diff (``Membership.apply(..., source="config")``: requests in flight
finish on the instances that leave), then re-targets DNS discovery. Every
other setting is read at start only: a changed one is logged as needing a
restart. Other reloadable things add themselves with ``Reloader.on_reload``.

A reload never empties a role by accident: a file that would leave a role running
instances with none (an emptied list, a section renamed) is refused like a bad file
unless ``allow_empty_roles`` names the role; with ``--simulate`` the simulated
instances stay whatever the file lists.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Callable

from epd_proxy.config import ROLES, ProxyConfig, split_instances
from epd_proxy.runtime.simulated import config_for_addresses

# Besides the instances, what a reload applies at once (tenants/limiter.py's hook).
RELOADED = (*ROLES, "tenants", "model_aliases", "allow_empty_roles")

log = logging.getLogger("epd_proxy.reload")

# How often the cluster file's modification time and size are compared.
WATCH_INTERVAL = 1.0


def restart_needed(old: argparse.Namespace, new: argparse.Namespace) -> list[str]:
    """The settings that changed but are only read at start (everything but the instances
    and the tenants' tables)."""
    before, after = vars(old), vars(new)
    return sorted(key for key in before.keys() | after.keys()
                  if key not in RELOADED and before.get(key) != after.get(key))


def emptied_roles(running: argparse.Namespace, config: ProxyConfig, *, allowed: bool = False) -> list[str]:
    """The roles the running settings give instances (URLs or DNS names) that ``config``
    leaves with none: those its ``allow_empty_roles`` does not name (``allowed``: those it does)."""
    return [role for role in ROLES
            if (role in config.allow_empty_roles) == allowed and split_instances(getattr(running, role, None))
            and not getattr(config, role) and not any(spec.role == role for spec in config.discover)]


def file_stamp(path: str) -> tuple[int, int, int] | None:
    """What tells a changed file apart (also one replaced by a rename, as editors and
    Kubernetes ConfigMap updates do); None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class FileWatch:
    """Polls one file's stamp; ``changed()`` is true once per change."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = file_stamp(path)

    def changed(self) -> bool:
        stamp = file_stamp(self.path)
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        return True


class Reloader:
    """Runs reloads in one process: on SIGHUP, and (``watch``) when the file changes."""

    def __init__(self, settings, apply: Callable[[ProxyConfig], None], *, args: argparse.Namespace | None,
                 watch: bool = True) -> None:
        self.settings = settings  # serve_command.ServeSettings (None: no cluster file, only the hooks)
        self._apply = apply  # the new config's instances into the roster
        self.args = args  # the settings in force
        self.watch = watch and settings is not None and settings.path is not None
        # With --simulate, the simulated cluster's addresses (simulated.addresses_of): its
        # instances are the roster whatever the file lists.
        self.simulated: dict | None = None
        self.reloads = 0  # reloads run (tests wait on it)
        self.failures = 0  # of which failed (a bad file, a failed hook): the running configuration kept
        self._hooks: list[Callable[[], None]] = []
        self._config_hooks: list[Callable[[ProxyConfig], None]] = []
        self._task: asyncio.Task | None = None
        self._pending = False

    def on_reload(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)

    def on_config(self, hook: Callable[[ProxyConfig], None]) -> None:
        """``hook(config)`` with each reloaded file's validated config (what it applies of it)."""
        self._config_hooks.append(hook)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, self.request)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (embedding)
            pass
        if self.watch:
            self._task = loop.create_task(self._watch(FileWatch(self.settings.path)))

    def request(self) -> None:
        """Reload soon (signals coalesce: one reload for a burst)."""
        if not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._pending = False
        self.reload()

    def reload(self) -> bool:
        """Re-read and apply; on a bad file, log one line and keep what runs."""
        ok = True
        if self.settings is not None and self.settings.path:
            ok = self._reload_file()
        elif not self._hooks:
            log.info("reload: no cluster file to re-read (--config)")
        for hook in self._hooks:
            try:
                hook()
            except ValueError as exc:  # a hook's own words for what it could not reload
                ok = False
                log.error("reload: %s", exc)
            except Exception:
                ok = False
                log.exception("reload hook failed")
        self.reloads += 1
        if not ok:
            self.failures += 1
        return ok

    def _reload_file(self) -> bool:
        assert self.args is not None  # a cluster file comes with the settings it started with
        path = self.settings.path
        try:
            args = self.settings.load()
            config = self.settings.config(args)
        except ValueError as exc:
            msg = str(exc)
            log.error("reload: %s; keeping the running configuration", msg if msg.startswith(path)
                      else f"{path}: {msg}")
            return False
        if self.simulated is not None:
            config = config_for_addresses(self.simulated, config)
        else:
            emptied = emptied_roles(self.args, config)
            if emptied:
                log.warning("reload: %s leaves %s with no instance; keeping the running configuration "
                            "(to empty a role on purpose, name it in allow_empty_roles)", path,
                            " and ".join(emptied))
                return False
            drained = emptied_roles(self.args, config, allowed=True)
            if drained:
                log.warning("reload: %s empties %s, as its allow_empty_roles says", path, " and ".join(drained))
        changed = restart_needed(self.args, args)
        if changed:
            log.warning("reload: %s changed %s: applied at the next restart only", path, ", ".join(changed))
        self._apply(config)
        for hook in self._config_hooks:
            hook(config)
        log.info("reload: %s applied (%s)", path, ", ".join(
            f"{len(getattr(config, r))} {r}" for r in ROLES)
            + (f", {len(config.discover)} DNS name(s)" if config.discover else ""))
        # What runs: the instances from this file; the rest as started.
        for dest in RELOADED:
            setattr(self.args, dest, getattr(args, dest, None))
        return True

    async def _watch(self, watch: FileWatch) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            try:
                if watch.changed():
                    log.info("reload: %s changed", watch.path)
                    self.request()
            except Exception:  # never let the watcher die
                log.exception("watching %s", watch.path)

    def collect(self, f: dict[str, list]) -> None:
        """Its reloads, for ``/metrics`` (registered as a collector)."""
        f["epd_proxy_reloads"] = [["ok", self.reloads - self.failures], ["failed", self.failures]]

    async def close(self) -> None:
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
