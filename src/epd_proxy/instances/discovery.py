"""DNS discovery: ``dns+http://NAME:PORT`` stands for every address NAME resolves to.

Made for Kubernetes headless Services (one A/AAAA record per ready pod) and
similar. Each name is re-resolved in the background; the addresses become the
roster of the source ``dns:<role>:<template URL>`` through
``Membership.apply``, so an address that appears is added and one that
disappears is drained (its requests in flight finish). dnspython is used
rather than the system resolver because it can be pointed at a given server
(``--dns-server``) and reports the records' TTL.

The decisions are pure functions (``instances_for``, ``next_delay``); the
``DnsDiscovery`` class is their I/O shell.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
from typing import Callable, Iterable
from urllib.parse import urlsplit, urlunsplit

from epd_proxy.config import InstanceSpec, MembershipConfig

log = logging.getLogger("epd_proxy.discovery")

# Never re-resolve more often than this, whatever a record's TTL says.
MIN_INTERVAL = 1.0
# After a failed lookup (timeout, SERVFAIL, server unreachable): retry this much sooner.
RETRY_INTERVAL = 2.0


def source_of(template: InstanceSpec) -> str:
    """The roster source a DNS name's instances belong to."""
    return f"dns:{template.role}:{template.url}"


def instances_for(template: InstanceSpec, addresses: Iterable[str]) -> list[InstanceSpec]:
    """One instance per address: the template's URL with the address as host (sorted,
    duplicates dropped, so that the same answer in another order is no change)."""
    u = urlsplit(template.url)
    out = []
    for addr in sorted(set(addresses), key=_sort_key):
        host = f"[{addr}]" if ":" in addr else addr
        netloc = f"{host}:{u.port}" if u.port is not None else host
        out.append(dataclasses.replace(template, url=urlunsplit((u.scheme, netloc, u.path, "", ""))))
    return out


def next_delay(ttl: float | None, interval: float) -> float:
    """The wait before the next lookup: ``interval`` at most; the record's TTL when that
    is shorter (a short TTL announces change), but not below ``MIN_INTERVAL``."""
    if ttl is None:
        return interval
    return min(interval, max(MIN_INTERVAL, float(ttl)))


def check_config(membership: MembershipConfig) -> None:
    """``--dns-server``, beside the resolver that uses it."""
    if membership.dns_server:
        parse_server(membership.dns_server)


def parse_server(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``; port 53 when omitted) → (address, port)."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
    try:
        ipaddress.ip_address(host)
        number = int(port) if port else 53
    except ValueError:
        raise ValueError(f"--dns-server {text!r}: expected IP:PORT, e.g. 10.96.0.10:53") from None
    if not 0 < number < 65536:
        raise ValueError(f"--dns-server {text!r}: invalid port")
    return host, number


def _sort_key(addr: str):
    try:
        ip = ipaddress.ip_address(addr)
        return (ip.version, int(ip))
    except ValueError:  # pragma: no cover - resolvers return addresses
        return (9, addr)


class LookupFailed(Exception):
    """The name could not be resolved this time (keep what we have, retry sooner)."""


class Resolver:
    """A/AAAA lookups with dnspython: the system's configuration, or one given server."""

    def __init__(self, server: str | None = None, timeout: float = 2.0) -> None:
        import dns.asyncresolver

        if server:
            host, port = parse_server(server)
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [host]
            self._resolver.port = port
            self._search = False
        else:
            self._resolver = dns.asyncresolver.Resolver()
            self._search = True  # short in-cluster names ("decode.ns") use the search list
        self._resolver.lifetime = timeout
        self._resolver.cache = None  # every lookup asks the server: that is the point

    async def addresses(self, name: str) -> tuple[list[str], float | None]:
        """Every address of ``name`` and the shortest TTL; an empty list when the name has
        none (NXDOMAIN or no records: the Service has no ready endpoint)."""
        results = await asyncio.gather(self._query(name, "A"), self._query(name, "AAAA"))
        addrs = [a for found, _ in results for a in found]
        ttls = [t for _, t in results if t is not None]
        return addrs, (min(ttls) if ttls else None)

    async def _query(self, name: str, rdtype: str) -> tuple[list[str], float | None]:
        import dns.exception
        import dns.resolver

        try:
            answer = await self._resolver.resolve(name, rdtype, search=self._search)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return [], None
        except (dns.resolver.NoNameservers, dns.exception.Timeout, dns.resolver.LifetimeTimeout) as exc:
            raise LookupFailed(f"{rdtype} {name}: {exc}") from None
        except dns.exception.DNSException as exc:
            raise LookupFailed(f"{rdtype} {name}: {exc}") from None
        return [r.address for r in answer], float(answer.rrset.ttl) if answer.rrset is not None else None


class DnsDiscovery:
    """Keeps each DNS name's addresses in the roster (one task per name)."""

    def __init__(self, apply: Callable[[list[InstanceSpec], str], object], *, interval: float,
                 server: str | None = None, resolver: Resolver | None = None) -> None:
        self._apply = apply  # (specs, source) -> None: Membership.apply
        self.interval = interval
        self.resolver = resolver or Resolver(server)
        self._tasks: dict[InstanceSpec, asyncio.Task] = {}
        self.lookups = 0  # completed lookups (tests wait on it)
        self.failures = 0
        self.last: dict[str, list[str]] = {}  # source -> addresses last applied
        self._failing: set[str] = set()  # sources whose last lookup failed

    def set_targets(self, templates: Iterable[InstanceSpec]) -> None:
        """Start following new names; stop following removed ones (their instances leave)."""
        wanted = list(dict.fromkeys(templates))
        for template in list(self._tasks):
            if template not in wanted:
                self._tasks.pop(template).cancel()
                source = source_of(template)
                self.last.pop(source, None)
                self._failing.discard(source)
                self._apply([], source)
                log.info("stopped discovering %s instances at %s", template.role, template.url)
        loop = asyncio.get_running_loop()
        for template in wanted:
            if template not in self._tasks:
                self._tasks[template] = loop.create_task(self._follow(template))

    async def refresh(self, template: InstanceSpec) -> float:
        """One lookup and its roster update; returns the wait before the next one."""
        source = source_of(template)
        name = urlsplit(template.url).hostname or ""
        try:
            addrs, ttl = await self.resolver.addresses(name)
        except LookupFailed as exc:
            self.failures += 1
            # Once per outage (then debug): a DNS server that is down must not flood the log.
            level = logging.DEBUG if source in self._failing else logging.WARNING
            self._failing.add(source)
            log.log(level, "DNS lookup for %s instances failed, keeping %d known (retrying every %g s): %s",
                    template.role, len(self.last.get(source, [])), min(self.interval, RETRY_INTERVAL), exc)
            return min(self.interval, RETRY_INTERVAL)
        if source in self._failing:
            self._failing.discard(source)
            log.info("DNS lookups for %s instances at %s answer again", template.role, template.url)
        specs = instances_for(template, addrs)
        urls = [s.url for s in specs]
        if urls != self.last.get(source):
            if not urls:
                log.warning("DNS name %s has no address now: draining its %s instances", name, template.role)
            else:
                log.info("DNS name %s: %s instances %s", name, template.role, ", ".join(urls))
            self._apply(specs, source)
            self.last[source] = urls
        self.lookups += 1
        return next_delay(ttl, self.interval)

    async def _follow(self, template: InstanceSpec) -> None:
        while True:
            try:
                delay = await self.refresh(template)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let discovery die
                log.exception("DNS discovery error (%s %s)", template.role, template.url)
                delay = self.interval
            await asyncio.sleep(delay)

    def collect(self, f: dict[str, list]) -> None:
        """Its lookups, for ``/metrics`` (registered as a collector)."""
        f["epd_proxy_dns_lookups"] = [["ok", self.lookups], ["failed", self.failures]]

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
