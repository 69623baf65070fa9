"""A real redis-server for the shared counters' tests: started on a free loopback port per
test module, no persistence; the tests that need it are skipped when it is not installed
(scripts/ensure-system-packages.sh installs it where it can)."""

import shutil
import socket
import subprocess
import time

import pytest
from procs import free_port


class RedisServer:
    def __init__(self, tmp) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/ensure-system-packages.sh installs it)")
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()
