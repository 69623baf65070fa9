"""Pure: what a client key owns is namespaced by the key's scope, a digest that names its tenant.

With client keys (``--api-key``, ``--api-key-file``) a stored response, a kept turn, a
conversation and a client's media ``uuid`` belong to the key that made them: each carries
the key's scope, so another key finds nothing (docs/architecture.md, "Tenants' state"). The
scope is a 128-bit BLAKE2b digest, personalised for this use, of what identifies the tenant:

* the key's name, when the key file names it (``name:key``): the operator's word that keys of
  one name are one tenant, so a key rotated under its name keeps what the old one made;
* the key itself, when its name is only its position (``lineN`` in the file, ``keyN`` for
  ``--api-key``): inserting a line moves those names to other keys, never their scopes.

Never the key in clear: a store reader learns which entries share a tenant, not the key (a
guessable key stays guessable by digest, so keys should be random). The same on every
replica and worker with the same keys. Without client keys there is no scope: nothing is
namespaced and nothing is paid for it.
"""

from __future__ import annotations

import hashlib
import re

_PERSON = b"epd-proxy-scope"
_POSITIONAL = re.compile(r"(line|key)[0-9]+")


def key_scope(name: str, key: bytes) -> bytes:
    """The scope of the key ``key`` named ``name``."""
    basis = b"k" + key if _POSITIONAL.fullmatch(name) else b"n" + name.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(basis, digest_size=16, person=_PERSON).digest()


def salt(body: dict, scope: bytes) -> None:
    """``body`` (a chat or completions request the proxy owns) with vLLM's ``cache_salt`` set
    from the key's ``scope`` (``--cache-salt-per-key``): vLLM keys the prefix-cache blocks of a
    salted request with its salt, so requests of different keys never share a block, and no
    key can tell from its time to first token whether another sent a prompt. A client's own
    salt is kept after the key's (its isolation within the key); one that is not a string is
    left for vLLM to refuse."""
    own = body.get("cache_salt")
    if own is None or own == "":
        body["cache_salt"] = scope.hex()
    elif type(own) is str:
        body["cache_salt"] = scope.hex() + "." + own
