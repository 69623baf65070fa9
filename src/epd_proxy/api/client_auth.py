"""Who may call the proxy's API: the client keys (``--api-key``, ``--api-key-file``).

Clients send ``Authorization: Bearer KEY``, as with vLLM's ``--api-key`` and the
OpenAI API, or ``X-Api-Key: KEY``, as Anthropic's SDK and the agents built on it do.
Keys are compared in constant time, all of them on every check, so neither a key's
content nor its position in the list shows in the answer's timing.

The key file holds one key per line, ``name:key`` (blank lines and ``#`` comments
ignored): the name is what the access log, the metrics and ``[[tenants.keys]]`` know
the key by (never the key itself). Without a ``[tenants]`` table a line may hold a key
alone, named after its line, ``line<N>``; with one, such a line is a mistake (a line
inserted above it would move another client's limits onto it), and so is a
``[[tenants.keys]]`` entry no key is named after (``check_tenant_names``). ``--api-key``
keys are named ``key1``, ``key2``, ... in the order given. No key may be named ``-``: that
is the requests without a key (the access log's ``key=-``, their own counters). The file is read again on every reload
(SIGHUP, reload.py; :meth:`ClientKeys.reload`): keys can be rotated without a restart.
A file that cannot be read at reload keeps the keys in force (a failed rotation must
not open the proxy to everyone, nor lock everyone out); a file that reads as empty
means no key is valid (the operator revoked them all).
Pure apart from reading the file: the HTTP layer passes the header in.
"""

from __future__ import annotations

import hmac
import logging

from epd_proxy.tenants.key_scope import key_scope
from epd_proxy.wire.errors import ProxyError

log = logging.getLogger("epd_proxy.auth")

_BEARER = b"bearer "
NO_KEY_NAME = "-"  # the requests without a key: never a key's name


def read_key_file(path: str, *, named: bool = False) -> list[tuple[str, str]]:
    """The ``(name, key)`` pairs of a key file; OSError/ValueError with the reason if it
    cannot be read. ``named`` (a ``[tenants]`` table is configured): a key without a name
    is a mistake."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if key and not key.startswith("#"):
            if any(c.isspace() for c in key):
                raise ValueError(f"{path}: a key contains whitespace (one key per line)")
            name, colon, secret = key.partition(":")
            if not colon and named:
                raise ValueError(f"{path} line {number}: a key without a name: with a [tenants] table every "
                                 f"key needs one ('name:key'), or a line inserted above it would move "
                                 f"another client's limits onto it")
            if not colon:
                name, secret = f"line{number}", key
            elif not name or not secret:
                raise ValueError(f"{path} line {number}: 'name:key' needs both a name and a key")
            elif name == NO_KEY_NAME:
                raise ValueError(f"{path} line {number}: the name {NO_KEY_NAME!r} is reserved: it stands for the "
                                 f"requests without a key (their access log field, their limits and counters)")
            keys.append((name, secret))
    return keys


def _named(flag_keys, file_keys: list[tuple[str, str]]
           ) -> tuple[tuple[bytes, ...], tuple[str, ...], dict[str, bytes]]:
    """The keys and their names, a key given twice kept once (its first name); and each
    name's scope (tenants/key_scope.py)."""
    pairs = [(f"key{i}", k) for i, k in enumerate(flag_keys, 1)] + file_keys
    seen: dict[bytes, str] = {}
    for name, key in pairs:
        seen.setdefault(key.encode(), name)
    scopes: dict[str, bytes] = {}
    for key, name in seen.items():
        scopes.setdefault(name, key_scope(name, key))
    return tuple(seen), tuple(seen.values()), scopes


def bearer_token(authorization: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer TOKEN`` header (scheme case-insensitive)."""
    if not authorization or len(authorization) <= len(_BEARER):
        return None
    if authorization[: len(_BEARER)].lower() != _BEARER:
        return None
    return authorization[len(_BEARER):].strip()


class ClientKeys:
    """The keys clients may present; the flag's keys plus the key file's."""

    __slots__ = ("_fixed", "_file", "_keys", "_names", "_scopes", "_named")

    def __init__(self, keys: tuple[str, ...] | list[str] = (), key_file: str | None = None, *,
                 named: bool = False) -> None:
        self._fixed = tuple(k for k in keys if k)
        self._file = key_file
        self._named = named  # with a [tenants] table, every file key has a name (read_key_file)
        file_keys = read_key_file(key_file, named=named) if key_file else []
        self._keys, self._names, self._scopes = _named(self._fixed, file_keys)
        if key_file and not file_keys:
            log.warning("--api-key-file %s holds no key%s", key_file,
                        "" if self._fixed else ": every API request gets 401 until it does")

    @classmethod
    def from_config(cls, config) -> "ClientKeys | None":
        """None when no client key is configured (the API is open, as vLLM's is without --api-key)."""
        if not config.api_keys and not config.api_key_file:
            return None
        try:
            return cls(config.api_keys, config.api_key_file, named=config.tenants is not None)
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {config.api_key_file}: {_reason(exc)}") from None
        except ValueError as exc:  # its own words name the file and the line
            raise ValueError(f"--api-key-file {exc}") from None

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def __len__(self) -> int:
        return len(self._keys)

    def identify(self, authorization: bytes | None, api_key: bytes | None = None) -> str | None:
        """The name of the valid key the headers carry (``Authorization: Bearer``, else
        ``X-Api-Key``), None if they carry none. Every key is compared, in constant time, and
        the match found without a branch (keys are unique)."""
        token = bearer_token(authorization) if authorization is not None else api_key
        if token is None:
            return None
        hit = 0
        for i, key in enumerate(self._keys, 1):
            hit += i * hmac.compare_digest(token, key)
        return self._names[hit - 1] if hit else None

    def scope(self, name: str | None) -> bytes | None:
        """The scope of the key named ``name``: what it owns is namespaced by it (key_scope.py)."""
        return None if name is None else self._scopes.get(name)

    def reload(self) -> None:
        """Read the key file again (a reload). If it cannot be read, the keys in force stay and
        ValueError says why (the reload counts as failed)."""
        if not self._file:
            return
        try:
            file_keys = read_key_file(self._file, named=self._named)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--api-key-file {self._file}: cannot read it ({_reason(exc)}); "
                             f"the keys in force stay") from None
        self._keys, self._names, self._scopes = _named(self._fixed, file_keys)
        log.info("--api-key-file %s reloaded: %d key(s) in force", self._file, len(self._keys))


def check_tenant_names(config) -> None:
    """With a ``[tenants]`` table: every ``[[tenants.keys]]`` entry names a key clients can
    present, or its limits would apply to no one while the key meant runs on the default's.
    ``ConfigErrors`` names each such entry, with the closest key name. (The table's own
    mistakes, and a key file that cannot be read, are their owners' to name.)"""
    import difflib

    from epd_proxy.config import ConfigErrors
    from epd_proxy.tenants.table import read_tenants

    if config.tenants is None:
        return
    try:
        table = read_tenants(config.tenants)
        keys = ClientKeys.from_config(config)
    except ValueError:
        return
    names = keys.names if keys is not None else ()
    errors = []
    for name in table.keys:
        if name in names:
            continue
        close = difflib.get_close_matches(name, names, n=1)
        where = (f"--api-key-file {config.api_key_file}" if config.api_key_file
                 else "--api-key (named key1, key2, ...)" if config.api_keys else "no client key is configured")
        errors.append(f"tenants.keys {name!r}: no client key is named {name!r} ({where}"
                      + (f"; did you mean {close[0]!r}?" if close else "") + "): its limits would apply to no one")
    if errors:
        raise ConfigErrors(errors)


def _reason(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc)


def unauthorized(message: str) -> ProxyError:
    """401 in the OpenAI envelope (``invalid_api_key``, as the OpenAI API answers)."""
    return ProxyError(401, message, type="invalid_request_error", code="invalid_api_key")


# The two answers to a refused API call, encoded once.
MISSING_KEY_BODY = unauthorized("missing API key: send 'Authorization: Bearer <key>'").body()
INVALID_KEY_BODY = unauthorized("invalid API key").body()
# A 401 names the scheme to use (RFC 9110 §11.6.1).
CHALLENGE = [(b"www-authenticate", b'Bearer realm="epd-proxy"')]


def presented_admin_key(headers: dict) -> bytes | None:
    """The admin key a request offers: ``X-API-Key`` (as the roster API takes it), else
    ``Authorization: Bearer`` (what most tools send, e.g. a Prometheus scrape config's
    ``authorization``)."""
    return headers.get(b"x-api-key") or bearer_token(headers.get(b"authorization"))


def admin_key_presented(headers: dict, admin_key: bytes) -> bool:
    """Whether a request carries the admin key (:func:`presented_admin_key`)."""
    token = presented_admin_key(headers)
    return token is not None and hmac.compare_digest(token, admin_key)
