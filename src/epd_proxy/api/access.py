"""Who may change the roster, and who may look at it.

An unauthenticated roster endpoint would let anyone on the network send traffic
to a machine of their choosing, and ``/instances`` and ``/status`` show internal
addresses. So:

* changes (``POST``/``DELETE /instances``, ``/instances/drain``, profiling)
  need ``X-API-Key`` equal to the admin key (constant-time comparison);
* with no admin key configured, changes are refused, except registration from
  the networks listed with ``--registration-allow`` (vLLM's registrar sends no
  key), checked against the peer address;
* the views need the admin key whenever one is configured.

A refusal is 401 when no key was sent (and one could help), else 403. Pure:
the HTTP layer passes in the header and the peer, and sends what it gets back.
"""

from __future__ import annotations

import hmac
import ipaddress

from epd_proxy.wire.errors import ProxyError

READ = "read"  # GET /instances, /status
REGISTER = "register"  # roster changes: keyless from an allowed network
ADMIN = "admin"  # profiling: the key only


class AccessPolicy:
    def __init__(self, admin_key: str | None = None, allow: tuple[str, ...] | list[str] = ()) -> None:
        self._key = admin_key.encode() if admin_key else None
        self._nets = tuple(ipaddress.ip_network(c, strict=False) for c in allow)

    @property
    def registration_on(self) -> bool:
        return self._key is not None or bool(self._nets)

    def check(self, action: str, key: bytes | None, peer_ip: str | None) -> ProxyError | None:
        """None if allowed, else the error to answer with."""
        if key is not None and self._key is not None:
            if hmac.compare_digest(key, self._key):
                return None
            return ProxyError(403, "invalid X-API-Key")
        # No key sent, or none configured (then a key sent proves nothing).
        if action == READ and self._key is None:
            return None
        if action == REGISTER and self._allowed_peer(peer_ip):
            return None
        if self._key is not None:  # a key would help
            return ProxyError(401, "X-API-Key header required")
        if action == REGISTER and self._nets:
            return ProxyError(403, "registration is not allowed from this address")
        return ProxyError(403, "roster changes are off: no admin API key is configured (--admin-api-key)",
                          type="PermissionDeniedError")

    def _allowed_peer(self, peer_ip: str | None) -> bool:
        if not self._nets or not peer_ip:
            return False
        try:
            addr = ipaddress.ip_address(peer_ip.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in net for net in self._nets)


def peer_ip(peer) -> str | None:
    """The address part of a transport's ``peername``."""
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return None
