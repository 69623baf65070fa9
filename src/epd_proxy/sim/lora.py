"""LoRA adapters on a simulated instance, as vLLM 0.32 serves them.

Static adapters (``lora_modules``, vLLM's ``--lora-modules name=path``) and adapters loaded
at run time (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, served only with
``allow_runtime_lora``, as vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; without it both routes
are FastAPI's 404). The answers are vLLM's: ``200`` plain text ``Success: LoRA adapter 'x'
added successfully.``, ``400 InvalidUserInput`` for a name loaded already (or a base model's
name, or a missing field), ``404 NotFoundError`` for unloading an adapter it does not have.

vLLM keeps ``--max-loras`` adapters active in its GPU slots; a request for one that is not
there waits while it is swapped in, the least recently used one going out. The simulator
charges ``lora_swap_ms`` for that swap and counts it (``sim:lora_swaps_total``), and exports
vLLM's own ``vllm:lora_requests_info`` gauge (the running adapters in a label), so a client
can see adapter thrashing. An adapter's answers differ from the base model's and from every
other adapter's: its output is seeded by its path (its weights), see ``tokens.py``.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import msgspec

_encode = msgspec.json.encode


def parse_modules(entries: tuple[str, ...]) -> dict[str, str]:
    """``("name=path", ...)`` (vLLM's ``--lora-modules`` form) as ``{name: path}``."""
    out: dict[str, str] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora module {entry!r} is not name=path")
        out[name] = path
    return out


def _error(status: int, message: str, kind: str) -> tuple[int, bytes]:
    """vLLM's ``ErrorResponse``: ``{"error": {message, type, param, code}}``."""
    return status, _encode({"error": {"message": message, "type": kind, "param": None, "code": status}})


class LoraSlots:
    """The adapters one instance knows and the ``max_loras`` slots they are active in."""

    def __init__(self, bases: tuple[str, ...], modules: tuple[str, ...], max_loras: int, swap_ms: float,
                 check_paths: bool = False) -> None:
        self.bases = bases
        self.adapters: dict[str, str] = parse_modules(modules)  # name -> path, in load order
        self.max_loras = max(1, max_loras)
        self.swap_ms = swap_ms
        self.check_paths = check_paths
        self.active: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.running: dict[str, int] = {}  # requests in flight per adapter
        self.swaps = 0  # adapters swapped into a slot (vLLM loads them there)
        self.requests = 0  # requests that named an adapter

    def path(self, name: object) -> str | None:
        return self.adapters.get(name) if type(name) is str else None

    # -- requests ---------------------------------------------------------------------------
    def acquire(self, name: str) -> float:
        """A request for adapter ``name`` starts: the swap-in time (ms) it waits, 0 when active."""
        self.requests += 1
        self.running[name] = self.running.get(name, 0) + 1
        if name in self.active:
            self.active.move_to_end(name)
            return 0.0
        if len(self.active) >= self.max_loras:
            self.active.popitem(last=False)
        self.active[name] = None
        self.swaps += 1
        return self.swap_ms

    def release(self, name: str) -> None:
        n = self.running.get(name, 0) - 1
        if n > 0:
            self.running[name] = n
        else:
            self.running.pop(name, None)

    # -- the runtime routes -----------------------------------------------------------------
    def load(self, body: object) -> tuple[int, bytes, bool]:
        """``POST /v1/load_lora_adapter``: (status, body, plain text)."""
        if not isinstance(body, dict):
            return (*_error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"), False)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            return (*_error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"), False)
        if name in self.bases:
            return (*_error(400, f"The lora adapter '{name}' conflicts with a served base model.",
                            "InvalidUserInput"), False)
        if not body.get("load_inplace") and name in self.adapters:
            return (*_error(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                                 "the adapter in place, set 'load_inplace' to True.", "InvalidUserInput"), False)
        if self.check_paths and not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return (*_error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError"),
                    False)
        self.adapters[name] = path
        self.active.pop(name, None)  # new weights: swapped in again on first use
        return 200, f"Success: LoRA adapter '{name}' added successfully.".encode(), True

    def unload(self, body: object) -> tuple[int, bytes, bool]:
        """``POST /v1/unload_lora_adapter``: (status, body, plain text)."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            return (*_error(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                            "InvalidUserInput"), False)
        if name not in self.adapters:
            return (*_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError"), False)
        del self.adapters[name]
        self.active.pop(name, None)
        return 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), True

    # -- what it reports --------------------------------------------------------------------
    def cards(self, base: str, created: int, permission: list) -> list[dict]:
        """The adapters' ``/v1/models`` cards, as vLLM's: ``root`` the path, ``parent`` the base."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": path,
                 "parent": base, "max_model_len": None, "permission": permission}
                for name, path in self.adapters.items()]

    def metrics_lines(self, lbl: str, now: float) -> list[str]:
        """vLLM's ``vllm:lora_requests_info`` (running adapters in a label, the value a time) and
        the simulator's swap and request counters."""
        running = ",".join(n for n in self.running)
        return [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
            f'vllm:lora_requests_info{{max_lora="{self.max_loras}",running_lora_adapters="{running}",'
            f'waiting_lora_adapters=""}} {now!r}',
            "# HELP sim:lora_swaps_total Adapters swapped into one of the max_loras slots (each cost lora_swap_ms).",
            "# TYPE sim:lora_swaps_total counter",
            f"sim:lora_swaps_total{{{lbl}}} {self.swaps}.0",
            "# HELP sim:lora_requests_total Generation requests that named a LoRA adapter.",
            "# TYPE sim:lora_requests_total counter",
            f"sim:lora_requests_total{{{lbl}}} {self.requests}.0",
        ]
