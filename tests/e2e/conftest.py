"""Fixtures for the end-to-end suite against real vLLM instances (``make e2e``; see
docs/real-vllm.md).

Layout: every test module names the vLLM cluster it needs in a module-level ``CLUSTER``
("pd", "push" or "epd", see ``vllm_e2e.CLUSTERS``). Tests are reordered so that all tests of
one cluster run together, and at most one cluster (at most three vLLM instances) runs at a time
on the 2-core machine: switching clusters stops the previous one first. Everything is stopped by PID
at the end of the session, and at interpreter exit as a last resort.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_e2e as E  # noqa: E402


def _sigterm(signum, frame):  # pragma: no cover - only on an outside kill
    # Turn SIGTERM (CI timeout, `kill`) into KeyboardInterrupt so fixtures' finalizers run
    # and every vLLM process is stopped.
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_collection_modifyitems(session, config, items):
    """Group this suite's tests by cluster (pd, then push, then epd), then by the module's ORDER.

    Only the positions held by tests of this directory are reordered; others stay put."""
    def cluster(item):
        return getattr(getattr(item, "module", None), "CLUSTER", None)

    slots = [i for i, it in enumerate(items) if cluster(it) in E.CLUSTER_ORDER]
    ours = sorted((items[i] for i in slots),  # stable: file order inside each module
                  key=lambda it: (E.CLUSTER_ORDER.index(cluster(it)),
                                  getattr(it.module, "ORDER", 50)))
    for i, it in zip(slots, ours):
        items[i] = it


@pytest.fixture(scope="session")
def e2e_log_dir():
    d = os.environ.get("EPD_E2E_LOG_DIR") or tempfile.mkdtemp(prefix="epd-e2e-logs-")
    os.makedirs(d, exist_ok=True)
    print(f"\n[e2e] logs in {d}", file=sys.stderr)
    return d


@pytest.fixture(scope="session")
def vllm_env_ready():
    vllm = os.path.join(E.VENV, "bin", "vllm")
    missing = [p for p in (vllm, os.path.join(E.MODELS, "tiny-model", "config.json"),
                           os.path.join(E.MODELS, "tiny-blip2", "config.json"))
               if not os.path.exists(p)]
    if missing:
        msg = (f"real-vLLM environment not found ({', '.join(missing)}); "
               "run `bash e2e/setup_vllm.sh` (or `make e2e`)")
        if E.STRICT_VLLM:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


class ClusterManager:
    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.current: E.Cluster | None = None
        self.failed: dict[str, str] = {}

    def get(self, name: str) -> E.Cluster:
        """The named cluster, running and ready (started now if it is not the current one)."""
        cluster = self.launch(name, fresh=False)
        try:
            cluster.wait_ready()
        except RuntimeError as e:
            self.current = None
            self.failed[name] = str(e)
            pytest.fail(f"cluster {name} failed to start: {e}", pytrace=False)
        return cluster

    def launch(self, name: str, *, fresh: bool = True) -> E.Cluster:
        """The named cluster's processes, started without waiting for them to be ready
        (``fresh``: restarted even if it is the current one)."""
        if name in self.failed:
            pytest.fail(f"cluster {name} failed to start earlier: {self.failed[name]}", pytrace=False)
        if not fresh and self.current is not None and self.current.name == name:
            return self.current
        self.stop()
        cluster = E.CLUSTERS[name](self.log_dir)
        try:
            cluster.launch()
        except (RuntimeError, OSError) as e:
            self.failed[name] = str(e)
            pytest.fail(f"cluster {name} failed to start: {e}", pytrace=False)
        self.current = cluster
        return cluster

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="session")
def clusters(e2e_log_dir, vllm_env_ready):
    previous = signal.signal(signal.SIGTERM, _sigterm)
    mgr = ClusterManager(e2e_log_dir)
    try:
        yield mgr
    finally:
        mgr.stop()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def pd(clusters):
    """1 prefill + 1 decode (tiny Llama, NIXL pull); shared by the module's tests."""
    return clusters.get("pd")


@pytest.fixture(scope="module")
def api(clusters):
    """1 prefill + 1 decode (NIXL pull) + 1 plain reference instance, each with the scale-out
    routes and the Responses store on; shared by the module's tests."""
    return clusters.get("api")


@pytest.fixture(scope="module")
def push(clusters):
    """1 prefill + 1 decode (tiny Llama, NixlPushConnector); shared by the module's tests."""
    return clusters.get("push")


@pytest.fixture(scope="module")
def epd(clusters):
    """E + P + D (tiny BLIP-2, EC example connector + NIXL); shared by the module's tests."""
    return clusters.get("epd")


@pytest.fixture(scope="module")
def models(clusters):
    """2 plain instances serving the model names alpha and beta; shared by the module's tests."""
    return clusters.get("models")


@pytest.fixture(scope="module")
def mt(clusters):
    """P + D with bidirectional KV transfer (test_pd_multiturn.py)."""
    return clusters.get("mt")


@pytest.fixture(scope="module")
def lora(clusters):
    """1 prefill + 1 decode (tiny Llama, NIXL pull) with LoRA adapters; shared by the module's tests."""
    return clusters.get("lora")


@pytest.fixture(scope="module")
def kv(clusters):
    return clusters.get("kv")


@pytest.fixture(scope="module")
def two(clusters):
    """2 plain instances (tiny Llama) serving one model: the decodes a stream moves between."""
    return clusters.get("two")


@pytest.fixture(scope="session")
def proxy_ready():
    ok, detail = E.proxy_available()
    if not ok:
        msg = f"epd-proxy is not runnable yet: {detail}"
        if E.STRICT_PROXY:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def start_proxy(proxy_ready, e2e_log_dir):
    """Factory: start `epd-proxy serve` with the given role URLs; stopped at module end."""
    started: list[E.Proxy] = []

    def _start(name: str, **kw) -> E.Proxy:
        p = E.start_proxy(name, e2e_log_dir, **kw)
        started.append(p)
        print(f"\n[e2e] proxy {name} at {p.url}: {' '.join(p.argv[3:])}", file=sys.stderr)
        return p

    yield _start
    for p in started:
        p.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure, attach the tails of the running processes' logs to the report."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed:
        for proc in list(E._LIVE.values()):
            rep.sections.append((f"log tail: {proc.name} ({proc.log_path})", proc.tail(40)))
