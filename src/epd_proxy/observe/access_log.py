"""The access log: one line per request, written whole in one call.

It runs on every request, so it bypasses the logging framework (no LogRecord,
no handler lock, no %-formatting): the line is built with one f-string (or one
msgspec encode for ``--log-format json``) and written to stderr, where the
other log lines go. The timestamp text is rebuilt once a second.
"""

from __future__ import annotations

import logging
import sys
import time
from urllib.parse import quote

import msgspec

from epd_proxy.observe.client_address import client_address, peer_host, trusted_networks
from epd_proxy.observe.record import RequestRecord

ACCESS_LOGGER = "epd_proxy.access"  # its level decides whether the access log is on (INFO)
_FORWARDED_FOR = b"x-forwarded-for"


def text_field(value: str | None) -> str:
    """A value the client chose (the model), safe in a space-separated line: ``-`` for none,
    percent-encoded if it holds a space or a character that is not printable."""
    if value is None:
        return "-"
    if value and value.isprintable() and value.find(" ") < 0:
        return value
    return quote(value, safe="") or '""'


def enabled(config) -> bool:
    """On unless --no-access-log, and only where INFO lines are written (--log-level)."""
    return config.access_log and logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.INFO)


def _address(url: str) -> str:
    return url.split("://", 1)[-1]


class AccessLog:
    """Formats and writes access-log lines (``fmt``: ``text`` or ``json``)."""

    def __init__(self, fmt: str = "text", stream=None, trusted_proxies=()) -> None:
        self.json = fmt == "json"
        self._stream = stream
        self._trusted = trusted_networks(trusted_proxies)
        self._second = -1
        self._stamp = ""

    def _write(self, line: str) -> None:
        (self._stream or sys.stderr).write(line)

    def _now(self) -> tuple[float, str]:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        return now, f"{self._stamp},{int((now - second) * 1000):03d}"

    def client(self, peer, headers) -> str:
        """The client's address (client_address.py): the peer, or X-Forwarded-For's from a
        trusted proxy."""
        host = peer_host(peer)
        if not self._trusted or headers is None:
            return host
        return client_address(host, headers.get(_FORWARDED_FOR), self._trusted)

    def request(self, rec: RequestRecord, status: int, tokens: tuple, nbytes: int, seconds: float) -> None:
        """A generation request (``record.py``); the instances it used, in order (a retry adds
        some), and its stages' times are its context's. ``tokens``: (prompt, completion, cached).
        Multi-turn KV reuse adds the turn's outcome (``kv=``) and the instances that tokenized
        its prompt for the token check (``tok=``: not a prefill leg, so not read as a retry)."""
        ctx = rec.ctx
        legs = ctx.legs if ctx is not None else ()
        timings = ctx.timings if ctx is not None else {}
        kv = ctx.kv_outcome if ctx is not None else None
        tokenized = ctx.tokenized if ctx is not None else None
        rid, method, path, stream, outcome = rec.request_id, rec.method, rec.path, rec.stream, rec.outcome
        client = self.client(rec.peer, rec.headers)
        p, c, cached = tokens
        now, stamp = self._now()
        moves = rec.moves  # a stream continued on another decode (request/migration.py)
        if self.json:
            instances: dict[str, list[str]] = {}
            if tokenized:
                instances["tokenize"] = [_address(inst.url) for inst in tokenized]
            for inst in legs:
                instances.setdefault(inst.role, []).append(_address(inst.url))
            self._write(msgspec.json.encode({
                "ts": round(now, 3), "level": "INFO", "logger": ACCESS_LOGGER, "request_id": rid, "method": method,
                "path": path, "status": status, "stream": stream, "instances": instances,
                "stages_ms": {k: round(v * 1000, 2) for k, v in timings.items()},
                "duration_ms": round(seconds * 1000, 2), "prompt_tokens": p, "completion_tokens": c,
                "cached_tokens": cached, "bytes": nbytes, "client": client, "model": rec.model, "key": rec.key,
                "kv": kv,
                "class": rec.ticket.traffic.name if rec.ticket is not None else None,
                "outcome": outcome,
                **({} if moves is None else {"moves": [
                    {"reason": m[0], "result": m[1], "from": _address(m[2]), "to": m[3] and _address(m[3]),
                     "at_ms": round(m[4] * 1000, 2), "ms": round(m[5] * 1000, 2)} for m in moves]})}).decode() + "\n")
            return
        chosen = " ".join(f"{inst.role[0]}={_address(inst.url)}" for inst in legs)
        if tokenized:
            chosen = " ".join([f"tok={_address(inst.url)}" for inst in tokenized] + ([chosen] if chosen else []))
        stages = " ".join(f"{k}={v * 1000:.1f}ms" for k, v in timings.items())
        self._write(f"{stamp} INFO {ACCESS_LOGGER}: {rid} {method} {path} {status} "
                    f"{'stream' if stream else 'whole'} {chosen or '-'} {stages or '-'} total={seconds * 1000:.1f}ms "
                    f"tokens={'-' if p is None else p}/{'-' if c is None else c} "
                    f"cached={'-' if cached is None else cached} bytes={nbytes} client={client} "
                    f"model={text_field(rec.model)} key={text_field(rec.key)}{f' kv={kv}' if kv else ''}"
                    f"{'' if rec.ticket is None else ' class=' + rec.ticket.traffic.name}"
                    f"{'' if moves is None else ' moved=' + ','.join(f'{m[0]}:{m[1]}' for m in moves)} {outcome}\n")

    def other(self, rid: str, method: str, path: str, status: int, nbytes: int, seconds: float, peer=None,
              headers=None, model: str | None = None, key: str | None = None) -> None:
        """A request the pipeline did not run (/metrics, /health, a 401, a 404, a 429 at admission,
        a routed endpoint: with its ``model`` and client ``key`` when it has them)."""
        client = self.client(peer, headers)
        now, stamp = self._now()
        outcome = "ok" if status < 400 else "error"
        if self.json:
            doc = {"ts": round(now, 3), "level": "INFO", "logger": ACCESS_LOGGER, "request_id": rid, "method": method,
                   "path": path, "status": status, "duration_ms": round(seconds * 1000, 2), "bytes": nbytes,
                   "client": client, "outcome": outcome}
            if model is not None or key is not None:
                doc["model"], doc["key"] = model, key
            self._write(msgspec.json.encode(doc).decode() + "\n")
            return
        named = "" if model is None and key is None else f" model={text_field(model)} key={text_field(key)}"
        self._write(f"{stamp} INFO {ACCESS_LOGGER}: {rid} {method} {path} {status} total={seconds * 1000:.1f}ms "
                    f"bytes={nbytes} client={client}{named} {outcome}\n")


class JsonFormatter(logging.Formatter):
    """The other log lines in the access log's JSON shape (``--log-format json``)."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return msgspec.json.encode(doc).decode()
