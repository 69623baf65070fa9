"""A placement steered by the gateway's endpoint picker (``epd-proxy sidecar``): llm-d's headers.

The picker chose the decode (the sidecar's own instance) and tells its sidecar where to prefill
with ``x-prefiller-host-port`` (``host:port``; a comma list, or the header repeated, is read as
ordered alternatives: llm-d's sidecar takes the first) and which encoders to send the media
items to with ``x-encoder-hosts-ports`` (a comma list). The sidecar runs the proxy's own
pipeline: :meth:`Steering.read` turns the headers into a :class:`Steered`, the request's host
set, and :meth:`Steering.apply` puts its prefill into the placement ``decision.place`` made over
the sidecar's one decode (the placement itself names no prefill there: the sidecar's ``Known``
has none). The encoders named are the only ones the placement's encoders step and the encode
stage may use: every other encoder the sidecar learnt is in the request's ``excluded`` (as the
endpoint picker's subset hint excludes instances, ``gateway/pick.py``).

Without ``x-prefiller-host-port`` the local decode serves the request whole (what llm-d's
sidecar does); so it does when every prefill named has failed this request (a retry then
computes the prompt on the decode rather than failing it). Without ``x-encoder-hosts-ports``
the media go to the prefill and decode as the client sent them (the engines encode them).

Nothing a client sends may reach an arbitrary host: an address outside the allow-list
(``--allowed-targets``, CIDR blocks; default loopback and the private ranges) refuses the
request with 403, for a prefill or an encoder alike, and a host must be a literal IP address
(no name is resolved on a client's behalf). Instances named are learnt into the sidecar's own
prefill and encode pools (their health, outlier ejection, connections, metrics and console
rows are the proxy's), at most ``LEARNT_MAX`` per role: past it the least recently named one
that has nothing in flight leaves its pool, its connections closed. An instance configured
with ``--prefill``/``--encode`` is used as configured when named (never otherwise): that is how
a connector that needs a prefill's identity (NIXL push's engine id and side channel, Mooncake's
bootstrap port) gets it; such a connector refuses, with 403, a prefill named that is not
configured. NIXL's pull connector needs nothing but the address (the prefill's answer carries
its identity).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.decision import HOLDS_TURN, Placement
from epd_proxy.wire.errors import ProxyError

PREFILLER = b"x-prefiller-host-port"
ENCODERS = b"x-encoder-hosts-ports"
WHY = "named by the gateway (x-prefiller-host-port)"
# Loopback, RFC 1918, and IPv6 unique-local and loopback: a cluster's pod networks.
DEFAULT_ALLOWED = ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "::1/128", "fc00::/7")
LEARNT_MAX = 64
SOURCE = "gateway"  # the roster's source of a learnt instance (/instances, the console)

Networks = tuple["ipaddress.IPv4Network | ipaddress.IPv6Network", ...]


def parse_networks(blocks: Sequence[str]) -> Networks:
    """The allow-list's CIDR blocks (ValueError names a bad one)."""
    return tuple(ipaddress.ip_network(b.strip(), strict=False) for b in blocks if b.strip())


def addresses(value: bytes, allowed: Networks, what: str = "prefill") -> list[str]:
    """The ``host:port`` entries of a header, in order, each once, each checked against
    ``allowed`` (403 for a malformed entry or one outside it): the URLs of the instances named."""
    out: list[str] = []
    for raw in value.decode("latin-1").split(","):
        entry = raw.strip()
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ip = ipaddress.ip_address(host)
            number = int(port)
        except ValueError:
            raise ProxyError(403, f"the {what} address named is not an IP address and port") from None
        if not sep or not 0 < number < 65536 or not any(ip in net for net in allowed):
            raise ProxyError(403, f"the {what} address named is not allowed here")
        url = f"http://[{ip}]:{number}" if ip.version == 6 else f"http://{ip}:{number}"
        if url not in out:
            out.append(url)
    return out


@dataclass(slots=True)
class Steered:
    """What the gateway named for one request: the prefill's ordered alternatives (empty: the
    local decode computes the prompt) and the encoders (empty: no encode leg)."""

    prefills: list[Instance] = field(default_factory=list)
    encoders: list[Instance] = field(default_factory=list)


class LearntInstances:
    """The instances of one role named by headers, members of the sidecar's pool of that role,
    the most recently named last; at most ``size``."""

    def __init__(self, pool: InstancePool, size: int = LEARNT_MAX,
                 check: Callable[[list[InstanceSpec]], None] | None = None) -> None:
        self.pool = pool
        self.size = size
        self.check = check  # ValueError: an instance the connector cannot use by its address alone
        self._by_url: OrderedDict[str, Instance] = OrderedDict()
        self._closing: set[asyncio.Task] = set()

    def get(self, url: str) -> Instance:
        inst = self._by_url.get(url)
        if inst is not None:
            self._by_url.move_to_end(url)
            return inst
        known = self.pool.find(url)
        if known is not None:  # configured (--prefill, --encode): its identity known, never let go
            return known
        spec = InstanceSpec(url, self.pool.role)
        if self.check is not None:
            try:
                self.check([spec])
            except ValueError:
                raise ProxyError(403, f"the {self.pool.role} address named is not one this sidecar knows: its KV "
                                      f"connector needs the instance's identity (--{self.pool.role})") from None
        inst = self._by_url[url] = self.pool.add(spec)
        inst.source = SOURCE
        if len(self._by_url) > self.size:  # the least recently named with nothing in flight leaves
            old = next((i for i in self._by_url.values() if not i.inflight and i is not inst), None)
            if old is not None:
                del self._by_url[old.url]
                self.pool.remove(old)
                task = asyncio.get_running_loop().create_task(old.connections.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        return inst

    def __len__(self) -> int:
        return len(self._by_url)

    def others(self, named: Sequence[Instance]) -> list[Instance]:
        """The pool's instances not ``named``."""
        return [i for i in self.pool.instances if i not in named]

    async def close(self) -> None:
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class Steering:
    """Reads the picker's headers of a request and applies them to its placement."""

    def __init__(self, prefill: InstancePool, encode: InstancePool, allowed: Sequence[str] = DEFAULT_ALLOWED,
                 connector: str = "nixl", size: int = LEARNT_MAX,
                 check: Callable[[list[InstanceSpec]], None] | None = None) -> None:
        self.allowed = parse_networks(allowed)
        self.connector = connector
        self.prefills = LearntInstances(prefill, size, check)
        self.encoders = LearntInstances(encode, size)

    def read(self, headers: dict[bytes, bytes], excluded: set[Instance]) -> Steered:
        """What the headers name (403 for an address not allowed); the encoders not named are
        added to the request's ``excluded``."""
        steered = Steered()
        value = headers.get(PREFILLER)
        if value:
            steered.prefills = [self.prefills.get(u) for u in addresses(value, self.allowed)]
        value = headers.get(ENCODERS)
        if value:
            steered.encoders = named = [self.encoders.get(u) for u in addresses(value, self.allowed, "encoder")]
            excluded.update(self.encoders.others(named))
        return steered

    def apply(self, steered: Steered, placed: Placement, excluded: set[Instance]) -> Placement:
        """``placed`` (the local decode) with the first named prefill that has not failed this
        request, preferring one in rotation; none left (or none named): the decode computes the
        prompt. A decode holding the conversation's previous turn computes the new part alone,
        as the proxy's placement decided."""
        if placed.decode_why is HOLDS_TURN:
            return placed
        named = [i for i in steered.prefills if i not in excluded]
        if named:
            placed.prefill = next((i for i in named if not i.health.out), named[0])
            placed.prefill_why, placed.connector, placed.prefill_among = WHY, self.connector, named
        return placed

    async def close(self) -> None:
        await self.prefills.close()
        await self.encoders.close()
