"""Pure: what a client key owns is namespaced by the key's scope, a digest of the key itself.

With client keys (``--api-key``, ``--api-key-file``) a stored response, a kept turn, a
conversation and a client's media ``uuid`` belong to the key that made them: each carries
the key's scope, so another key finds nothing (docs/architecture.md, "Tenants' state"). The
scope is a 128-bit BLAKE2b digest of the key (personalised for this use): never the key,
the same on every replica and worker that holds the key, and another one when the key is
rotated (what the old key made is not the new key's). A store reader learns which entries
share a key, not the key; a guessable key stays guessable, so keys should be random.

The key's name (the access log's, the ``[tenants]`` table's) travels through the request
path as a :class:`KeyName`: a ``str`` like any name, carrying its ``scope``. Without client
keys there is no name and no scope: nothing is namespaced and nothing is paid for it.
"""

from __future__ import annotations

import hashlib

_PERSON = b"epd-proxy-scope"


class KeyName(str):
    """The name of a client key, with the scope of the key it names."""

    scope: bytes


def key_name(name: str, key: bytes) -> KeyName:
    """``name`` carrying the scope of ``key``."""
    out = KeyName(name)
    out.scope = hashlib.blake2b(key, digest_size=16, person=_PERSON).digest()
    return out


def scope_of(key: str | None) -> bytes | None:
    """The scope of the key a request presented; None without one (or without keys)."""
    return key.scope if isinstance(key, KeyName) else None
