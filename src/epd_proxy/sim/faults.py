"""Fault injection.

Syntax (header ``X-Sim-Fault``, the top-level body field ``sim_fault``,
``SimInstance.inject`` and ``SimConfig.fault_kinds``): a comma-separated list of
``[role:]name[=arg]``. A role prefix (``encode``, ``prefill``, ``decode``,
``pd``) limits the fault to instances of that role.

=========================  ============================================================
``status=N``               answer HTTP N with vLLM's error envelope, before any work
``error-after=N``          stream: N tokens, then ``data: {"error": ...}`` and
                           ``data: [DONE]``; non-stream: HTTP 500 after N tokens' time
``reset-after=N``          abort the connection (TCP reset) after N tokens
``hang``                   never send headers (until the client gives up)
``hang-item=TEXT``          ``hang``, when a media item's URL or ``uuid`` holds TEXT (an
                           item that hangs the encoder, wherever it goes)
``delay=SECONDS``          wait before handling the request (slow headers)
``stall-after=N:SECONDS``  after N tokens, send nothing for SECONDS, then go on
``slow-body=SECONDS``      one token (SSE event) every SECONDS
``drop-kv``                a prefill answers ``"kv_transfer_params": null`` and keeps nothing
``unhealthy=SECONDS``      ``/health`` answers 503 for SECONDS (the request is served)
``crash[=SECONDS]``        the instance crashes on receipt (listener closed, every
                           connection reset); with SECONDS it restarts after that long
=========================  ============================================================

Faults combine. ``status``, ``hang``, ``delay`` and ``crash`` act before any work
(a prefill refused with ``status`` keeps no KV). The token faults act on the
response: a prefill's KV is held (pull) or pushed as soon as its prefill is
computed, *before* ``stall-after``/``error-after``/``reset-after`` at token 0
take effect, so ``stall-after=0:0.2,error-after=0`` on a push prefill means
"push the KV, then answer HTTP 500 200 ms later". At the same token, a stall
comes before an error or a reset. ``error-after``/``reset-after`` with N at or
beyond the number of output tokens do nothing (except on an encoder, which
produces no tokens: N=0 applies).

Sources, all combined: the request header ``X-Sim-Fault``; the top-level body
field ``sim_fault`` (a proxy copies the body to P and D even when it drops
unknown headers; vLLM ignores unknown fields); the instance's injected queue
(``SimInstance.inject``); and the seeded random draw (``fault_rate``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from epd_proxy.sim.config import ROLES

_NO_ARG = {"hang", "drop-kv", "crash"}
_INT_ARG = {"status", "error-after", "reset-after"}
_FLOAT_ARG = {"delay", "slow-body", "unhealthy"}
_TEXT_ARG = {"hang-item"}
NAMES = _NO_ARG | _INT_ARG | _FLOAT_ARG | _TEXT_ARG | {"stall-after", "crash"}
# The content parts that carry a media item (vLLM's chat parts), by the field holding its URL.
_MEDIA_PARTS = ("image_url", "video_url", "audio_url", "input_audio")


class FaultSyntaxError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Fault:
    role: str | None
    name: str
    arg: float | int | str | None = None
    arg2: float | None = None  # stall seconds
    text: str = ""


def parse(spec: str) -> list[Fault]:
    """Parse a fault list; raises :class:`FaultSyntaxError`."""
    out: list[Fault] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        role = None
        head, sep, arg = item.partition("=")
        if ":" in head:
            role, _, head = head.partition(":")
            role = role.strip()
            if role not in ROLES:
                raise FaultSyntaxError(f"unknown role {role!r} in fault {item!r}")
        name = head.strip()
        if name not in NAMES:
            raise FaultSyntaxError(f"unknown fault {name!r} in {item!r}")
        try:
            if name == "stall-after":
                n, _, secs = arg.partition(":")
                out.append(Fault(role, name, int(n), float(secs), item))
            elif name in _INT_ARG:
                out.append(Fault(role, name, int(arg), None, item))
            elif name in _FLOAT_ARG:
                out.append(Fault(role, name, float(arg), None, item))
            elif name in _TEXT_ARG:
                if not arg:
                    raise ValueError
                out.append(Fault(role, name, arg, None, item))
            elif name == "crash":
                out.append(Fault(role, name, float(arg) if sep else None, None, item))
            else:
                if sep:
                    raise ValueError
                out.append(Fault(role, name, None, None, item))
        except ValueError:
            raise FaultSyntaxError(f"bad argument in fault {item!r}") from None
    return out


class FaultPlan:
    """The faults that apply to one request on one instance."""

    __slots__ = ("status", "error_after", "reset_after", "hang", "hang_item", "delay", "stall_after",
                 "stall_seconds", "slow_body", "drop_kv", "unhealthy", "crash", "crash_restart",
                 "texts")

    def __init__(self) -> None:
        self.status: int | None = None
        self.error_after: int | None = None
        self.reset_after: int | None = None
        self.hang = False
        self.hang_item: str | None = None
        self.delay = 0.0
        self.stall_after: int | None = None
        self.stall_seconds = 0.0
        self.slow_body = 0.0
        self.drop_kv = False
        self.unhealthy = 0.0
        self.crash = False
        self.crash_restart: float | None = None
        self.texts: list[str] = []

    def add(self, f: Fault) -> None:
        self.texts.append(f.text)
        n = f.name
        arg: Any = f.arg  # parse_faults gave every fault below its argument
        if n == "status":
            self.status = int(arg)
        elif n == "error-after":
            self.error_after = int(arg)
        elif n == "reset-after":
            self.reset_after = int(arg)
        elif n == "hang":
            self.hang = True
        elif n == "hang-item":
            self.hang_item = str(arg)
        elif n == "delay":
            self.delay = float(arg)
        elif n == "stall-after":
            self.stall_after = int(arg)
            self.stall_seconds = float(f.arg2 or 0.0)
        elif n == "slow-body":
            self.slow_body = float(arg)
        elif n == "drop-kv":
            self.drop_kv = True
        elif n == "unhealthy":
            self.unhealthy = float(arg)
        elif n == "crash":
            self.crash = True
            self.crash_restart = None if arg is None else float(arg)

    @property
    def describe(self) -> str:
        return ",".join(self.texts)

    @property
    def streams_tokens(self) -> bool:
        """Whether the engine has per-token work to do for this plan."""
        return (self.error_after is not None or self.reset_after is not None
                or self.stall_after is not None or self.slow_body > 0)


def media_matches(body: dict, text: str) -> bool:
    """Whether a media item of a chat body (its URL, data URL included, or its ``uuid``) holds ``text``."""
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict) or part.get("type") not in _MEDIA_PARTS:
                continue
            payload = part.get(part["type"])
            url = payload.get("url", payload.get("data")) if isinstance(payload, dict) else payload
            uuid = part.get("uuid")
            if (isinstance(url, str) and text in url) or (isinstance(uuid, str) and text in uuid):
                return True
    return False


def applicable(faults: list[Fault], role: str) -> list[Fault]:
    return [f for f in faults if f.role is None or f.role == role]


class FaultSource:
    """Where one instance's faults come from, beside the request itself: the queue that
    ``SimInstance.inject`` fills and the seeded random draw (``fault_rate``)."""

    def __init__(self, role: str, fault_rate: float, fault_kinds: tuple[str, ...], seed: str) -> None:
        self.role = role
        self.fault_rate = fault_rate
        self._queue: list[list] = []
        self._rate_faults = [parse(k) for k in fault_kinds] if fault_rate else []
        self._rng = random.Random(seed)

    def inject(self, spec: str, times: int = 1) -> None:
        parsed = parse(spec)
        if times > 0 and parsed:
            self._queue.append([parsed, times])

    def clear(self) -> None:
        self._queue.clear()

    def plan(self, header: bytes | None, body: dict) -> FaultPlan | None:
        """The faults for the next generation request: its ``X-Sim-Fault`` header, its
        ``sim_fault`` field, the head of the injected queue and the random draw, limited to
        this instance's role. Raises :class:`FaultSyntaxError` for a bad spec."""
        found: list[Fault] = []
        if header:
            found += parse(header.decode("latin-1"))
        spec = body.get("sim_fault")
        if isinstance(spec, str) and spec:
            found += parse(spec)
        if self._queue:
            entry = self._queue[0]
            found += entry[0]
            entry[1] -= 1
            if entry[1] <= 0:
                self._queue.pop(0)
        if self._rate_faults and self._rng.random() < self.fault_rate:
            found += self._rng.choice(self._rate_faults)
        if not found:
            return None
        mine = applicable(found, self.role)
        if not mine:
            return None
        plan = FaultPlan()
        for f in mine:
            plan.add(f)
        return plan
