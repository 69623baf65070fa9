"""Where one process's roster gets its instances besides the admin API: the cluster file
(a reload's ``static`` instances) and DNS names (``dns+``), applied through the roster shared
with the other ``--workers`` when there is one."""

from __future__ import annotations

from typing import Callable, Iterable

from epd_proxy.config import InstanceSpec, ProxyConfig
from epd_proxy.instances.discovery import DnsDiscovery
from epd_proxy.instances.membership import Membership
from epd_proxy.instances.shared import SharedRoster
from epd_proxy.observe.metrics import Collector


class RosterSources:
    """Applies the static and DNS instances to the roster. DNS discovery starts with the
    first ``dns+`` name (at start or in a reloaded file) and registers its collector then."""

    def __init__(self, membership: Membership, *, shared: SharedRoster | None, dns_interval: float,
                 dns_server: str | None, register: Callable[[Collector], None]) -> None:
        self.membership = membership
        self.shared = shared
        self.discovery: DnsDiscovery | None = None  # following dns+ names, once there is one
        self._dns_interval = dns_interval
        self._dns_server = dns_server
        self._register = register

    def apply_roster(self, specs: list[InstanceSpec], source: str):
        """``Membership.apply`` for changes every worker makes by itself (reload, DNS)."""
        if self.shared is None:
            return self.membership.apply(specs, source=source)
        with self.shared.local():
            return self.membership.apply(specs, source=source)

    def follow_dns(self, templates: Iterable[InstanceSpec]) -> None:
        """Follow these ``dns+`` names (and stop following the others)."""
        templates = list(templates)
        if templates and self.discovery is None:
            self.discovery = DnsDiscovery(self.apply_roster, interval=self._dns_interval, server=self._dns_server)
            self._register(self.discovery.collect)
        if self.discovery is not None:
            self.discovery.set_targets(templates)

    def apply_config(self, config: ProxyConfig) -> None:
        """A reloaded cluster file's instances into the roster, as one diff (requests in
        flight on an instance that leaves finish), and its DNS names into discovery."""
        self.apply_roster([*config.encode, *config.prefill, *config.decode], source="static")
        self.follow_dns(config.discover)

    async def close(self) -> None:
        if self.discovery is not None:
            await self.discovery.close()
