"""Who the client is: the peer's address, or the one the ``X-Forwarded-For`` chain names when
the peer is a trusted proxy (``--trusted-proxies``).

The chain is walked right to left, each address skipped while it is trusted, as nginx's
``real_ip_recursive on`` does: the first untrusted address is the client (every address
to its right was written by a proxy the operator runs), the leftmost one if all are
trusted. An entry that is not an address stops the walk and the peer is the answer
(nginx's realip declines such a header too): the chain cannot be believed past it.
Pure: the access log calls it, and only when it writes a line.
"""

from __future__ import annotations

import ipaddress

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def trusted_networks(cidrs) -> tuple[Network, ...]:
    """The networks of ``--trusted-proxies`` (ValueError for one that is not a network)."""
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as a peer or an X-Forwarded-For entry spells it (a port and brackets
    allowed: ``1.2.3.4:5``, ``[::1]:5``); None if it is not one."""
    if text.startswith("["):
        text = text[1:text.find("]")] if text.find("]") > 0 else text
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _trusted(ip, trusted: tuple[Network, ...]) -> bool:
    return any(ip in net for net in trusted)


def client_address(peer: str, forwarded_for: bytes | None, trusted: tuple[Network, ...]) -> str:
    """The client's address: ``peer`` unless it is trusted and ``forwarded_for`` says more."""
    if not trusted or not forwarded_for:
        return peer
    ip = _address(peer)
    if ip is None or not _trusted(ip, trusted):
        return peer
    hops = [h.strip() for h in forwarded_for.decode("latin-1").split(",")]
    hops = [h for h in hops if h]
    client = peer
    for hop in reversed(hops):
        ip = _address(hop)
        if ip is None:
            return peer
        client = str(ip)
        if not _trusted(ip, trusted):
            return client
    return client


def peer_host(peer) -> str:
    """The host of a transport's ``peername`` (``-`` when there is none, e.g. a Unix socket)."""
    if isinstance(peer, tuple) and peer:
        host = str(peer[0])
        return host[7:] if host.startswith("::ffff:") and "." in host else host
    return "-"
