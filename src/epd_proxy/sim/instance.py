"""One simulated vLLM instance: its lifecycle, and the routing of its HTTP requests.

What it does with a request lives beside it, one concern per module:
``generation.py`` (``/v1/chat/completions``, ``/v1/completions``),
``kv_channel.py`` (the KV side channel, ``/sim/kv/...``), ``ec_store.py`` (the
encoder cache), ``utility.py`` (``/tokenize``, ``/detokenize``, ``/v1/embeddings``) and
``observability.py`` (``/sim/state``, ``/v1/models``, ``/metrics``).

Control routes, for driving a simulator that runs in another process:
``GET /sim/state``, ``POST /sim/fault`` ``{"spec": "status=503", "times": 2}`` (or
``{"clear": true}``) and ``POST /sim/health`` ``{"ok": false}``. LoRA adapters (static, and loaded at run time
through ``/v1/load_lora_adapter``) are ``lora.py``'s. Nothing under
``/sim/`` is recorded in ``records``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import msgspec

from epd_proxy.http.server import HttpServer
from epd_proxy.http.server_limits import ServerLimits
from epd_proxy.sim import faults as _faults
from epd_proxy.sim import observability, utility
from epd_proxy.sim.config import SimConfig
from epd_proxy.sim.ec_store import EcStore
from epd_proxy.sim.encoder_cache import EncoderCache
from epd_proxy.sim.engine import Engine
from epd_proxy.sim.generate import DISABLED_BODY, GenerateFormat
from epd_proxy.sim.generation import GenerationHandler
from epd_proxy.sim.kv_channel import KvSideChannel
from epd_proxy.sim.kv_events import KvEventPublisher
from epd_proxy.sim.kv_reuse import KvReuse
from epd_proxy.sim.lora import LoraSlots
from epd_proxy.sim.messages import MessagesFormat
from epd_proxy.sim.prefix_cache import PrefixCache
from epd_proxy.sim.records import SimRecord, Stats
from epd_proxy.sim.responses import JSON, api_error_body, server_error_body, system_fingerprint
from epd_proxy.sim.responses_api import ResponsesFormat
from epd_proxy.sim.validation import ApiError

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # with allow_runtime_lora
_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                     "/inference/v1/generate")


class SimInstance:
    """A simulated ``vllm serve`` with one role: encode, prefill, decode or pd."""

    def __init__(self, role: str, index: int, config: SimConfig, *, host: str = "127.0.0.1",
                 port: int = 0, bootstrap_port: int = 0, ec_store: EcStore | None = None,
                 created: int | None = None, name: str | None = None) -> None:
        self.role = role
        self.index = index
        self.name = name or f"{role}-{index}"
        self.config = cfg = config.for_instance(role, self.name)
        self.engine_id = cfg.engine_id_format.format(role=role, index=index, name=self.name)
        self.host = host
        self.port = port
        self.bootstrap_port = bootstrap_port
        self.ec_store = ec_store if ec_store is not None else EcStore(cfg.ec_store_capacity)
        self.created = created if created is not None else (
            cfg.created if cfg.created is not None else int(time.time()))
        self.created_bytes = b"%d" % self.created
        self.records: deque[SimRecord] = deque(maxlen=cfg.max_records)
        self.stats = Stats()
        self.engine: Engine | None = None
        self.server: HttpServer | None = None
        self.bootstrap_server: HttpServer | None = None
        self.crashed = False
        self._healthy = True
        self._unhealthy_until = 0.0
        self.faults = _faults.FaultSource(role, cfg.fault_rate, cfg.fault_kinds, f"{cfg.fault_seed}/{self.name}")
        self.kv = KvSideChannel(self)
        self.kv_reuse = KvReuse(self.kv)  # bidirectional transfer: blocks kept after a request
        self.kv.on_free = self.kv_reuse.on_free = self._kv_freed
        self.lora = LoraSlots(cfg.served_names, cfg.lora_modules, cfg.max_loras, cfg.lora_swap_ms,
                              cfg.lora_check_paths)
        # The caches vLLM keeps in memory: what an instance computed (prefix cache) or encoded
        # (encoder cache) before. None where the role keeps none.
        self.prefix_cache: PrefixCache | None = None
        if role != "encode" and cfg.enable_prefix_caching:
            capacity = cfg.num_gpu_blocks if cfg.prefix_cache_blocks is None else cfg.prefix_cache_blocks
            self.prefix_cache = PrefixCache(cfg.block_size, capacity)
        self.kv_reuse.cache = self.prefix_cache
        # vLLM's KV cache events of the prefix cache (kv_events.py), when asked for.
        self.kv_events: KvEventPublisher | None = None
        if self.prefix_cache is not None and cfg.kv_events:
            self.kv_events = KvEventPublisher(host, topic=cfg.kv_events_topic, buffer_steps=cfg.kv_events_buffer,
                                              block_size=cfg.block_size)
            self.prefix_cache.listener = self.kv_events.stored
        self.encoder_cache = EncoderCache(cfg.encoder_cache_tokens) if role == "encode" else None
        self._generation = GenerationHandler(self)
        self._responses = ResponsesFormat(self.created, cfg.max_model_len, cfg.responses_store)
        self._messages = MessagesFormat(cfg.prompt_tokens_details)
        # path -> (a chat request, the API's format; None for chat and completions)
        self._apis = {"/v1/chat/completions": (True, None), "/v1/completions": (False, None),
                      "/v1/messages": (True, self._messages), "/v1/responses": (True, self._responses),
                      "/inference/v1/generate": (False, GenerateFormat(self.created))}
        self._tasks: set[asyncio.Task] = set()
        self._in_flight = 0
        self.system_fingerprint = system_fingerprint(
            cfg.system_fingerprint,
            (cfg.model, cfg.max_model_len, role, cfg.kv_connector, cfg.ec_connector, cfg.tp_size, cfg.pp_size,
             cfg.block_size),
            cfg.tp_size, cfg.pp_size)
        self.fingerprint_json = _encode(self.system_fingerprint) if self.system_fingerprint else b""

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
        return self.kv.held_blocks

    @property
    def held_kv_requests(self) -> int:
        return self.kv.held_requests

    @property
    def side_channel_log(self) -> deque[dict]:
        """The KV hand-offs this instance took part in (serve-pull, register, push, load,
        expire): the simulator's own trace, not vLLM's KV cache events."""
        return self.kv.log

    @property
    def healthy(self) -> bool:
        return self._healthy and not self.crashed and (
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
        if self.kv_events is not None:
            ident["kv_events"] = self.kv_events.endpoint
            ident["kv_events_replay"] = self.kv_events.replay_endpoint
        if self.bootstrap_addr:
            ident["bootstrap_port"] = self.bootstrap_port
            ident["bootstrap_addr"] = self.bootstrap_addr
        return ident

    def __repr__(self) -> str:
        return f"<SimInstance {self.name} {self.url}>"

    # -- observability ---------------------------------------------------------------------
    def state(self) -> dict:
        return observability.state(self)

    def metrics_text(self) -> str:
        """Prometheus text: vLLM's load signals and counters, plus ``sim:`` extras."""
        return observability.metrics_text(self)

    # -- control (tests) -------------------------------------------------------------------
    def inject(self, spec: str, times: int = 1) -> None:
        """Apply the faults in ``spec`` to the next ``times`` generation requests
        (any generation API) reaching this instance."""
        self.faults.inject(spec, times)

    def clear_faults(self) -> None:
        self.faults.clear()

    def set_health(self, ok: bool) -> None:
        """``/health`` answers 200 (True) or 503 (False)."""
        self._healthy = bool(ok)
        if ok:
            self._unhealthy_until = 0.0

    def set_unhealthy_for(self, seconds: float) -> None:
        """``/health`` answers 503 for ``seconds`` (the ``unhealthy`` fault)."""
        self._unhealthy_until = asyncio.get_running_loop().time() + seconds

    def clear_records(self) -> None:
        self.records.clear()

    def generation_records(self) -> list[SimRecord]:
        return [r for r in self.records if r.path in _GENERATION_PATHS]

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> "SimInstance":
        if self.engine is None:
            cfg = self.config
            self.engine = Engine(cfg.itl_ms, cfg.max_num_seqs, chunk_tokens=cfg.chunked_prefill_tokens,
                                 per_token_ms=cfg.ttft_per_token_ms, block_size=cfg.block_size,
                                 num_blocks=cfg.num_gpu_blocks, reserved=self._reserved_blocks)
        limits = ServerLimits(keep_alive_timeout=self.config.keep_alive_timeout)
        self.server = await HttpServer(self._handle, error_body=server_error_body, limits=limits).start(
            self.host, self.port)
        self.port = self.server.port
        if self.role == "prefill" and self.config.kv_connector == "mooncake":
            self.bootstrap_server = await HttpServer(self._handle, error_body=server_error_body, limits=limits).start(
                self.host, self.bootstrap_port)
            self.bootstrap_port = self.bootstrap_server.port
        if self.kv_events is not None:
            self.kv_events.start()
        self.crashed = False
        return self

    def _reserved_blocks(self) -> int:
        """KV blocks held outside the running requests: for a decoder's pull, and kept after a
        request for the next turn's prefill (bidirectional)."""
        return self.kv.held_blocks + self.kv_reuse.kept_blocks

    def _kv_freed(self) -> None:
        if self.engine is not None:
            self.engine.capacity_freed()

    async def _close_servers(self) -> None:
        servers = [s for s in (self.server, self.bootstrap_server) if s is not None]
        self.server = None
        self.bootstrap_server = None
        for s in servers:
            await s.close(abort_connections=True)

    async def stop(self) -> None:
        """Shut down: listener closed, connections reset, held KV dropped."""
        self.crashed = True
        await self._close_servers()
        if self.kv_events is not None:
            await self.kv_events.close()
        self.kv.drop()
        self.kv_reuse.drop()
        await self.kv.close_pools()
        if self.engine is not None:
            self.engine.close()
        for t in list(self._tasks):
            if t is not asyncio.current_task():
                t.cancel()

    async def crash(self) -> None:
        """Die like a killed process: close the listener, reset every connection,
        lose the KV held for decoders. ``restart()`` brings it back on the same port."""
        self.crashed = True
        await self._close_servers()
        if self.kv_events is not None:  # a new process publishes anew, its sequence from 0
            await self.kv_events.close()
        self.kv.drop()
        self.kv_reuse.drop()
        self._forget_caches()
        await self.kv.close_pools()
        # Let the cancelled handlers run their cleanup.
        await asyncio.sleep(0)

    def _forget_caches(self) -> None:
        """A restarted vLLM starts with empty caches."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.encoder_cache is not None:
            self.encoder_cache.clear()
        self._responses.clear()

    async def restart(self) -> None:
        """Start again on the same port(s) after ``crash()``."""
        if self.server is not None:
            return
        await self.start()

    def spawn(self, coro) -> asyncio.Task:
        """A task that ``stop()`` cancels."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def crash_and_restart(self, after: float | None) -> None:
        await self.crash()
        if after is not None:
            await asyncio.sleep(after)
            await self.restart()

    # -- HTTP entry point ------------------------------------------------------------------
    async def _handle(self, req, writer) -> None:
        path = req.path
        api = self._apis.get(path)
        if api is not None:
            if req.method != "POST":
                writer.send(405, b'{"detail":"Method Not Allowed"}')
                return
            if path == "/inference/v1/generate" and not self.config.enable_scale_out:
                self._send(writer, self.new_record(req, time.monotonic()), 403, DISABLED_BODY,
                           error="scale-out endpoints are disabled (SimConfig.enable_scale_out)")
                return
            self._in_flight += 1
            try:
                await self._generation.serve(req, writer, *api)
            finally:
                self._in_flight -= 1
            return
        if path.startswith("/v1/responses/"):
            status, body = self._responses.stored(req.method, path)
            self._send(writer, self.new_record(req, time.monotonic()), status, body)
            return
        if path == "/v1/messages/count_tokens" and req.method == "POST":
            status, body = self._messages.count_tokens(req.body)
            self._send(writer, self.new_record(req, time.monotonic()), status, body)
            return
        if path.startswith("/sim/"):
            await self._sim_route(req, writer)
            return
        rec = self.new_record(req, time.monotonic())
        if path == "/health":
            status = 200 if self.healthy else 503
            self._send(writer, rec, status, b"", content_type=None)
        elif path == "/metrics":
            self._send(writer, rec, 200, self.metrics_text().encode(),
                       content_type=b"text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            self._send(writer, rec, 200, observability.models_body(self))
        elif path in _LORA_ROUTES and req.method == "POST" and self.config.allow_runtime_lora:
            try:
                data = _decode(req.body) if req.body else None
            except msgspec.DecodeError:
                data = None
            status, out, text = (self.lora.load if path == _LORA_ROUTES[0] else self.lora.unload)(data)
            self._send(writer, rec, status, out, content_type=b"text/plain; charset=utf-8" if text else JSON)
        elif path in utility.PATHS and req.method == "POST":
            rid = req.headers.get(b"x-request-id")
            status, body = utility.answer(path, req.body, self.config, rid.decode("latin-1") if rid else "sim")
            self._send(writer, rec, status, body)
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

    def new_record(self, req, t: float) -> SimRecord | None:
        """The request's record (None with ``records=False``)."""
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
              content_type: bytes | None = JSON, headers=None, error: str | None = None) -> None:
        writer.send(status, body, content_type=content_type, headers=headers)
        if rec is not None:
            rec.t_headers = rec.t_end = time.monotonic()
            rec.status = status
            rec.bytes_sent = len(body)
            if error is not None:
                rec.error = error

    def send_error(self, writer, rec: SimRecord | None, exc: ApiError, headers=None, body: bytes | None = None) -> None:
        """A refusal in vLLM's envelope (or ``body``, another API's); the record keeps its message."""
        self._send(writer, rec, exc.status, api_error_body(exc) if body is None else body, headers=headers,
                   error=exc.message)

    # -- /sim/ routes ----------------------------------------------------------------------
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
        if path == "/sim/kv/read" and req.method == "POST":
            status, out = self.kv_reuse.serve_read(data)
            writer.send(status, _encode(out))
        elif path == "/sim/kv/pull" and req.method == "POST":
            status, out = self.kv.serve_pull(data)
            writer.send(status, _encode(out))
        elif path == "/sim/kv/push/register" and req.method == "POST":
            status, out = await self.kv.serve_register(data)
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
