"""Who may change the roster, and who may look at it.

An unauthenticated roster endpoint would let anyone on the network send traffic
to a machine of their choosing, and ``/instances``, ``/status`` and ``/metrics``
(whose labels carry instance URLs) show internal addresses. So:

* changes (``POST``/``DELETE /instances``, ``/instances/drain``, profiling)
  need the admin key (constant-time comparison);
* with no admin key configured, changes are refused, except registration from
  the networks listed with ``--registration-allow`` (vLLM's registrar sends no
  key), checked against the peer address;
* the views need the admin key whenever one is configured; with client keys
  (``--api-key``) and no admin key they are refused to everyone: whoever locked
  the API meant the backends' addresses to be private too, and a client key
  is a tenant's, not an operator's. With no key at all they are open (a
  development set-up, as vLLM is without ``--api-key``).

The admin key is accepted as ``X-API-Key`` or ``Authorization: Bearer`` (what
most tools send). A refusal is 401 when no key was sent (and one could help),
else 403. Pure: the HTTP layer passes in the key and the peer, and sends what it
gets back.
"""

from __future__ import annotations

import hmac
import ipaddress

from epd_proxy.wire.errors import ProxyError

READ = "read"  # GET /instances, /status, /metrics
REGISTER = "register"  # roster changes: keyless from an allowed network
ADMIN = "admin"  # profiling, LoRA loads and unloads: the key only


class AccessPolicy:
    def __init__(self, admin_key: str | None = None, allow: tuple[str, ...] | list[str] = (), *,
                 client_keys: bool = False) -> None:
        self._key = admin_key.encode() if admin_key else None
        self._nets = tuple(ipaddress.ip_network(c, strict=False) for c in allow)
        self._client_keys = client_keys  # --api-key/--api-key-file: the views are never open

    @classmethod
    def from_config(cls, config) -> "AccessPolicy":
        return cls(config.admin_api_key, config.registration_allow,
                   client_keys=bool(config.api_keys or config.api_key_file))

    @property
    def registration_on(self) -> bool:
        return self._key is not None or bool(self._nets)

    def check(self, action: str, key: bytes | None, peer_ip: str | None) -> ProxyError | None:
        """None if allowed, else the error to answer with."""
        if key is not None and self._key is not None:
            if hmac.compare_digest(key, self._key):
                return None
            return ProxyError(403, "invalid admin API key")
        # No key sent, or none configured (then a key sent proves nothing).
        if action == READ and self._key is None:
            if not self._client_keys:
                return None
            return ProxyError(403, "this view shows backend addresses: with client keys (--api-key) it needs "
                                   "the admin API key, and none is configured (--admin-api-key)",
                              type="PermissionDeniedError")
        if action == REGISTER and self._allowed_peer(peer_ip):
            return None
        if self._key is not None:  # a key would help
            return ProxyError(401, "admin API key required: send it as X-API-Key or Authorization: Bearer")
        if action == REGISTER and self._nets:
            return ProxyError(403, "registration is not allowed from this address")
        if action == ADMIN:
            return ProxyError(403, "profiling and LoRA adapter loads and unloads are off: they need the admin API "
                                   "key, and none is configured (--admin-api-key)", type="PermissionDeniedError")
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
