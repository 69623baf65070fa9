"""One simulated vLLM instance: HTTP API, roles, KV/EC hand-off, faults, records.

Side channel between simulated instances
    A prefill's KV "lives" in the prefill instance's memory. It advertises its
    own HTTP host and port as ``remote_host`` / ``remote_port`` in
    ``kv_transfer_params`` (that is its NIXL side channel), and the decode
    talks to it over HTTP on paths under ``/sim/kv/``, so the hand-off works
    across processes:

    * ``POST /sim/kv/pull`` ``{remote_request_id, remote_block_ids,
      remote_engine_id, prompt_hash, consumer}`` (NIXL pull) -> 200
      ``{num_tokens, block_ids}`` and the blocks are freed; 404 when the engine
      id is wrong or nothing is held for that request (never produced, already
      pulled, expired); 409 when the block ids or the prompt differ.
    * ``POST /sim/kv/push/register`` ``{transfer_id, remote_engine_id,
      remote_request_id, prompt_hash, timeout, consumer}`` (NIXL push and
      Mooncake; for Mooncake it goes to ``remote_bootstrap_addr``) -> the
      request waits until the prefill with that ``transfer_id`` has finished
      and "pushes" (200 ``{num_tokens}``), or answers 408 after ``timeout``
      seconds. A prefill that finishes first keeps the push offer (held
      blocks) until a registration arrives or ``kv_abort_timeout`` expires.

    Also under ``/sim/``: ``GET /sim/state`` (held KV, counters),
    ``POST /sim/fault`` ``{"spec": "status=503", "times": 2}`` and
    ``POST /sim/health`` ``{"ok": false}``, for driving a simulator running in
    another process. None of ``/sim/...`` is recorded in ``records``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from epd_proxy.http.client import ConnectionPool, Timeouts, UpstreamError
from epd_proxy.http.server import HttpServer, ServerLimits
from epd_proxy.sim import faults as _faults
from epd_proxy.sim.config import SimConfig
from epd_proxy.sim.engine import DONE, DONE_EVENT, Engine, Sequence
from epd_proxy.sim.records import SimRecord, Stats
from epd_proxy.sim.tokens import (
    PromptError,
    _seed_bytes,
    analyze,
    flatten_metadata,
    media_tokens,
    output_tokens,
)
from epd_proxy.sim.validation import (
    UNSUPPORTED_MEDIA_TYPE,
    ApiError,
    check_lengths,
    check_request,
    json_error,
    schema_error,
)

log = logging.getLogger("epd_proxy.sim")

_JSON = b"application/json"
_SSE = b"text/event-stream; charset=utf-8"
_ERROR_TYPES = {
    400: "BadRequestError", 401: "UnauthorizedError", 403: "ForbiddenError", 404: "NotFoundError",
    408: "RequestTimeoutError", 413: "RequestEntityTooLargeError", 422: "UnprocessableEntityError",
    429: "TooManyRequestsError", 500: "InternalServerError", 501: "NotImplementedError",
    502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError",
}
_encode = msgspec.json.encode
_decode = msgspec.json.decode
VLLM_VERSION = "0.32.0"
# What vLLM says about any generation failure (GenerationError): the 500 body (JSONResponse,
# compact) and the in-band stream event (json.dumps, with its spacing).
_GENERATION_ERROR_BODY = (b'{"error":{"message":"Internal server error","type":"InternalServerError",'
                          b'"param":null,"code":500}}')
_STREAM_GENERATION_ERROR = (b'data: {"error": {"message": "Internal server error", "type": '
                            b'"InternalServerError", "param": null, "code": 500}}\n\n')


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """vLLM's ``ErrorResponse``."""
    etype = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return _encode({"error": {"message": message, "type": etype, "param": param, "code": status}})


def _flat_ints(value: Any) -> list:
    """Block ids as one flat list (``[[1, 2], [3]]`` and ``[1, 2, 3]`` compare equal)."""
    if not isinstance(value, list):
        return [value]
    out: list = []
    for v in value:
        if isinstance(v, list):
            out.extend(_flat_ints(v))
        else:
            out.append(v)
    return out


# ---------------------------------------------------------------------------------
# Shared stores

@dataclass(slots=True)
class EcEntry:
    metadata: dict
    size_bytes: int
    producer: str
    peer_host: str
    peer_port: int


class EcStore:
    """The encoder cache shared by the encoders and the EC consumers of one cluster
    (what ECExampleConnector's shared directory is for real vLLM)."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._d: dict[str, EcEntry] = {}

    def put(self, key: str, entry: EcEntry) -> None:
        d = self._d
        d.pop(key, None)
        d[key] = entry
        while len(d) > self.capacity:
            del d[next(iter(d))]

    def get(self, key: str | None) -> EcEntry | None:
        return self._d.get(key) if key is not None else None

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def keys(self) -> list[str]:
        return list(self._d)

    def clear(self) -> None:
        self._d.clear()


@dataclass(slots=True)
class HeldKV:
    """KV blocks a prefill keeps for a decoder."""

    request_id: str
    block_ids: list[int]
    prompt_hash: str
    num_tokens: int
    transfer_id: str | None
    t_created: float
    timer: asyncio.TimerHandle | None = None


class _TeeWriter:
    """A ResponseWriter that also keeps what it writes in the request's record."""

    __slots__ = ("_w", "_parts")

    def __init__(self, writer, rec: SimRecord) -> None:
        self._w = writer
        rec.response_chunks = self._parts = []

    @property
    def started(self) -> bool:
        return self._w.started

    @property
    def finished(self) -> bool:
        return self._w.finished

    @property
    def bytes_sent(self) -> int:
        return self._w.bytes_sent

    @property
    def disconnected(self) -> bool:
        return self._w.disconnected

    def send(self, status, body=b"", content_type=_JSON, headers=None) -> None:
        if body:
            self._parts.append(body)
        self._w.send(status, body, content_type=content_type, headers=headers)

    def start(self, status, content_type=_SSE, headers=None) -> None:
        self._w.start(status, content_type=content_type, headers=headers)

    def write(self, data: bytes) -> None:
        if data and not self._w.disconnected:
            self._parts.append(data)
        self._w.write(data)

    def end(self, data: bytes = b"") -> None:
        if data and not self._w.disconnected and not self._w.finished:
            self._parts.append(data)
        self._w.end(data)

    def abort(self) -> None:
        self._w.abort()

    async def drain(self) -> None:
        await self._w.drain()


class _Ctx:
    """Per-request state the engine callbacks need."""

    __slots__ = ("chat", "resp_id", "internal_id", "model", "prompt", "hold_kv", "transfer_id",
                 "drop_kv", "headers", "n_choices", "ec_groups", "kv_out", "reset", "body")

    def __init__(self) -> None:
        self.hold_kv = False
        self.transfer_id: str | None = None
        self.drop_kv = False
        self.ec_groups: dict | None = None
        self.kv_out: dict | None = None
        self.reset = False


# ---------------------------------------------------------------------------------

class SimInstance:
    """A simulated ``vllm serve`` with one role: encode, prefill, decode or pd."""

    def __init__(self, role: str, index: int, config: SimConfig, *, host: str = "127.0.0.1",
                 port: int = 0, bootstrap_port: int = 0, ec_store: EcStore | None = None,
                 created: int | None = None, name: str | None = None) -> None:
        self.role = role
        self.index = index
        self.name = name or f"{role}-{index}"
        self.config = config.for_role(role)
        self.engine_id = self.config.engine_id_format.format(role=role, index=index, name=self.name)
        self.host = host
        self.port = port
        self.bootstrap_port = bootstrap_port
        self.ec_store = ec_store if ec_store is not None else EcStore(self.config.ec_store_capacity)
        self.created = created if created is not None else (
            self.config.created if self.config.created is not None else int(time.time()))
        self._created_b = b"%d" % self.created
        self.records: deque[SimRecord] = deque(maxlen=self.config.max_records)
        self.kv_events: deque[dict] = deque(maxlen=10_000)
        self.stats = Stats()
        self.engine: Engine | None = None
        self.server: HttpServer | None = None
        self.bootstrap_server: HttpServer | None = None
        self._healthy = True
        self._unhealthy_until = 0.0
        self._crashed = False
        self._fault_queue: list[list] = []
        self._rate_faults = [_faults.parse(k) for k in self.config.fault_kinds] if self.config.fault_rate else []
        self._rng = random.Random(f"{self.config.fault_seed}/{self.name}")
        self._counter = 0
        self._next_block = 1
        self._held: dict[str, HeldKV] = {}
        self._push_offers: dict[str, HeldKV] = {}
        self._push_waiters: dict[str, tuple[asyncio.Future, str | None]] = {}
        self._held_blocks = 0
        self._pools: dict[str, ConnectionPool] = {}
        self._tasks: set[asyncio.Task] = set()
        self._model_json = _encode(self.config.model)
        self._in_flight = 0
        self.system_fingerprint = self._make_fingerprint()
        self._fingerprint_json = _encode(self.system_fingerprint) if self.system_fingerprint else b""

    def _make_fingerprint(self) -> str | None:
        """vLLM's default ``system_fingerprint``: ``vllm-<version>[-tpN][-ppN]-<8 hex>``, the hex
        from its config hash. Here the hash covers what differs between the simulated
        instances' configurations, so instances of one role and config share it."""
        cfg = self.config
        mode = cfg.system_fingerprint
        if mode != "auto":
            return mode or None
        parts = [f"vllm-{VLLM_VERSION}"]
        if cfg.tp_size > 1:
            parts.append(f"tp{cfg.tp_size}")
        if cfg.pp_size > 1:
            parts.append(f"pp{cfg.pp_size}")
        key = repr((cfg.model, cfg.max_model_len, self.role, cfg.kv_connector, cfg.ec_connector, cfg.tp_size,
                    cfg.pp_size, cfg.block_size))
        parts.append(hashlib.sha256(key.encode()).hexdigest()[:8])
        return "-".join(parts)

    # -- properties ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_host(self) -> str:
        return self.host

    @property
    def kv_port(self) -> int:
        return self.port

    @property
    def bootstrap_addr(self) -> str | None:
        if self.bootstrap_server is None and not self.bootstrap_port:
            return None
        return f"http://{self.host}:{self.bootstrap_port}"

    @property
    def held_kv_blocks(self) -> int:
        """Blocks held for decoders that have not claimed them (stranded KV when it stays up)."""
        return self._held_blocks

    @property
    def held_kv_requests(self) -> int:
        return len(self._held) + len(self._push_offers)

    @property
    def healthy(self) -> bool:
        return self._healthy and not self._crashed and (
            self._unhealthy_until == 0.0 or asyncio.get_running_loop().time() >= self._unhealthy_until)

    @property
    def running(self) -> bool:
        return self.server is not None

    def identity(self) -> dict:
        """What a push-mode proxy needs to know about this prefill in advance."""
        ident = {"engine_id": self.engine_id, "kv_host": self.kv_host, "kv_port": self.kv_port,
                 "tp": self.config.tp_size, "pp": self.config.pp_size,
                 "tp_size": self.config.tp_size, "pp_size": self.config.pp_size, "url": self.url,
                 "kv_connector": self.config.kv_connector}
        if self.bootstrap_addr:
            ident["bootstrap_port"] = self.bootstrap_port
            ident["bootstrap_addr"] = self.bootstrap_addr
        return ident

    def __repr__(self) -> str:
        return f"<SimInstance {self.name} {self.url}>"

    # -- control (tests) ---------------------------------------------------------------
    def inject(self, spec: str, times: int = 1) -> None:
        """Apply the faults in ``spec`` to the next ``times`` generation requests
        (``/v1/chat/completions``, ``/v1/completions``) reaching this instance."""
        parsed = _faults.parse(spec)
        if times > 0 and parsed:
            self._fault_queue.append([parsed, times])

    def clear_faults(self) -> None:
        self._fault_queue.clear()

    def set_health(self, ok: bool) -> None:
        """``/health`` answers 200 (True) or 503 (False)."""
        self._healthy = bool(ok)
        if ok:
            self._unhealthy_until = 0.0

    def clear_records(self) -> None:
        self.records.clear()

    def generation_records(self) -> list[SimRecord]:
        return [r for r in self.records if r.path in ("/v1/chat/completions", "/v1/completions")]

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> "SimInstance":
        if self.engine is None:
            self.engine = Engine(self.config.itl_ms, self.config.max_num_seqs)
        limits = ServerLimits(keep_alive_timeout=self.config.keep_alive_timeout)
        self.server = await HttpServer(self._handle, limits=limits).start(self.host, self.port)
        self.port = self.server.port
        if self.role == "prefill" and self.config.kv_connector == "mooncake":
            self.bootstrap_server = await HttpServer(self._handle, limits=limits).start(
                self.host, self.bootstrap_port)
            self.bootstrap_port = self.bootstrap_server.port
        self._crashed = False
        return self

    async def _close_servers(self) -> None:
        servers = [s for s in (self.server, self.bootstrap_server) if s is not None]
        self.server = None
        self.bootstrap_server = None
        for s in servers:
            await s.close(abort_connections=True)

    def _drop_kv_state(self) -> None:
        for held in list(self._held.values()) + list(self._push_offers.values()):
            if held.timer is not None:
                held.timer.cancel()
        self._held.clear()
        self._push_offers.clear()
        self._held_blocks = 0
        for fut, _ in list(self._push_waiters.values()):
            if not fut.done():
                fut.cancel()
        self._push_waiters.clear()

    async def _close_pools(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            await p.close()

    async def stop(self) -> None:
        """Shut down: listener closed, connections reset, held KV dropped."""
        self._crashed = True
        await self._close_servers()
        self._drop_kv_state()
        await self._close_pools()
        if self.engine is not None:
            self.engine.close()
        for t in list(self._tasks):
            if t is not asyncio.current_task():
                t.cancel()

    async def crash(self) -> None:
        """Die like a killed process: close the listener, reset every connection,
        lose the KV held for decoders. ``restart()`` brings it back on the same port."""
        self._crashed = True
        await self._close_servers()
        self._drop_kv_state()
        await self._close_pools()
        # Let the cancelled handlers run their cleanup.
        await asyncio.sleep(0)

    async def restart(self) -> None:
        """Start again on the same port(s) after ``crash()``."""
        if self.server is not None:
            return
        await self.start()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _crash_and_restart(self, after: float | None) -> None:
        await self.crash()
        if after is not None:
            await asyncio.sleep(after)
            await self.restart()

    # -- HTTP entry point ----------------------------------------------------------------
    async def _handle(self, req, writer) -> None:
        path = req.path
        if path == "/v1/chat/completions" or path == "/v1/completions":
            if req.method != "POST":
                writer.send(405, b'{"detail":"Method Not Allowed"}')
                return
            self._in_flight += 1
            try:
                await self._generate(req, writer, path == "/v1/chat/completions")
            finally:
                self._in_flight -= 1
            return
        if path.startswith("/sim/"):
            await self._sim_route(req, writer)
            return
        rec = self._new_record(req, time.monotonic())
        if path == "/health":
            status = 200 if self.healthy else 503
            self._send(writer, rec, status, b"", content_type=None)
        elif path == "/metrics":
            self._send(writer, rec, 200, self.metrics_text().encode(),
                       content_type=b"text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            self._send(writer, rec, 200, self._models_body())
        elif path == "/version":
            self._send(writer, rec, 200, b'{"version":"0.32.0+sim"}')
        elif path == "/load":
            self._send(writer, rec, 200, _encode({"server_load": self._in_flight}))
        elif path == "/query" and self.role == "prefill" and self.config.kv_connector == "mooncake":
            self._send(writer, rec, 200, _encode({"0": {"engine_id": self.engine_id}}))
        elif path in ("/ping",) and req.method in ("GET", "POST"):
            self._send(writer, rec, 200, b"", content_type=None)
        else:
            self._send(writer, rec, 404, b'{"detail":"Not Found"}')

    def _new_record(self, req, t: float) -> SimRecord | None:
        if not self.config.records:
            return None
        rid = req.headers.get(b"x-request-id")
        rec = SimRecord(
            path=req.path, method=req.method,
            headers={k.decode("latin-1"): v.decode("latin-1") for k, v in req.headers.items()},
            body=req.body, json=None, t_received=t, instance=self.name,
            request_id=rid.decode("latin-1") if rid is not None else None)
        self.records.append(rec)
        return rec

    def _send(self, writer, rec: SimRecord | None, status: int, body: bytes, *,
              content_type: bytes | None = _JSON, headers=None, error: str | None = None) -> None:
        writer.send(status, body, content_type=content_type, headers=headers)
        if rec is not None:
            rec.t_headers = rec.t_end = time.monotonic()
            rec.status = status
            rec.bytes_sent = len(body)
            if error is not None:
                rec.error = error

    def _error(self, writer, rec, status: int, message: str, param: str | None = None,
               headers=None) -> None:
        self._send(writer, rec, status, error_body(status, message, param), headers=headers, error=message)

    def _api_error(self, writer, rec, exc: ApiError, headers=None) -> None:
        body = _encode({"error": {"message": exc.message, "type": exc.etype, "param": exc.param,
                                  "code": exc.status}})
        self._send(writer, rec, exc.status, body, headers=headers, error=exc.message)

    # -- faults ----------------------------------------------------------------------------
    def _plan(self, req, body: dict) -> _faults.FaultPlan | None:
        found: list[_faults.Fault] = []
        spec = req.headers.get(b"x-sim-fault")
        if spec:
            found += _faults.parse(spec.decode("latin-1"))
        spec2 = body.get("sim_fault")
        if isinstance(spec2, str) and spec2:
            found += _faults.parse(spec2)
        if self._fault_queue:
            entry = self._fault_queue[0]
            found += entry[0]
            entry[1] -= 1
            if entry[1] <= 0:
                self._fault_queue.pop(0)
        if self._rate_faults and self._rng.random() < self.config.fault_rate:
            found += self._rng.choice(self._rate_faults)
        if not found:
            return None
        mine = _faults.applicable(found, self.role)
        if not mine:
            return None
        plan = _faults.FaultPlan()
        for f in mine:
            plan.add(f)
        return plan

    @staticmethod
    async def _forever() -> None:
        await asyncio.get_running_loop().create_future()

    # -- generation --------------------------------------------------------------------------
    async def _generate(self, req, writer, chat: bool) -> None:
        self.stats.requests += 1
        self._counter += 1
        rec = self._new_record(req, time.monotonic())
        if rec is not None:
            # Response bodies are kept for failures always, for successes with record_responses.
            writer = _TeeWriter(writer, rec)
        holder: list = [None]  # the Sequence, once there is one
        try:
            await self._generate_inner(req, writer, chat, rec, self._counter, holder)
        except asyncio.CancelledError:
            # The client went away (or the instance crashed) before the end.
            seq = holder[0]
            if seq is None or seq.state != DONE:
                if seq is not None:
                    self.engine.retire(seq)
                if rec is not None:
                    rec.t_end = time.monotonic()
                    rec.bytes_sent = writer.bytes_sent
                if self._crashed:
                    if rec is not None:
                        rec.error = f"{self.name} crashed"
                else:
                    # Only the simulator's own counter: vLLM counts a client's disconnect in
                    # no vllm:request_success_total reason.
                    self.stats.aborted += 1
                    if rec is not None:
                        rec.aborted = True
            raise

    async def _generate_inner(self, req, writer, chat: bool, rec: SimRecord | None, counter: int,
                              holder: list) -> None:
        loop = asyncio.get_running_loop()
        st = self.stats
        cfg = self.config
        # Identity of this request: vLLM uses X-Request-Id when there is one.
        rid_h = req.headers.get(b"x-request-id")
        base = rid_h.decode("latin-1") if rid_h else hashlib.sha256(
            f"{self.created}/{self.name}/{counter}".encode()).hexdigest()[:32]
        echo = [(b"x-request-id", rid_h or base.encode())] if cfg.echo_request_id else None
        ct = req.headers.get(b"content-type", b"")
        if ct.split(b";", 1)[0].strip().lower() != b"application/json":
            return self._api_error(writer, rec, schema_error([UNSUPPORTED_MEDIA_TYPE]), echo)
        try:
            body = _decode(req.body)
        except msgspec.DecodeError:
            return self._api_error(writer, rec, json_error(req.body), echo)
        if rec is not None:
            rec.json = body
            rec.stream = isinstance(body, dict) and body.get("stream") is True

        # Faults that act before any work.
        try:
            plan = self._plan(req, body if isinstance(body, dict) else {})
        except _faults.FaultSyntaxError as exc:
            return self._error(writer, rec, 400, f"sim: {exc}", "x-sim-fault", headers=echo)
        if plan is not None:
            st.faults += 1
            if rec is not None:
                rec.fault = plan.describe
            if plan.unhealthy:
                self._unhealthy_until = loop.time() + plan.unhealthy
            if plan.crash:
                self._spawn(self._crash_and_restart(plan.crash_restart))
                await self._forever()
            if plan.delay:
                await asyncio.sleep(plan.delay)
            if plan.hang:
                await self._forever()
            if plan.status is not None:
                return self._error(writer, rec, plan.status,
                                   f"sim: injected fault status={plan.status} on {self.name}", headers=echo)

        # vLLM's request validation, in its order: the request schema, the model, the prompt,
        # the token budget.
        try:
            checked = check_request(body, chat)
            body = checked.body
            model = body.get("model")
            if cfg.check_model and model and model != cfg.model:
                raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {cfg.model}.",
                               "NotFoundError", "model")
            try:
                prompt = analyze(body, chat)
            except PromptError as exc:
                raise ApiError(400, str(exc), "BadRequestError") from None
            n_out, by_length = check_lengths(body, chat, prompt.tokens, cfg.max_model_len, checked.n,
                                             exact_prompt=prompt.exact, natural_len=cfg.default_max_tokens)
        except ApiError as exc:
            return self._api_error(writer, rec, exc, echo)
        stream = checked.stream
        if rec is not None:
            rec.stream = stream
        kv = body.get("kv_transfer_params")

        # Role.
        role = self.role
        ctx = _Ctx()
        remote_kv: dict | None = None
        if role in ("prefill", "decode"):
            produce = bool(kv) and kv.get("do_remote_decode") is True
            if cfg.strict_roles:
                if role == "prefill" and not produce:
                    return self._error(
                        writer, rec, 400,
                        f"sim: {self.name} is a prefill (KV producer) instance and needs "
                        "kv_transfer_params.do_remote_decode=true; without it nothing is kept for a decoder "
                        "(a request meant for a decoder or a plain instance was sent to a prefiller; "
                        "SimConfig.strict_roles)", "kv_transfer_params", headers=echo)
                if role == "decode" and produce:
                    return self._error(
                        writer, rec, 400,
                        f"sim: {self.name} is a decode (KV consumer) instance but got "
                        "kv_transfer_params.do_remote_decode=true (a prefill request sent to a decoder; "
                        "SimConfig.strict_roles)", "kv_transfer_params", headers=echo)
            if produce:
                if cfg.kv_connector != "nixl":
                    tid = kv.get("transfer_id")
                    if not isinstance(tid, str) or not tid:
                        return self._error(
                            writer, rec, 400,
                            f"sim: {self.name} runs the {cfg.kv_connector} connector: "
                            "kv_transfer_params.transfer_id is required to pair the prefill with its decode",
                            "kv_transfer_params", headers=echo)
                    ctx.transfer_id = tid
                ctx.hold_kv = True
                ctx.drop_kv = plan is not None and plan.drop_kv
            elif kv and kv.get("do_remote_prefill") is True and (role == "decode" or not cfg.strict_roles):
                remote_kv = kv

        # Encoder cache (EC consumer side) and local work.
        gen_error: str | None = None
        ttft_ms = 0.0
        if role == "encode":
            n_out = 0
            by_length = False
            groups: dict[str, dict] = {}
            for m in prompt.media:
                if not m.raw:
                    continue
                g = groups.get(m.mm_hash)
                if g is None:
                    groups[m.mm_hash] = {"metadata": m.metadata, "item_indices": [m.index], "family": m.family}
                else:
                    g["item_indices"].append(m.index)
            ctx.ec_groups = groups
            ttft_ms = cfg.encode_ms_per_item * len(groups)
        elif remote_kv is None:
            if cfg.ec_connector == "example" and prompt.media:
                refused = self._empty_embeds(prompt.media)
                if refused is not None:
                    return self._error(writer, rec, 400, refused, headers=echo)
            st.local_prefills += 1
            st.local_prompt_tokens += prompt.tokens
            extra = 0.0
            store = self.ec_store
            for m in prompt.media:
                if m.raw:
                    if m.mm_hash in store:
                        st.ec_hits += 1
                    else:
                        st.local_encodes += 1
                        extra += cfg.local_encode_ms_per_item
                elif isinstance(m.metadata, dict):
                    entry = store.get(m.mm_hash)
                    if entry is None:
                        gen_error = (f"EC load failed on {self.name}: no embedding for mm_hash {m.mm_hash!r} "
                                     f"({m.type} item {m.index}) in the encoder cache; was it encoded, and with "
                                     "the same uuid and mm_processor_kwargs?")
                        break
                    if flatten_metadata(entry.metadata) != flatten_metadata(m.metadata):
                        gen_error = (f"EC metadata mismatch on {self.name} for mm_hash {m.mm_hash!r} "
                                     f"({m.type} item {m.index}): the request says {m.metadata}, the encoder "
                                     f"produced {entry.metadata}")
                        break
                    st.ec_hits += 1
            if gen_error is not None:
                st.ec_failures += 1
            ttft_ms = cfg.ttft_ms + cfg.ttft_per_token_ms * prompt.tokens + extra

        suffix = hashlib.sha256(f"{self.engine_id}/{self.created}/{counter}".encode()).hexdigest()[:8]
        if chat:
            ctx.resp_id = "chatcmpl-" + base
            ctx.internal_id = f"chatcmpl-{base}-{suffix}"
        else:
            ctx.resp_id = "cmpl-" + base
            ctx.internal_id = f"cmpl-{base}-0-{suffix}"
        ctx.headers = echo
        ctx.chat = chat
        ctx.model = cfg.model  # vLLM answers with its served model name, whatever the request said
        ctx.prompt = prompt
        ctx.n_choices = n_choices = checked.n
        ctx.body = body

        seed = _seed_bytes(body)
        fp = prompt.fingerprint
        tokens = [output_tokens(fp, seed, n_out, c) for c in range(n_choices)]
        head = b""
        include_usage = continuous = False
        if stream:
            head = (b'data: {"id":' + _encode(ctx.resp_id) + b',"object":"'
                    + (b"chat.completion.chunk" if chat else b"text_completion")
                    + b'","created":' + self._created_b + b',"model":' + _encode(ctx.model)
                    + b',"choices":[{"index":')
            include_usage = checked.include_usage
            continuous = checked.continuous_usage
        seq = Sequence(
            writer=writer, rec=rec, stream=stream, chat=chat, tokens=tokens, prompt_tokens=prompt.tokens,
            ttft=ttft_ms / 1000.0, finish_reason="length" if by_length else "stop", head=head,
            include_usage=include_usage, continuous_usage=continuous, split=cfg.split_utf8,
            on_complete=self._on_complete, on_error=self._on_error, on_reset=self._on_reset, ctx=ctx,
            fingerprint=self._fingerprint_json)
        if ctx.hold_kv and not ctx.drop_kv:
            seq.on_ready = self._on_prefilled
        if plan is not None and plan.streams_tokens:
            seq.set_faults(plan.error_after, plan.reset_after, plan.stall_after, plan.stall_seconds,
                           plan.slow_body)
        seq.done = loop.create_future()

        if stream:
            writer.start(200, _SSE, ctx.headers)
            if rec is not None:
                rec.t_headers = time.monotonic()
                rec.status = 200
        if gen_error is not None:
            seq.state = DONE
            self._on_error(seq, gen_error)
            return

        engine = self.engine
        holder[0] = seq
        if remote_kv is not None:
            seq.needs_load = True
            seq.admitted = loop.create_future()
            engine.submit(seq)
            await seq.admitted
            st.external_queried_tokens += prompt.tokens
            ok, info = await self._load_kv(ctx, remote_kv)
            if seq.state == DONE:
                return
            if not ok:
                st.kv_pull_failures += 1
                if cfg.kv_failure_delay_ms > 0:
                    # Real NIXL notices a dead peer only after its handshake timeout.
                    await asyncio.sleep(cfg.kv_failure_delay_ms / 1000.0)
                    if seq.state == DONE:
                        return
                self._on_error(seq, info)
                engine.retire(seq)
                return
            ntok, nblocks = info
            st.kv_pulls += 1
            st.external_cached_tokens += ntok
            if cfg.kv_connector != "mooncake":
                st.add_kv_transfer(nblocks * cfg.kv_bytes_per_block)
            if cfg.prompt_tokens_details:
                seq.cached_tokens = ntok
            engine.ready(seq, loop.time() + cfg.kv_load_ms / 1000.0)
        else:
            engine.submit(seq)
        await seq.done

    def _empty_embeds(self, media: list) -> str | None:
        """vLLM's refusal of ``*_embeds`` references without data (an ECExampleConnector
        encoder reports empty metadata, and a model that declares no embedding fields,
        like BLIP-2, has nothing to build the item from)."""
        if not any(not m.raw and m.metadata == {} for m in media):
            return None
        for family in ("image", "audio", "video"):
            items = [m for m in media if m.family == family]
            with_data = [m for m in items if m.raw or m.metadata != {}]
            if len(items) != len(with_data):
                return (f"If given, multi_modal_uuids[{family!r}] must have same length as "
                        f"multi_modal_data[{family!r}], but got {len(items)} vs {len(with_data)}.")
        return None

    # -- engine callbacks --------------------------------------------------------------------
    def _on_complete(self, seq: Sequence) -> None:
        ctx: _Ctx = seq.ctx
        st = self.stats
        kv_out = ctx.kv_out
        ec_out = None
        if ctx.ec_groups is not None:
            ec_out = self._store_ec(ctx.ec_groups) or None
        ncomp = seq.n * ctx.n_choices
        st.success[seq.finish_reason] += 1
        st.prompt_tokens += seq.prompt_tokens
        st.generation_tokens += ncomp
        writer = seq.writer
        rec = seq.rec
        if seq.stream:
            writer.end(seq.stream_tail())
        else:
            # vLLM 0.32's response models, dumped whole (JSONResponse(model.model_dump())).
            usage = {"prompt_tokens": seq.prompt_tokens, "total_tokens": seq.prompt_tokens + ncomp,
                     "completion_tokens": ncomp,
                     "prompt_tokens_details": {"cached_tokens": seq.cached_tokens} if seq.cached_tokens else None,
                     "completion_tokens_details": None}
            if ctx.chat:
                choices = [{"index": c, "message": {
                    "role": "assistant", "content": seq.text(c), "refusal": None, "annotations": None,
                    "audio": None, "function_call": None, "reasoning": None},
                    "logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": None,
                    "token_ids": None, "routed_experts": None} for c in range(ctx.n_choices)]
                resp = {"id": ctx.resp_id, "object": "chat.completion", "created": self.created,
                        "model": ctx.model, "choices": choices, "service_tier": None,
                        "system_fingerprint": self.system_fingerprint, "usage": usage, "prompt_logprobs": None,
                        "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": kv_out,
                        "ec_transfer_params": ec_out, "metrics": None}
            else:
                choices = [{"index": c, "text": seq.text(c), "logprobs": None,
                            "finish_reason": seq.finish_reason, "stop_reason": None, "token_ids": None,
                            "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}
                           for c in range(ctx.n_choices)]
                resp = {"id": ctx.resp_id, "object": "text_completion", "created": self.created,
                        "model": ctx.model, "choices": choices, "service_tier": None,
                        "system_fingerprint": self.system_fingerprint, "usage": usage,
                        "kv_transfer_params": kv_out, "ec_transfer_params": ec_out, "metrics": None}
            writer.send(200, _encode(resp), headers=ctx.headers)
            if rec is not None:
                rec.t_headers = time.monotonic()
                rec.status = 200
        if rec is not None:
            rec.t_end = time.monotonic()
            rec.bytes_sent = writer.bytes_sent
            rec.kv = kv_out
            if not self.config.record_responses:
                rec.response_chunks = None

    def _on_prefilled(self, seq: Sequence) -> None:
        """The prompt's KV exists: hold it for (or push it to) the decoder. This happens when
        the prefill is computed, before the response is written, so faults on the response
        (error-after, stall-after, reset-after) leave the KV held or pushed, as with vLLM."""
        ctx: _Ctx = seq.ctx
        ctx.kv_out = self._produce_kv(ctx)
        if seq.rec is not None:
            seq.rec.kv = ctx.kv_out

    def _on_error(self, seq: Sequence, message: str) -> None:
        """A generation failure (finish_reason "error"): 500, or in-band once streaming. vLLM
        says only "Internal server error" on the wire; the reason goes to the record and log."""
        self.stats.errors += 1
        self.stats.success["error"] += 1
        writer = seq.writer
        rec = seq.rec
        log.warning("%s: request %s failed: %s", self.name, getattr(seq.ctx, "resp_id", "?"), message)
        if writer.started:
            writer.end(seq.error_head() + _STREAM_GENERATION_ERROR + DONE_EVENT)
        else:
            writer.send(500, _GENERATION_ERROR_BODY, headers=seq.ctx.headers)
            if rec is not None:
                rec.t_headers = time.monotonic()
                rec.status = 500
        if rec is not None:
            rec.t_end = time.monotonic()
            rec.bytes_sent = writer.bytes_sent
            rec.error = message

    def _on_reset(self, seq: Sequence) -> None:
        seq.ctx.reset = True
        rec = seq.rec
        if rec is not None:
            rec.t_end = time.monotonic()
            rec.bytes_sent = seq.writer.bytes_sent
            rec.error = f"sim: connection reset after {seq.emitted} tokens (injected)"
        seq.writer.abort()

    # -- EC producer ---------------------------------------------------------------------------
    def _store_ec(self, groups: dict[str, dict]) -> dict:
        out = {}
        example = self.config.ec_connector == "example"
        for mm_hash, g in groups.items():
            tokens = media_tokens(g["family"], g["metadata"])
            size = tokens * self.config.hidden_size * 2
            self.ec_store.put(mm_hash, EcEntry(g["metadata"], size, self.name, self.host, self.port))
            self.stats.encoded_items += len(g["item_indices"])
            if example:
                # ECExampleConnector: the cache sits in the shared directory under the hash.
                out[mm_hash] = {"item_indices": g["item_indices"], "metadata": {}}
            else:
                out[mm_hash] = {"metadata": g["metadata"], "item_indices": g["item_indices"],
                                "peer_host": self.host, "peer_port": self.port, "size_bytes": size}
        return out

    # -- KV producer ---------------------------------------------------------------------------
    def _produce_kv(self, ctx: _Ctx) -> dict:
        cfg = self.config
        loop = asyncio.get_running_loop()
        ntok = ctx.prompt.tokens
        nblocks = max(1, -(-ntok // cfg.block_size))
        first = self._next_block
        self._next_block = (first + nblocks) % 2_000_000_000 or 1
        held = HeldKV(ctx.internal_id, list(range(first, first + nblocks)), ctx.prompt.hash_hex, ntok,
                      ctx.transfer_id, time.monotonic())
        conn = cfg.kv_connector
        if conn == "nixl":
            self._hold(self._held, ctx.internal_id, held, loop)
            return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [held.block_ids],
                    "remote_engine_id": self.engine_id, "remote_request_id": ctx.internal_id,
                    "remote_host": self.kv_host, "remote_port": self.kv_port, "tp_size": cfg.tp_size,
                    "dcp_size": 1, "pp_size": cfg.pp_size, "remote_num_tokens": ntok,
                    "remote_blocks_expiry_time": None, "transfer_mode": "pull",
                    "remote_prefill_cached_tokens": 0}
        tid = ctx.transfer_id
        waiter = self._push_waiters.pop(tid, None)
        if waiter is not None and not waiter[0].done():
            self._deliver_push(held, waiter)
        else:
            old = self._push_offers.get(tid)
            if old is not None:
                self._release(self._push_offers, tid)
            self._hold(self._push_offers, tid, held, loop)
        if conn == "nixl-push":
            return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                    "remote_request_id": ctx.internal_id, "remote_host": self.kv_host,
                    "remote_port": self.kv_port, "tp_size": cfg.tp_size, "dcp_size": 1, "pp_size": cfg.pp_size,
                    "remote_num_tokens": ntok, "transfer_mode": "push", "transfer_id": tid}
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_bootstrap_addr": self.bootstrap_addr, "remote_request_id": ctx.internal_id,
                "remote_num_tokens": ntok, "transfer_id": tid}

    def _hold(self, table: dict, key: str, held: HeldKV, loop) -> None:
        table[key] = held
        self._held_blocks += len(held.block_ids)
        held.timer = loop.call_later(self.config.kv_abort_timeout, self._expire, table, key, held)

    def _release(self, table: dict, key: str) -> HeldKV | None:
        held = table.pop(key, None)
        if held is not None:
            self._held_blocks -= len(held.block_ids)
            if held.timer is not None:
                held.timer.cancel()
                held.timer = None
        return held

    def _expire(self, table: dict, key: str, held: HeldKV) -> None:
        if table.get(key) is not held:
            return
        held.timer = None
        self._release(table, key)
        self.stats.kv_blocks_expired += len(held.block_ids)
        self.stats.kv_requests_expired += 1
        self.kv_events.append({"t": time.monotonic(), "op": "expire", "request_id": held.request_id,
                               "transfer_id": held.transfer_id, "blocks": len(held.block_ids)})

    def _deliver_push(self, held: HeldKV, waiter: tuple[asyncio.Future, str | None]) -> None:
        fut, prompt_hash = waiter
        if prompt_hash != held.prompt_hash:
            self.stats.kv_push_failures += 1
            fut.set_result((409, {"error": self._prompt_mismatch(held)}))
            return
        self.stats.kv_pushes += 1
        self.stats.kv_blocks_served += len(held.block_ids)
        self.kv_events.append({"t": time.monotonic(), "op": "push", "request_id": held.request_id,
                               "transfer_id": held.transfer_id, "blocks": len(held.block_ids)})
        fut.set_result((200, {"num_tokens": held.num_tokens, "block_ids": held.block_ids}))

    def _prompt_mismatch(self, held: HeldKV) -> str:
        return (f"prompt mismatch: the decode's prompt differs from the prompt {self.name} prefilled for "
                f"{held.request_id} (prefill and decode must receive identical prompt content)")

    # -- KV consumer ---------------------------------------------------------------------------
    async def _side_request(self, base_url: str, path: str, payload: dict, timeout: float) -> tuple[int, dict]:
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = ConnectionPool(base_url)
        resp = await pool.request("POST", path, body=_encode(payload),
                                  headers=[(b"content-type", _JSON)],
                                  timeouts=Timeouts(connect=min(timeout, 2.0), headers=timeout, idle=timeout))
        try:
            data = await resp.read()
        finally:
            resp.close()
        try:
            obj = _decode(data) if data else {}
        except msgspec.DecodeError:
            obj = {"error": data[:200].decode("utf-8", "replace")}
        return resp.status, obj if isinstance(obj, dict) else {"error": str(obj)}

    async def _load_kv(self, ctx: _Ctx, kv: dict) -> tuple[bool, Any]:
        """Fetch the prompt's KV from the prefill named in ``kv``; (True, (tokens, blocks)) or
        (False, why)."""
        cfg = self.config
        conn = cfg.kv_connector
        fail = "KV load failed (kv_load_failure_policy=fail): "
        payload = {"remote_engine_id": kv.get("remote_engine_id"), "remote_request_id": kv.get("remote_request_id"),
                   "prompt_hash": ctx.prompt.hash_hex, "consumer": self.engine_id}
        if conn == "nixl":
            need = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
        elif conn == "nixl-push":
            need = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "transfer_id")
        else:
            need = ("remote_bootstrap_addr", "remote_engine_id", "transfer_id")
        missing = [k for k in need if kv.get(k) in (None, "", [])]
        if missing:
            return False, fail + f"kv_transfer_params lacks {', '.join(missing)} for the {conn} connector"
        if conn == "mooncake":
            base = str(kv["remote_bootstrap_addr"]).rstrip("/")
            if "://" not in base:
                base = "http://" + base
        else:
            base = f"http://{kv['remote_host']}:{kv['remote_port']}"
        try:
            if conn == "nixl":
                payload["remote_block_ids"] = kv["remote_block_ids"]
                status, data = await self._side_request(base, "/sim/kv/pull", payload, cfg.kv_side_channel_timeout)
            else:
                timeout = cfg.push_registration_timeout
                payload["transfer_id"] = kv["transfer_id"]
                payload["timeout"] = timeout
                status, data = await self._side_request(base, "/sim/kv/push/register", payload, timeout + 1.0)
        except UpstreamError as exc:
            msg = fail + f"cannot reach the prefill's side channel at {base}: {exc}"
            self.kv_events.append({"t": time.monotonic(), "op": "load", "ok": False, "error": msg})
            return False, msg
        except ValueError as exc:
            return False, fail + f"bad side-channel address {base!r}: {exc}"
        if status == 200:
            self.kv_events.append({"t": time.monotonic(), "op": "load", "ok": True, "peer": base,
                                   "tokens": data.get("num_tokens")})
            blocks = data.get("block_ids")
            return True, (int(data.get("num_tokens") or 0), len(blocks) if isinstance(blocks, list) else 0)
        msg = fail + f"{base} answered {status}: {data.get('error')}"
        self.kv_events.append({"t": time.monotonic(), "op": "load", "ok": False, "error": msg})
        return False, msg

    # -- /sim/ routes --------------------------------------------------------------------------
    async def _sim_route(self, req, writer) -> None:
        path = req.path
        try:
            data = _decode(req.body) if req.body else {}
        except msgspec.DecodeError:
            writer.send(400, b'{"error":"invalid JSON"}')
            return
        if not isinstance(data, dict):
            writer.send(400, b'{"error":"expected a JSON object"}')
            return
        if path == "/sim/kv/pull" and req.method == "POST":
            status, out = self._serve_pull(data)
            writer.send(status, _encode(out))
        elif path == "/sim/kv/push/register" and req.method == "POST":
            status, out = await self._serve_register(data)
            writer.send(status, _encode(out))
        elif path == "/sim/state":
            writer.send(200, _encode(self.state()))
        elif path == "/sim/fault" and req.method == "POST":
            try:
                if data.get("clear"):
                    self.clear_faults()
                if data.get("spec"):
                    self.inject(str(data["spec"]), int(data.get("times", 1)))
            except (ValueError, _faults.FaultSyntaxError) as exc:
                writer.send(400, _encode({"error": str(exc)}))
                return
            writer.send(200, b'{"ok":true}')
        elif path == "/sim/health" and req.method == "POST":
            self.set_health(bool(data.get("ok", True)))
            writer.send(200, b'{"ok":true}')
        else:
            writer.send(404, b'{"detail":"Not Found"}')

    def _serve_pull(self, data: dict) -> tuple[int, dict]:
        rid = data.get("remote_request_id")
        eid = data.get("remote_engine_id")
        ev = {"t": time.monotonic(), "op": "serve-pull", "request_id": rid, "consumer": data.get("consumer")}
        self.kv_events.append(ev)
        if eid != self.engine_id:
            self.stats.kv_push_failures += 1
            ev["error"] = "engine id mismatch"
            return 404, {"error": f"engine id mismatch: the request names {eid!r}, this prefill is "
                                  f"{self.engine_id!r}"}
        held = self._held.get(rid) if isinstance(rid, str) else None
        if held is None:
            self.stats.kv_push_failures += 1
            ev["error"] = "not held"
            return 404, {"error": f"no KV blocks held for request {rid!r} on {self.engine_id} "
                                  "(never produced, already transferred, or expired after kv_abort_timeout)"}
        want = _flat_ints(data.get("remote_block_ids"))
        if want != held.block_ids:
            self.stats.kv_push_failures += 1
            ev["error"] = "block ids"
            return 409, {"error": f"block ids {want} do not match the blocks held for {rid!r}"}
        self._release(self._held, rid)
        if data.get("prompt_hash") != held.prompt_hash:
            self.stats.kv_push_failures += 1
            ev["error"] = "prompt mismatch"
            return 409, {"error": self._prompt_mismatch(held)}
        self.stats.kv_pushes += 1
        self.stats.kv_blocks_served += len(held.block_ids)
        ev["ok"] = True
        return 200, {"num_tokens": held.num_tokens, "block_ids": held.block_ids}

    async def _serve_register(self, data: dict) -> tuple[int, dict]:
        tid = data.get("transfer_id")
        eid = data.get("remote_engine_id")
        self.kv_events.append({"t": time.monotonic(), "op": "register", "transfer_id": tid,
                               "consumer": data.get("consumer")})
        if eid != self.engine_id:
            self.stats.kv_push_failures += 1
            return 404, {"error": f"engine id mismatch: the request names {eid!r}, this prefill is "
                                  f"{self.engine_id!r}"}
        if not isinstance(tid, str) or not tid:
            return 400, {"error": "transfer_id is required"}
        offer = self._release(self._push_offers, tid)
        if offer is not None:
            fut = asyncio.get_running_loop().create_future()
            self._deliver_push(offer, (fut, data.get("prompt_hash")))
            return fut.result()
        if tid in self._push_waiters:
            return 409, {"error": f"transfer_id {tid!r} is already registered by another decoder"}
        timeout = float(data.get("timeout") or self.config.push_registration_timeout)
        fut = asyncio.get_running_loop().create_future()
        entry = (fut, data.get("prompt_hash"))
        self._push_waiters[tid] = entry
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self.stats.kv_push_failures += 1
            return 408, {"error": f"no prefill with transfer_id {tid!r} finished on {self.engine_id} within "
                                  f"{timeout:g} s (push_registration_timeout)"}
        finally:
            if self._push_waiters.get(tid) is entry:
                del self._push_waiters[tid]

    # -- observability -------------------------------------------------------------------------
    def state(self) -> dict:
        eng = self.engine
        return {
            "name": self.name, "role": self.role, "url": self.url, "engine_id": self.engine_id,
            "healthy": self.healthy, "held_kv_blocks": self._held_blocks,
            "held_kv": [{"request_id": h.request_id, "transfer_id": h.transfer_id, "blocks": h.block_ids}
                        for h in list(self._held.values()) + list(self._push_offers.values())],
            "push_waiters": list(self._push_waiters),
            "running": eng.num_running if eng else 0, "waiting": eng.num_waiting if eng else 0,
            "stats": self.stats.as_dict(), "ec_store_entries": len(self.ec_store),
        }

    def _models_body(self) -> bytes:
        m = self.config.model
        return _encode({"object": "list", "data": [{
            "id": m, "object": "model", "created": self.created, "owned_by": "vllm", "root": m,
            "parent": None, "max_model_len": self.config.max_model_len,
            "permission": [{"id": f"modelperm-{self.name}", "object": "model_permission",
                            "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]}]})

    def metrics_text(self) -> str:
        """Prometheus text: vLLM's load signals and counters, plus ``sim:`` extras."""
        eng = self.engine
        st = self.stats
        cfg = self.config
        lbl = f'model_name="{cfg.model}",engine="0"'
        running = eng.num_running if eng else 0
        waiting = eng.num_waiting if eng else 0
        used = (eng.kv_blocks_in_use(cfg.block_size) if eng else 0) + self._held_blocks
        usage = min(used / cfg.num_gpu_blocks, 1.0) if cfg.num_gpu_blocks else 0.0
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lbl}}} {running}.0",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lbl}}} {waiting}.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lbl}}} {usage!r}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason in ("stop", "length", "abort", "error", "repetition"):
            lines.append(f'vllm:request_success_total{{{lbl},finished_reason="{reason}"}} '
                         f"{st.success.get(reason, 0)}.0")
        lines += [
            "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.",
            "# TYPE vllm:prompt_tokens_by_source_total counter",
            f'vllm:prompt_tokens_by_source_total{{{lbl},source="local_compute"}} {st.local_prompt_tokens}.0',
            f'vllm:prompt_tokens_by_source_total{{{lbl},source="local_cache_hit"}} 0.0',
            f'vllm:prompt_tokens_by_source_total{{{lbl},source="external_kv_transfer"}} '
            f"{st.external_cached_tokens}.0",
        ]
        if self.role in ("prefill", "decode") and cfg.kv_connector != "mooncake":
            # NixlConnector's histogram of bytes per transfer (one transfer per KV load here).
            lines += ["# HELP vllm:nixl_bytes_transferred Histogram of bytes transferred per NIXL KV Cache "
                      "transfers.", "# TYPE vllm:nixl_bytes_transferred histogram"]
            cum = 0
            for le, count in zip(st.KV_BYTES_BUCKETS, st.kv_bytes_buckets):
                cum += count
                lines.append(f'vllm:nixl_bytes_transferred_bucket{{{lbl},le="{float(le)!r}"}} {cum}.0')
            lines += [f'vllm:nixl_bytes_transferred_bucket{{{lbl},le="+Inf"}} {st.kv_transfers}.0',
                      f"vllm:nixl_bytes_transferred_count{{{lbl}}} {st.kv_transfers}.0",
                      f"vllm:nixl_bytes_transferred_sum{{{lbl}}} {st.kv_bytes_transferred}.0"]
        counters = [
            ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", st.prompt_tokens),
            ("vllm:generation_tokens_total", "Number of generation tokens processed.", st.generation_tokens),
            ("vllm:num_preemptions_total", "Cumulative number of preemptions.", 0),
            ("vllm:external_prefix_cache_queries_total", "External prefix cache queries from KV connector "
             "cross-instance cache sharing, in terms of number of queried tokens.", st.external_queried_tokens),
            ("vllm:external_prefix_cache_hits_total", "External prefix cache hits from KV connector "
             "cross-instance cache sharing, in terms of number of cached tokens.", st.external_cached_tokens),
            ("vllm:nixl_num_failed_transfers_total", "Failed KV loads (this instance as consumer).",
             st.kv_pull_failures),
            ("sim:requests_total", "Generation requests received.", st.requests),
            ("sim:local_prefills_total", "Prompts computed on this instance instead of loaded over KV transfer.",
             st.local_prefills),
            ("sim:local_encodes_total", "Raw media items encoded by this (consumer) instance itself.",
             st.local_encodes),
            ("sim:ec_hits_total", "Media items found in the encoder cache.", st.ec_hits),
            ("sim:ec_failures_total", "Requests failed for a missing or mismatched embedding.", st.ec_failures),
            ("sim:encoded_items_total", "Media items encoded (encoder).", st.encoded_items),
            ("sim:kv_pulls_total", "Successful KV loads (decode).", st.kv_pulls),
            ("sim:kv_pull_failures_total", "Failed KV loads (decode).", st.kv_pull_failures),
            ("sim:kv_transfers_served_total", "KV hand-offs served to decoders (prefill).", st.kv_pushes),
            ("sim:kv_transfer_refusals_total", "Side-channel requests refused (prefill).", st.kv_push_failures),
            ("sim:kv_expired_blocks_total", "Held blocks freed by kv_abort_timeout (prefill).",
             st.kv_blocks_expired),
            ("sim:aborted_requests_total", "Requests whose client went away before the end.", st.aborted),
            ("sim:faults_injected_total", "Requests that got an injected fault.", st.faults),
        ]
        for name, help_, value in counters:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} counter")
            lines.append(f"{name}{{{lbl}}} {value}.0")
        lines += [
            "# HELP sim:held_kv_blocks KV blocks held for decoders that have not claimed them (stranded KV).",
            "# TYPE sim:held_kv_blocks gauge",
            f"sim:held_kv_blocks{{{lbl}}} {self._held_blocks}.0",
            "# HELP sim:held_kv_requests Requests whose KV is held for a decoder.",
            "# TYPE sim:held_kv_requests gauge",
            f"sim:held_kv_requests{{{lbl}}} {self.held_kv_requests}.0",
        ]
        return "\n".join(lines) + "\n"
