"""A real ``epd-proxy serve`` child process, for tests of what only a process has
(signals, ``--workers``, the cluster file on disk)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile

from helpers import Client
from procs import free_port


class ProxyProcess:
    """``async with ProxyProcess([...serve flags])``: started, answering /health; stopped
    with SIGTERM on exit. Its log (stderr) is in ``log()``."""

    def __init__(self, args: list[str], *, timeout: float = 20.0) -> None:
        self.args = args
        self.timeout = timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: asyncio.subprocess.Process | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="epd-proxy-", suffix=".log", delete=False)

    def log(self) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()

    async def fresh_get(self, path: str, headers=None):
        """Over a new connection (with --workers, the kernel picks the worker per connection)."""
        client = Client(self.url)
        try:
            return await client.request("GET", path, headers=headers, timeout=5)
        finally:
            await client.close()

    async def __aenter__(self) -> "ProxyProcess":
        env = dict(os.environ)
        src = os.path.join(os.path.dirname(__file__), "..", "src")
        env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH", "")] if p)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "epd_proxy", "serve", "--port", str(self.port), "--shutdown-grace", "0",
            *self.args, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=self._log, start_new_session=True)
        loop = asyncio.get_running_loop()
        end = loop.time() + self.timeout
        while True:
            try:
                if (await self.fresh_get("/health")).status == 200:
                    return self
            except Exception:
                pass
            if self.proc.returncode is not None or loop.time() > end:
                await self.__aexit__()
                raise AssertionError(f"the proxy did not start:\n{self.log()}")
            await asyncio.sleep(0.05)

    async def wait_log(self, text: str, count: int = 1, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.log().count(text) < count:
            assert loop.time() < end, f"{text!r} x{count} not logged:\n{self.log()}"
            await asyncio.sleep(0.02)

    async def __aexit__(self, *exc) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except asyncio.TimeoutError:  # pragma: no cover
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()
        self._log.close()
        os.unlink(self._log.name)
