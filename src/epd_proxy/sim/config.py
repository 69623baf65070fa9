"""Simulator settings: one :class:`SimConfig` per cluster, with per-role overrides."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

ROLES = ("encode", "prefill", "decode", "pd")
KV_CONNECTORS = ("nixl", "nixl-push", "mooncake")
EC_CONNECTORS = ("nixl", "example")
# ``roles`` may also be keyed by one instance's name (``decode-1``): its own overrides, over its role's.
INSTANCE_NAME = re.compile(r"^(encode|prefill|decode|pd)-[0-9]+$")


@dataclass
class SimConfig:
    """How simulated instances behave. Times are milliseconds unless named ``*_timeout``
    (seconds). Defaults are small, for tests; ``roles`` overrides any field per role,
    e.g. ``SimConfig(roles={"decode": {"itl_ms": 5}})``."""

    # --- identity and API ---------------------------------------------------------
    model: str = "sim-model"
    # Every name it serves (vLLM's --served-model-name a b; ``models=a|b`` in a spec), the
    # first being ``model``; () = just ``model``. Each is a card of /v1/models.
    models: tuple[str, ...] = ()
    max_model_len: int = 32768
    # LoRA (lora.py): static adapters, vLLM's --lora-modules ("name=path"; ``lora_modules=a=/x|b=/y``
    # in a spec); the --max-loras slots and the time an adapter takes to swap into one; the
    # runtime load/unload routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING); and whether a loaded path
    # must hold an adapter_config.json on disk (vLLM reads it; the simulator takes any path otherwise).
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    lora_swap_ms: float = 5.0
    allow_runtime_lora: bool = False
    lora_check_paths: bool = False
    check_model: bool = True  # unknown "model" -> 404, as vLLM
    # The "system_fingerprint" of responses: "auto" = vLLM's default form "vllm-0.32.0-<8 hex>",
    # stable per instance configuration; "" = none (null, as with --fingerprint-mode none);
    # anything else is used as is (--fingerprint-mode custom).
    system_fingerprint: str = "auto"
    created: int | None = None  # the "created" field; None = the cluster's start time
    engine_id_format: str = "sim-{role}-{index}"  # {role}, {index}, {name}
    # Serve /inference/v1/generate (vllm serve --enable-scale-out); else it answers 403.
    enable_scale_out: bool = False
    # Keep /v1/responses answers for GET, cancel and previous_response_id, as vLLM does with
    # VLLM_ENABLE_RESPONSES_API_STORE=1 (without it, vLLM silently stores nothing).
    responses_store: bool = True

    # --- latency model (continuous batching; see engine.py) ---------------------------
    ttft_ms: float = 2.0  # base prefill time
    ttft_per_token_ms: float = 0.01  # plus this per prompt token not found in the prefix cache
    itl_ms: float = 1.0  # engine step = inter-token latency; 0 = as fast as possible
    encode_ms_per_item: float = 1.0  # encoder time per distinct media item missing from its cache
    encode_ms_per_mm_token: float = 0.0  # plus this per placeholder token of such an item (its size)
    local_encode_ms_per_item: float = 2.0  # a consumer encoding a raw item itself
    kv_load_ms: float = 0.2  # decode: after the KV arrived, before the first token
    max_num_seqs: int = 256
    # vLLM's chunked prefill (a step's token budget, max_num_batched_tokens): with N > 0 the
    # prompt tokens an instance computes go through its engine steps N at a time, each step
    # lasting itl_ms + ttft_per_token_ms x its prefill tokens, so a prefill delays the tokens
    # of every sequence running beside it and concurrent prefills queue. 0 = the simple model:
    # a prompt's computation takes its TTFT beside the other sequences and costs them nothing.
    chunked_prefill_tokens: int = 0
    default_max_tokens: int = 16  # output length when the request sets no max

    # --- KV transfer ------------------------------------------------------------------
    kv_connector: str = "nixl"  # nixl (pull) | nixl-push | mooncake
    kv_abort_timeout: float = 480.0  # P frees unclaimed blocks after this (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
    push_registration_timeout: float = 480.0  # D gives up waiting for a push after this
    kv_side_channel_timeout: float = 5.0  # D's pull request over the side channel
    block_size: int = 16  # tokens per KV block (held KV and the prefix cache)
    num_gpu_blocks: int = 65536  # for vllm:kv_cache_usage_perc
    tp_size: int = 1
    pp_size: int = 1
    # usage.prompt_tokens_details.cached_tokens, as vLLM's --enable-prompt-tokens-details (off by
    # default there too): a prefill/pd reports its prefix-cache hits; a decode after a KV load
    # reports the prefill's (remote_prefill_cached_tokens), else the tokens it loaded.
    prompt_tokens_details: bool = False
    kv_bytes_per_block: int = 2 * 1024 * 1024  # for vllm:nixl_bytes_transferred (16 tokens x 128 KiB)
    # A failed KV load answers only after this long. Real NIXL waits for its handshake timeout
    # (about 5 s) when the side channel is dead; 0 keeps the simulator fast.
    kv_failure_delay_ms: float = 0.0
    # Deliberate strictness (real vLLM accepts both): a prefill refuses a request without
    # kv_transfer_params.do_remote_decode, a decode refuses one with do_remote_decode, so a proxy
    # that skips or mixes up P/D is caught. False = behave like vLLM (NixlConnector does not
    # enforce kv_role: any prefill/decode produces KV for do_remote_decode and loads it for
    # do_remote_prefill).
    strict_roles: bool = True
    # vLLM's bidirectional NIXL transfer (kv_connector_extra_config.bidirectional_kv_xfer on both
    # sides; see kv_reuse.py): a decode pins every finished request's blocks (prompt and answer)
    # that came with kv_transfer_params (a plain one pins nothing, as in vLLM) for
    # bidirectional_kv_ttl seconds (vLLM's decoder_kv_blocks_ttl) and its non-stream answer carries
    # kv_transfer_params naming them; a prefill given those reads from that decode what lies beyond
    # its own prefix cache when that is at least kv_recompute_threshold tokens.
    bidirectional: bool = False
    bidirectional_kv_ttl: float = 480.0
    kv_recompute_threshold: int = 64
    # vLLM 0.32 sends decode's parameters only in a non-stream body; True also sends them in a
    # stream, as a chunk of their own just before [DONE] (what a later vLLM presumably does).
    bidirectional_stream_params: bool = False
    # A prefill refuses to read blocks whose expiry is this close (vLLM: 5 s) -> HTTP 500.
    kv_expiry_margin: float = 5.0

    # --- caches -----------------------------------------------------------------------
    # vLLM's automatic prefix caching (on by default in vLLM's V1 engine) on the instances that
    # compute prompts (prefill, pd, and a decode without remote KV): chained hashes of full
    # block_size blocks, LRU beyond prefix_cache_blocks blocks (None = num_gpu_blocks).
    enable_prefix_caching: bool = True
    prefix_cache_blocks: int | None = None
    # vLLM's KV cache events (--kv-events-config, publisher zmq; kv_events.py) from every
    # instance with a prefix cache: a PUB and a replay ROUTER socket on loopback ports of
    # their own, the last kv_events_buffer batches kept for replay.
    kv_events: bool = False
    kv_events_buffer: int = 10_000
    kv_events_topic: str = "kv"
    # An encoder's cache of its outputs, keyed by the item's hash: a hit costs nothing; it
    # holds this many placeholder tokens of outputs (0 = no cache, every item is encoded).
    encoder_cache_tokens: int = 16384

    # --- EC ---------------------------------------------------------------------------
    # What an encoder reports in ec_transfer_params: "nixl" = {metadata (grids), item_indices,
    # peer_host, peer_port, size_bytes}; "example" = vLLM's ECExampleConnector: {item_indices,
    # metadata: {}} and no handle (consumers then find the cache by the item's hash).
    ec_connector: str = "nixl"
    hidden_size: int = 2048  # size_bytes = tokens * hidden_size * 2
    ec_store_capacity: int = 100_000

    # --- output -----------------------------------------------------------------------
    split_utf8: bool = True  # write some SSE events in two pieces cut inside a character
    # Tokens per stream event. vLLM sends the outputs a stream has not sent yet as one event
    # when the stream falls behind the engine (vLLM 0.32, measured: 952-959 chat chunks and
    # 829-900 Responses deltas per 1,000 tokens); N > 1 merges every N tokens (and the last
    # ones) into one event, their text joined, on chat, completions and Messages streams.
    # 1 = one event per token.
    stream_merge: int = 1
    # Echo X-Request-Id (or a generated id) on every response, as vLLM does with
    # --enable-request-id-headers. vLLM's default is not to echo (it still uses the id).
    echo_request_id: bool = True
    keep_alive_timeout: float = 5.0  # idle keep-alive connections closed after (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)

    # --- faults -----------------------------------------------------------------------
    fault_rate: float = 0.0  # probability that a generation request gets a random fault
    fault_seed: int = 0
    fault_kinds: tuple[str, ...] = ("status=503", "error-after=1", "reset-after=1")

    # --- bookkeeping ------------------------------------------------------------------
    records: bool = True
    max_records: int = 100_000
    record_responses: bool = False  # keep each response body in its record (SimRecord.response_body)

    roles: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {KV_CONNECTORS}, not {self.kv_connector!r}")
        if self.ec_connector not in EC_CONNECTORS:
            raise ValueError(f"ec_connector must be one of {EC_CONNECTORS}, not {self.ec_connector!r}")
        for role, over in self.roles.items():
            if role not in ROLES and not INSTANCE_NAME.match(role):
                raise ValueError(f"unknown role {role!r} in SimConfig.roles")
            bad = set(over) - {f.name for f in dataclasses.fields(self)} | ({"roles"} & set(over))
            if bad:
                raise ValueError(f"unknown SimConfig fields for role {role!r}: {sorted(bad)}")
            if over:
                dataclasses.replace(self, roles={}, **over)  # checks the overridden values
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {self.block_size}")
        self.fault_kinds = tuple(self.fault_kinds)
        self.models = tuple(self.models)
        self.lora_modules = tuple(self.lora_modules)
        if self.models:
            self.model = self.models[0]

    @property
    def served_names(self) -> tuple[str, ...]:
        """The model names this instance answers to."""
        return self.models or (self.model,)

    def for_role(self, role: str) -> "SimConfig":
        """This config with the overrides of ``role`` applied."""
        over = self.roles.get(role)
        if not over:
            return self
        return dataclasses.replace(self, roles={}, **over)

    def for_instance(self, role: str, name: str) -> "SimConfig":
        """This config with the overrides of ``role`` and then of the instance ``name`` applied."""
        over = {**self.roles.get(role, {}), **self.roles.get(name, {})}
        if not over:
            return self
        return dataclasses.replace(self, roles={}, **over)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def with_values(self, values: dict[str, str]) -> "SimConfig":
        """A copy with fields set from strings (topology spec / CLI), converted by type."""
        changes: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(self)}
        for key, raw in values.items():
            if key not in types or key == "roles":
                raise ValueError(f"unknown simulator setting {key!r}")
            t = str(types[key])
            if t.startswith("bool"):
                changes[key] = raw.lower() in ("1", "true", "yes", "on")
            elif t.startswith("int"):
                changes[key] = None if raw.lower() == "none" else int(raw)
            elif t.startswith("float"):
                changes[key] = float(raw)
            elif t.startswith("tuple"):
                changes[key] = tuple(x for x in raw.split("|" if key in ("models", "lora_modules") else ";") if x)
            else:
                changes[key] = raw
        return dataclasses.replace(self, **changes)
