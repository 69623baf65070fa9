"""The cluster file (``--config cluster.toml``): every ``serve`` flag as a TOML key.

Pure: ``read_cluster_file`` turns the file's text into the values the command
line would have produced (per flag destination), checked against the options
the caller describes, so the file covers every flag without a second list of
settings to keep in step. Instances are arrays under the role names, each a
URL string or a table whose keys are the ``;key=value`` attributes::

    port = 8000
    kv_connector = "nixl"

    [[prefill]]
    url = "http://p1:8100"
    engine_id = "prefill-0"
    kv_port = 5600

    decode = ["http://d1:8200", "dns+http://decode.ns.svc.cluster.local:8200"]

Errors are ``ClusterFileError``: one line per mistake an operator can act on, every
mistake of the file at once.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from typing import Callable

from epd_proxy.config import ConfigErrors

ROLE_KEYS = ("encode", "prefill", "decode")
# Tables that are no flag: kept as read, checked by their owners (tenants/table.py, tenants/aliases.py).
TABLE_KEYS = ("tenants", "model_aliases")


class ClusterFileError(ConfigErrors):
    """The file cannot be used; one line per mistake, each naming the key at fault."""

    def __init__(self, errors: str | list[str]) -> None:
        super().__init__([errors] if isinstance(errors, str) else errors)


@dataclass(frozen=True, slots=True)
class Option:
    """One setting the file may hold: a flag's destination and the type it takes."""

    dest: str
    kind: str  # "int", "float", "str", "bool", "strlist" (a repeatable flag), "csv" (a comma-separated
    # flag), "parsed" (a string or number the flag's own ``parse`` reads, e.g. "64M")
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], object] | None = None


def read_cluster_file(text: str, options: dict[str, Option], *, source: str = "config") -> dict[str, object]:
    """The file's settings by flag destination, instances as ``URL;key=value`` strings."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterFileError(f"{source}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # pragma: no cover - loads takes str
        raise ClusterFileError(f"{source}: not text: {exc}") from None
    out: dict[str, object] = {}
    errors: list[str] = []
    for key, value in data.items():
        dest = key.replace("-", "_")
        try:
            if dest in ROLE_KEYS:
                out[dest] = _instances(dest, value, source)
                continue
            if dest in TABLE_KEYS:
                if not isinstance(value, dict):
                    raise ClusterFileError(f"{source}: {key} must be a table ([{key}]), got {value!r}")
                out[dest] = value
                continue
            option = options.get(dest)
            if option is None:
                raise ClusterFileError(f"{source}: unknown key {key!r}" + _suggest(dest, options))
            out[dest] = _value(key, value, option, source)
        except ClusterFileError as exc:
            errors.extend(exc.errors)
    if errors:
        raise ClusterFileError(errors)
    return out


def read_cluster_path(path: str, options: dict[str, Option]) -> dict[str, object]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ClusterFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ClusterFileError(f"{path}: not UTF-8 text") from None
    return read_cluster_file(text, options, source=path)


def _value(key: str, value: object, option: Option, source: str) -> object:
    kind = option.kind
    where = f"{source}: {key}"
    if kind == "bool":
        if not isinstance(value, bool):
            raise ClusterFileError(f"{where} must be true or false, got {value!r}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ClusterFileError(f"{where} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ClusterFileError(f"{where} must be a number, got {value!r}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ClusterFileError(f"{where} must be a string, got {value!r}")
        if option.choices and value not in option.choices:
            raise ClusterFileError(f"{where} must be one of {', '.join(option.choices)}, got {value!r}")
        return value
    if kind == "parsed":
        assert option.parse is not None  # every "parsed" option has its parser
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ClusterFileError(f"{where} must be a string or a number, got {value!r}")
        try:
            return option.parse(str(value))
        except Exception as exc:  # the flag's own message (ValueError, argparse.ArgumentTypeError)
            raise ClusterFileError(f"{where}: {exc}") from None
    if kind in ("strlist", "csv"):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ClusterFileError(f"{where} must be a string or a list of strings, got {value!r}")
        return ",".join(items) if kind == "csv" else list(items)
    raise AssertionError(kind)  # pragma: no cover


def _instances(role: str, value: object, source: str) -> list[str]:
    """Instances as the flag's ``URL;key=value`` text (parsed and checked by ``config.parse_instance``)."""
    entries = value if isinstance(value, list) else [value]
    out = []
    for n, entry in enumerate(entries, 1):
        if isinstance(entry, str):
            out.append(entry)
            continue
        if not isinstance(entry, dict):
            raise ClusterFileError(f"{source}: {role} #{n} must be a URL string or a table with 'url', "
                                   f"got {entry!r}")
        url = entry.get("url")
        if not isinstance(url, str) or not url:
            raise ClusterFileError(f"{source}: {role} #{n} has no 'url'")
        attrs = []
        for key, attr in entry.items():
            if key == "url":
                continue
            if key == "models" and isinstance(attr, list) and all(isinstance(m, str) and "|" not in m for m in attr):
                attr = "|".join(attr)  # models = ["a", "b"]
            if isinstance(attr, bool) or not isinstance(attr, (str, int)) or ";" in str(attr):
                raise ClusterFileError(f"{source}: {role} #{n} ({url}): {key} must be a string or an "
                                       f"integer, got {attr!r}")
            attrs.append(f"{key}={attr}")
        out.append(";".join([url, *attrs]))
    return out


def _suggest(dest: str, options: dict[str, Option]) -> str:
    import difflib

    close = difflib.get_close_matches(dest, list(options) + list(ROLE_KEYS) + list(TABLE_KEYS), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
