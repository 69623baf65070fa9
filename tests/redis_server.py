"""A real Redis (or Valkey) server for tests, on a free loopback port.

``make test`` installs ``redis-server`` when it is missing (scripts/ensure-system-packages.sh);
where it cannot be installed, the tests that need it are skipped with the reason.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

SERVER = shutil.which("valkey-server") or shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One server process without persistence; ``stop`` and ``start`` again on the same port
    (the store lost and back, empty)."""

    def __init__(self, password: str | None = None) -> None:
        self.port = _free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode(errors='replace')}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not answer within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def close(self) -> None:
        self.stop()


@pytest.fixture
def redis_server():
    if SERVER is None:
        pytest.skip("redis-server (or valkey-server) is not installed (scripts/ensure-system-packages.sh installs it)")
    server = RedisServer()
    try:
        yield server
    finally:
        server.close()
