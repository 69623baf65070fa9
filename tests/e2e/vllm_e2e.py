"""Helpers for the end-to-end suite against real vLLM (``make e2e``).

Processes: every process started here is a session leader (``start_new_session``), so stopping
it by its PID also stops the children it spawned (vLLM's EngineCore), and nothing else.
HTTP: stdlib ``http.client`` only, with a timeout on every call.
"""

from __future__ import annotations

import atexit
import base64
import http.client
import http.server
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.environ.get("EPD_E2E_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "epd-proxy-e2e")
VENV = os.environ.get("EPD_E2E_VENV") or os.path.join(CACHE, "venv")
MODELS = os.environ.get("EPD_E2E_MODELS") or os.path.join(CACHE, "models")
# e2e/run.sh sets these to 1: a missing vLLM environment or a missing proxy is then an error,
# not a skip, so CI cannot go green without running anything.
STRICT_VLLM = os.environ.get("EPD_E2E_REQUIRE_VLLM") == "1"
STRICT_PROXY = os.environ.get("EPD_E2E_REQUIRE_PROXY") == "1"
VLLM_START_TIMEOUT = float(os.environ.get("EPD_E2E_START_TIMEOUT", "300"))
PROXY_START_TIMEOUT = float(os.environ.get("EPD_E2E_PROXY_START_TIMEOUT", "30"))
REQUEST_TIMEOUT = float(os.environ.get("EPD_E2E_REQUEST_TIMEOUT", "120"))
MODEL_NAME = "tiny"
KV_CACHE_BYTES = 64 * 1024 * 1024  # ~65k tokens for the tiny models; whole GiB is the env var's unit

# ---------------------------------------------------------------------------------------------
# processes


_LIVE: dict[int, "Proc"] = {}


def _stop_all_at_exit() -> None:
    for p in list(_LIVE.values()):
        p.stop()


atexit.register(_stop_all_at_exit)


# Ports handed to the processes we start come from below the kernel's ephemeral range
# (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default): vLLM and NIXL bind their
# own sockets to ephemeral picks while the instances start together, and one of those could
# take a port chosen for another instance before it binds it.
_PORTS = range(20000, 32000)


_GIVEN: set[int] = set()  # handed out already: free now, but another process may be about to bind it


def free_port() -> int:
    """A currently free loopback TCP port outside the ephemeral range, never one handed out
    before in this run (instances starting together bind theirs late)."""
    for _ in range(1000):
        port = random.choice(_PORTS)
        if port in _GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1}")


def free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


class Proc:
    """A process we started, in its own session; stopped by its PID (= its process group id)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: str,
                 cwd: str | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "ab", buffering=0)
        self._log.write(("$ " + " ".join(argv) + "\n").encode())
        self.popen = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.pid = self.popen.pid
        self.started = time.monotonic()
        _LIVE[self.pid] = self

    def alive(self) -> bool:
        return self.popen.poll() is None

    def _signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pid, sig)  # pgid == pid: start_new_session made it the group leader
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return False

    def stop(self, grace: float = 8.0) -> None:
        if self.pid not in _LIVE:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        # Leader gone or not: make sure no member of its group survives.
        deadline = time.monotonic() + 2.0
        while self._signal_group(0) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._signal_group(signal.SIGKILL):
            time.sleep(0.2)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _LIVE.pop(self.pid, None)
        try:
            self._log.close()
        except Exception:
            pass

    def log_text(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def tail(self, n: int = 60) -> str:
        """The last n lines of the log, DEBUG lines left out."""
        lines = [ln for ln in self.log_text().splitlines() if " DEBUG " not in ln]
        return "\n".join(lines[-n:])


def wait_http_ok(proc: Proc, url: str, timeout: float, path: str = "/health") -> float:
    """Poll GET url+path until 200; fail fast if the process dies. Returns seconds waited."""
    t0 = time.monotonic()
    last = ""
    while True:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} (pid {proc.pid}) exited with {proc.popen.returncode} "
                               f"before {url}{path} answered; log {proc.log_path}:\n{proc.tail()}")
        try:
            r = request(url, "GET", path, timeout=5)
            if r.status == 200:
                return time.monotonic() - t0
            last = f"HTTP {r.status}"
        except OSError as e:
            last = repr(e)
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{proc.name} (pid {proc.pid}) not ready at {url}{path} after "
                               f"{timeout:.0f}s ({last}); log {proc.log_path}:\n{proc.tail()}")
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# vLLM instances


def vllm_env(core: int, side_channel_port: int | None, debug: bool = False,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTEST_CURRENT_TEST",
                        "PYTEST_ADDOPTS", "VLLM_CPU_KVCACHE_SPACE")}
    env["PATH"] = os.path.join(VENV, "bin") + os.pathsep + env.get("PATH", "")
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        # vLLM would advertise the eth0 address for its internal message queue.
        "VLLM_HOST_IP": "127.0.0.1",
        # Worker inside the EngineCore process: one spawn less, ~30% less RAM, faster start.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # 'auto' binds every instance to core 0; give each its own core.
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        # the noprog plugin (installed by e2e/setup_vllm.sh) keeps idle NIXL agents off the CPU
        "VLLM_NIXL_PROG_THREAD": "0",
        "TOKENIZERS_PARALLELISM": "false",
        # the logs are files; flush each line so tests can read them while the server runs
        "PYTHONUNBUFFERED": "1",
    })
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    if debug:
        env["VLLM_LOGGING_LEVEL"] = "DEBUG"
    env.update(extra or {})
    return env


@dataclass
class Vllm:
    name: str
    model: str            # directory under MODELS
    core: int
    args: list[str] = field(default_factory=list)
    debug: bool = False
    max_model_len: int = 512
    engine_id: str | None = None  # pinned in its kv-transfer-config (push prefill)
    env: dict[str, str] = field(default_factory=dict)  # added to its environment
    kv_events: bool = False  # publish vLLM's KV cache events (ZMQ) on ports of its own
    port: int = 0
    side_channel_port: int = 0
    events_port: int = 0
    replay_port: int = 0
    proc: Proc | None = None
    ready_after: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: str, *, same_ports: bool = False) -> None:
        """Launch the process; ``same_ports``: on the ports of its previous run (a restart)."""
        if not same_ports:
            self.port, self.side_channel_port = free_ports(2)
            if self.kv_events:
                self.events_port, self.replay_port = free_ports(2)
        events: list[str] = []
        if self.kv_events:
            events = ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                # vLLM binds only a wildcard endpoint (its PUB connects to any other address)
                "endpoint": f"tcp://*:{self.events_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"})]
        argv = [os.path.join(VENV, "bin", "vllm"), "serve", os.path.join(MODELS, self.model),
                "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(self.max_model_len), "--dtype", "float32", "--enforce-eager",
                "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
                "--uvicorn-log-level", "warning", *events, *self.args]
        self.proc = Proc(f"vllm-{self.name}", argv,
                         vllm_env(self.core, self.side_channel_port, self.debug, self.env), log_dir)

    def wait_ready(self) -> None:
        assert self.proc is not None
        self.ready_after = wait_http_ok(self.proc, self.url, VLLM_START_TIMEOUT)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def kill(self) -> None:
        """SIGKILL to its whole process group (the engine dies with no goodbye), then reaped."""
        assert self.proc is not None
        self.proc._signal_group(signal.SIGKILL)
        self.proc.stop(grace=0)

    def freeze(self) -> None:
        """SIGSTOP to its whole process group: wedged, its connections open and silent."""
        assert self.proc is not None
        self.proc._signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        assert self.proc is not None
        self.proc._signal_group(signal.SIGCONT)

    def restart(self, log_dir: str) -> None:
        """Started again on the same ports (as a pod's container restarts), ready when this returns."""
        self.stop()
        self.start(log_dir, same_ports=True)
        self.wait_ready()

    def log(self) -> str:
        return self.proc.log_text() if self.proc else ""

    def metrics(self) -> "Metrics":
        return Metrics.scrape(self.url)

    def events_spec(self) -> str:
        """This instance as epd-proxy takes it with its KV event sockets."""
        return (f"{self.url};kv_events=tcp://127.0.0.1:{self.events_port};"
                f"kv_events_replay=tcp://127.0.0.1:{self.replay_port}")

    def push_spec(self) -> str:
        """This (push prefill) instance as epd-proxy's --prefill takes it: URL + NIXL identity."""
        assert self.engine_id, f"{self.name} has no pinned engine_id"
        return (f"{self.url};engine_id={self.engine_id};kv_host=127.0.0.1;"
                f"kv_port={self.side_channel_port};tp=1;pp=1")


def nixl_config(role: str, connector: str = "NixlConnector", engine_id: str | None = None,
                extra: dict | None = None) -> str:
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu"}
    if engine_id is not None:
        cfg["engine_id"] = engine_id
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return json.dumps(cfg)


def ec_config(role: str, path: str) -> str:
    return json.dumps({"ec_connector": "ECExampleConnector", "ec_role": role,
                       "ec_buffer_device": "cpu",
                       "ec_connector_extra_config": {"shared_storage_path": path}})


class Cluster:
    """A set of vLLM instances started together and stopped together."""

    def __init__(self, name: str, instances: dict[str, Vllm], log_dir: str,
                 ec_dir: str | None = None) -> None:
        self.name = name
        self.instances = instances
        self.log_dir = log_dir
        self.ec_dir = ec_dir
        self.started_in = 0.0
        self.ready = False
        self._t0 = 0.0

    def __getattr__(self, item: str) -> Vllm:
        inst = self.__dict__.get("instances", {})
        if item in inst:
            return inst[item]
        raise AttributeError(item)

    def start(self) -> None:
        """Launch every instance and wait until each answers ``/health``."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the processes without waiting for them (as pods start together)."""
        self._t0 = time.monotonic()
        self.ready = False
        try:
            for v in self.instances.values():
                v.start(self.log_dir)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self) -> None:
        if self.ready:
            return
        try:
            for v in self.instances.values():
                v.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.ready = True
        self.started_in = time.monotonic() - self._t0
        print(f"\n[e2e] cluster {self.name} up in {self.started_in:.0f}s: "
              + ", ".join(f"{k}={v.url} (sc {v.side_channel_port})" for k, v in self.instances.items()),
              file=sys.stderr)

    def stop(self) -> None:
        for v in self.instances.values():
            v.stop()
        if self.ec_dir:
            shutil.rmtree(self.ec_dir, ignore_errors=True)


def pd_cluster(log_dir: str) -> Cluster:
    """1 prefill + 1 decode, tiny Llama, KV over NIXL (pull)."""
    # max-model-len 2048: room for a long decode in the client-disconnect test.
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (test_pd_usage.py);
    # it adds that field to usage when it is not 0, nothing else.
    details = ["--enable-prompt-tokens-details"]
    return Cluster("pd", {
        "prefill": Vllm("pd-prefill", "tiny-model", 0, max_model_len=2048,
                        args=["--kv-transfer-config", nixl_config("kv_producer"), *details]),
        "decode": Vllm("pd-decode", "tiny-model", 1, max_model_len=2048,
                       args=["--kv-transfer-config", nixl_config("kv_consumer"), *details]),
    }, log_dir)


def multiturn_cluster(log_dir: str) -> Cluster:
    """1 prefill + 1 decode, tiny Llama, NIXL pull with bidirectional transfer on both: decode
    keeps each finished request's blocks for the next turn's prefill to read
    (``--enable-scale-out``: ``/inference/v1/generate`` too)."""
    bidir = {"bidirectional_kv_xfer": True}
    return Cluster("mt", {
        "prefill": Vllm("mt-prefill", "tiny-model", 0, max_model_len=2048,
                        args=["--kv-transfer-config", nixl_config("kv_producer", extra=bidir), "--enable-scale-out"]),
        "decode": Vllm("mt-decode", "tiny-model", 1, max_model_len=2048,
                       args=["--kv-transfer-config", nixl_config("kv_consumer", extra=bidir), "--enable-scale-out"]),
    }, log_dir)


PUSH_PREFILL_ENGINE_ID = "e2e-push-prefill-0"


def push_cluster(log_dir: str) -> Cluster:
    """1 prefill + 1 decode, tiny Llama, KV over NIXL push (NixlPushConnector: P WRITEs into D).

    The prefill's engine_id is pinned: the proxy dispatches decode before prefill answers, so it
    must know P's NIXL identity (engine id, side channel, TP/PP sizes) up front.
    """
    return Cluster("push", {
        "prefill": Vllm("push-prefill", "tiny-model", 0, engine_id=PUSH_PREFILL_ENGINE_ID,
                        args=["--kv-transfer-config",
                              nixl_config("kv_producer", "NixlPushConnector", PUSH_PREFILL_ENGINE_ID)]),
        "decode": Vllm("push-decode", "tiny-model", 1,
                       args=["--kv-transfer-config", nixl_config("kv_consumer", "NixlPushConnector")]),
    }, log_dir)


def epd_cluster(log_dir: str) -> Cluster:
    """Tiny BLIP-2: E (EC producer), P (EC consumer + NIXL KV producer), D (NIXL KV consumer).

    P doubles as the PD instance for E+PD: NIXL does not enforce kv_role, so a request without
    kv_transfer_params is served start to finish there, with the encoder output from E.
    """
    ec_dir = tempfile.mkdtemp(prefix="epd-e2e-ec-")
    mm: list[str] = []  # BLIP-2 takes at most one image per prompt anyway
    return Cluster("epd", {
        "encode": Vllm("epd-encode", "tiny-blip2", 0,
                       args=[*mm, "--no-enable-prefix-caching",
                             "--ec-transfer-config", ec_config("ec_producer", ec_dir)]),
        # DEBUG: the only evidence that the consumer loaded the encoder output is its log line
        # "Success load encoder cache for hash <mm_hash>".
        "prefill": Vllm("epd-prefill", "tiny-blip2", 1, debug=True,
                        args=[*mm, "--ec-transfer-config", ec_config("ec_consumer", ec_dir),
                              "--kv-transfer-config", nixl_config("kv_producer")]),
        "decode": Vllm("epd-decode", "tiny-blip2", 0,
                       args=[*mm, "--kv-transfer-config", nixl_config("kv_consumer")]),
    }, log_dir, ec_dir=ec_dir)


def models_cluster(log_dir: str) -> Cluster:
    """2 plain instances (tiny Llama, no KV transfer), each serving its own model name."""
    return Cluster("models", {
        "alpha": Vllm("models-alpha", "tiny-model", 0, args=["--served-model-name", "alpha"]),
        "beta": Vllm("models-beta", "tiny-model", 1, args=["--served-model-name", "beta"]),
    }, log_dir)


def two_decodes_cluster(log_dir: str) -> Cluster:
    """2 plain instances (tiny Llama, no KV transfer) serving one model: two decodes to move a
    stream between (test_stream_migration.py); ``/inference/v1/generate`` on both."""
    return Cluster("two", {
        "decode": Vllm("two-a", "tiny-model", 0, max_model_len=2048, args=["--enable-scale-out"]),
        "decode_b": Vllm("two-b", "tiny-model", 1, max_model_len=2048, args=["--enable-scale-out"]),
    }, log_dir)


LORAS = os.path.join(MODELS, "tiny-loras")  # lora-a, lora-b, lora-c (e2e/make_tiny_loras.py)


def lora_args(*static: str) -> list[str]:
    """vLLM's LoRA flags for the tiny adapters, with ``static`` ones loaded at start."""
    args = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    for name in static:
        args += ["--lora-modules", f"{name}={os.path.join(LORAS, name)}"]
    return args


def lora_cluster(log_dir: str) -> Cluster:
    """1 prefill + 1 decode (tiny Llama, NIXL pull), both with the static adapter lora-a and
    runtime LoRA updating on; each also serves whole requests (NIXL does not enforce kv_role),
    so they double as two plain instances."""
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    return Cluster("lora", {
        "prefill": Vllm("lora-prefill", "tiny-model", 0, env=env,
                        args=["--kv-transfer-config", nixl_config("kv_producer"), *lora_args("lora-a")]),
        "decode": Vllm("lora-decode", "tiny-model", 1, env=env,
                       args=["--kv-transfer-config", nixl_config("kv_consumer"), *lora_args("lora-a")]),
    }, log_dir)


# What the Messages, Responses and generate APIs need on an instance: the scale-out routes
# (/inference/v1/generate) and the Responses store (GET /v1/responses/{id}, previous_response_id).
API_ARGS = ["--enable-scale-out", "--enable-prompt-tokens-details"]
API_ENV = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}


def api_cluster(log_dir: str) -> Cluster:
    """1 prefill + 1 decode (tiny Llama, NIXL pull) and one plain instance of the same weights,
    all started as an operator serving every generation API would: the plain instance is the
    reference a client of one vLLM would see (its own Responses store included)."""
    return Cluster("api", {
        "prefill": Vllm("api-prefill", "tiny-model", 0, env=API_ENV, max_model_len=2048,
                        args=["--kv-transfer-config", nixl_config("kv_producer"), *API_ARGS]),
        "decode": Vllm("api-decode", "tiny-model", 1, env=API_ENV, max_model_len=2048,
                       args=["--kv-transfer-config", nixl_config("kv_consumer"), *API_ARGS]),
        "single": Vllm("api-single", "tiny-model", 0, env=API_ENV, max_model_len=2048, args=list(API_ARGS)),
    }, log_dir)


def kv_events_cluster(log_dir: str) -> Cluster:
    """2 prefills + 1 decode, tiny Llama, NIXL pull, each publishing vLLM's KV cache events
    (block size 32: the CPU backend's smallest)."""
    events = ["--block-size", "32", "--enable-prompt-tokens-details"]
    return Cluster("kv", {
        "prefill": Vllm("kv-prefill-a", "tiny-model", 0, max_model_len=2048, kv_events=True,
                        args=["--kv-transfer-config", nixl_config("kv_producer"), *events]),
        "prefill_b": Vllm("kv-prefill-b", "tiny-model", 1, max_model_len=2048, kv_events=True,
                          args=["--kv-transfer-config", nixl_config("kv_producer"), *events]),
        "decode": Vllm("kv-decode", "tiny-model", 1, max_model_len=2048, kv_events=True,
                       args=["--kv-transfer-config", nixl_config("kv_consumer"), *events]),
    }, log_dir)


CLUSTERS: dict[str, Callable[[str], Cluster]] = {"pd": pd_cluster, "push": push_cluster,
                                                  "epd": epd_cluster, "models": models_cluster,
                                                  "mt": multiturn_cluster,
                                                  "lora": lora_cluster,
                                                  "api": api_cluster, "kv": kv_events_cluster,
                                                  "two": two_decodes_cluster}
CLUSTER_ORDER = ["pd", "push", "epd", "models", "mt", "lora", "api", "kv", "two"]


# ---------------------------------------------------------------------------------------------
# the proxy


def proxy_available() -> tuple[bool, str]:
    try:
        r = subprocess.run([sys.executable, "-m", "epd_proxy", "serve", "--help"], cwd=REPO,
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, repr(e)
    out = (r.stdout + r.stderr).decode("utf-8", "replace")
    if r.returncode != 0:
        return False, f"`{sys.executable} -m epd_proxy serve --help` exited {r.returncode}: {out[-800:]}"
    return True, out


@dataclass
class Proxy:
    proc: Proc
    port: int
    argv: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.stop()


def start_proxy(name: str, log_dir: str, *, encode: Iterable[str] = (), prefill: Iterable[str] = (),
                decode: Iterable[str], kv_connector: str = "nixl", extra: Iterable[str] = ()) -> Proxy:
    """`epd-proxy serve` exactly as a user would start it, on a free loopback port.

    `kv_connector` ("nixl" pull or "nixl-push") is passed only when there are prefill instances."""
    port = free_port()
    encode, prefill, decode = list(encode), list(prefill), list(decode)
    argv = [sys.executable, "-m", "epd_proxy", "serve", "--host", "127.0.0.1", "--port", str(port)]
    for flag, urls in (("--encode", encode), ("--prefill", prefill), ("--decode", decode)):
        for u in urls:
            argv += [flag, u]
    if prefill:
        argv += ["--kv-connector", kv_connector]
    # No grace period at shutdown: nothing balances load over these proxies (each stop would
    # otherwise wait --shutdown-grace for load balancers to notice /ready).
    argv += ["--log-level", "info", "--shutdown-grace", "0", *extra]  # `extra` may override these
    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = Proc(f"proxy-{name}", argv, env, log_dir, cwd=REPO)
    p = Proxy(proc, port, argv)
    try:
        wait_http_ok(proc, p.url, PROXY_START_TIMEOUT)
    except BaseException:
        proc.stop()
        raise
    return p


# ---------------------------------------------------------------------------------------------
# HTTP


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed: float

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    def events(self) -> list[Any]:
        """SSE `data:` payloads in order: parsed JSON objects, or the string "[DONE]"."""
        out: list[Any] = []
        text = self.body.decode("utf-8")
        for block in text.replace("\r\n", "\n").split("\n\n"):
            data = [ln[5:].lstrip(" ") for ln in block.split("\n") if ln.startswith("data:")]
            if not data:
                continue
            payload = "\n".join(data)
            out.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
        return out


def _conn(base: str, timeout: float) -> http.client.HTTPConnection:
    u = urllib.parse.urlsplit(base)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)


def request(base: str, method: str, path: str, body: Any = None, headers: dict | None = None,
            timeout: float = REQUEST_TIMEOUT) -> Response:
    h = {"Connection": "close"}
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h["Content-Type"] = "application/json"
    h.update(headers or {})
    t0 = time.monotonic()
    c = _conn(base, timeout)
    try:
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        raw = r.read()
        return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, raw,
                        time.monotonic() - t0)
    finally:
        c.close()


def post(base: str, path: str, body: Any, **kw: Any) -> Response:
    return request(base, "POST", path, body, **kw)


def endpoint_path(endpoint: str) -> str:
    return {"chat": "/v1/chat/completions", "completions": "/v1/completions"}[endpoint]


def text_of(resp: Response, endpoint: str) -> str:
    """The generated text of a 200 response, streamed or not."""
    if resp.content_type.startswith("text/event-stream"):
        parts = []
        for ev in resp.events():
            if ev == "[DONE]" or not ev.get("choices"):
                continue
            ch = ev["choices"][0]
            parts.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
        return "".join(parts)
    ch = resp.json()["choices"][0]
    return ch["text"] if endpoint == "completions" else ch["message"]["content"]


MESSAGES, RESPONSES, GENERATE = "/v1/messages", "/v1/responses", "/inference/v1/generate"


def named_events(resp: Response) -> list[tuple[str, Any]]:
    """(event name, payload) of a stream of named events (Messages, Responses)."""
    out = []
    for block in resp.body.decode().replace("\r\n", "\n").split("\n\n"):
        lines = block.split("\n")
        name = next((ln[6:].strip() for ln in lines if ln.startswith("event:")), "")
        data = "\n".join(ln[5:].lstrip() for ln in lines if ln.startswith("data:"))
        if data:
            out.append((name, json.loads(data)))
    return out


def api_text(path: str, resp: Response) -> str:
    """The generated text of a Messages or Responses answer, streamed or not."""
    if resp.content_type.startswith("text/event-stream"):
        events = named_events(resp)
        if path == MESSAGES:
            return "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
        return "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    body = resp.json()
    if path == MESSAGES:
        return "".join(b.get("text", "") for b in body["content"])
    return "".join(p.get("text", "") for item in body["output"] for p in item.get("content", []))


def assert_api_ok(resp: Response, stream: bool) -> None:
    """A 200 with the right content type; a named-event stream without an error event."""
    assert resp.status == 200, describe(resp, 2000)
    want = "text/event-stream" if stream else "application/json"
    assert resp.content_type.startswith(want), describe(resp)
    if stream:
        names = [n for n, _ in named_events(resp)]
        assert "error" not in names and "response.failed" not in names, describe(resp, 4000)


def describe(resp: Response, limit: int = 600) -> str:
    return (f"HTTP {resp.status} {resp.content_type} after {resp.elapsed:.2f}s: "
            f"{resp.body[:limit].decode('utf-8', 'replace')}")


def reference(cluster: "Cluster", endpoint: str, body: dict) -> Response:
    """The same request answered by the cluster's decode instance alone, not streamed."""
    ref = post(cluster.decode.url, endpoint_path(endpoint), dict(body, stream=False))
    assert ref.status == 200, describe(ref)
    return ref


def assert_ok(resp: Response, stream: bool) -> None:
    """A 200 with the right content type; a stream ends in [DONE] with no in-band error."""
    assert resp.status == 200, describe(resp)
    if stream:
        assert resp.content_type.startswith("text/event-stream"), describe(resp)
        events = resp.events()
        assert events and events[-1] == "[DONE]", describe(resp)
        errors = [ev for ev in events if isinstance(ev, dict) and "error" in ev]
        assert not errors, f"in-band error in the stream: {errors}"
    else:
        assert resp.content_type.startswith("application/json"), describe(resp)


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """Keep-alive request handler that keeps pytest's output clean."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass


class Interposer:
    """A threaded HTTP server on a free loopback port, standing in front of a real
    instance to inject a fault. Subclasses set their state, then pass their handler."""

    def __init__(self, upstream: str, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------------------------
# request bodies


def unique_prompt(words: int = 24) -> str:
    """A prompt no earlier request shared a prefix with (keeps prefix caches out of the way)."""
    tag = uuid.uuid4().hex[:10]
    base = "The quick brown fox jumps over the lazy dog and runs far away".split()
    rnd = random.Random(tag)
    return f"Note {tag}: " + " ".join(rnd.choice(base) for _ in range(words))


def text_body(endpoint: str, prompt: str, *, max_tokens: int = 16, stream: bool = False,
              **extra: Any) -> dict:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": stream}
    if endpoint == "completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    body.update(extra)
    return body


def png_data_url(rgb: tuple[int, int, int], size: tuple[int, int] = (64, 48), *, noise: int | None = None) -> str:
    """A solid-colour PNG as a data: URL, built with the stdlib (the test venv has no PIL).

    With ``noise`` (a seed) the pixels are random instead: the PNG barely compresses,
    so the URL is as large as the pixels (about 4/3 x 3 bytes per pixel)."""
    w, h = size
    if noise is None:
        raw = b"".join(b"\x00" + bytes(rgb) * w for _ in range(h))
    else:
        rnd = random.Random(noise)
        raw = b"".join(b"\x00" + rnd.randbytes(3 * w) for _ in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def unique_color() -> tuple[int, int, int]:
    return tuple(random.randrange(256) for _ in range(3))  # type: ignore[return-value]


def image_chat_body(url: str, *, text: str = "What is in this image?", max_tokens: int = 8,
                    stream: bool = False, **extra: Any) -> dict:
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text}]}]}
    body.update(extra)
    return body


# ---------------------------------------------------------------------------------------------
# metrics


@dataclass
class Metrics:
    samples: list[tuple[str, dict[str, str], float]]

    @classmethod
    def scrape(cls, base: str) -> "Metrics":
        r = request(base, "GET", "/metrics", timeout=30)
        assert r.status == 200, describe(r)
        out = []
        for line in r.body.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            name, _, lab = key.partition("{")
            labels: dict[str, str] = {}
            for part in lab.rstrip("}").split('",'):
                if "=" in part:
                    k, _, v = part.partition("=")
                    labels[k.strip()] = v.strip().strip('"')
            try:
                out.append((name, labels, float(value)))
            except ValueError:
                continue
        return cls(out)

    def get(self, name: str, **labels: str) -> float:
        return sum(v for n, lab, v in self.samples
                   if n == name and all(lab.get(k) == x for k, x in labels.items()))

    def has(self, name: str) -> bool:
        return any(n == name for n, _, _ in self.samples)


def wait_for(pred: Callable[[], Any], timeout: float, interval: float = 0.25) -> Any:
    """Poll until pred() is truthy; returns its last value (falsy on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


def delta(inst: "Vllm", name: str, before: "Metrics", expected: float, timeout: float = 10,
          **labels: str) -> float:
    """How much counter `name` grew since `before`, once it reached `expected` (metrics are
    published asynchronously by the engine's stats loop), re-read a moment later so that an
    overshoot is seen too. Returns the growth actually observed (compare it to `expected`)."""
    base = before.get(name, **labels)
    E_ = lambda: inst.metrics().get(name, **labels) - base  # noqa: E731
    wait_for(lambda: E_() >= expected, timeout)
    time.sleep(0.3)
    return E_()


NIXL_XFERS = "vllm:nixl_bytes_transferred_count"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
EXT_HITS = "vllm:external_prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"
