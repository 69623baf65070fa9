"""A real DNS server for tests: dnsmasq on loopback, answering for names under
``.test`` from a hosts file.

``make test`` installs dnsmasq when it is missing (scripts/ensure-system-packages.sh);
where it cannot be installed, the tests that need it are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

DNSMASQ = shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if os.access("/usr/sbin/dnsmasq", os.X_OK) else None)


def _free_port() -> int:
    """A port free for UDP and TCP on loopback (dnsmasq binds both)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
        t.bind(("127.0.0.1", 0))
        port = t.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind(("127.0.0.1", port))
        return port


class Dnsmasq:
    """One dnsmasq process; ``set(name, [addresses])`` rewrites its hosts file and
    makes it re-read it (SIGHUP)."""

    def __init__(self, directory) -> None:
        self.hosts_path = os.path.join(directory, "hosts")
        self.records: dict[str, list[str]] = {}
        self._write()
        for attempt in range(5):  # another process may take the port meanwhile
            try:
                self._start()
                return
            except RuntimeError:
                self.close()
                if attempt == 4:
                    raise

    def _start(self) -> None:
        self.port = _free_port()
        args = [DNSMASQ, "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
                "--no-negcache", "--local=/test/", f"--addn-hosts={self.hosts_path}", "--listen-address=127.0.0.1",
                "--bind-interfaces", f"--port={self.port}", "--pid-file=", "--local-ttl=1",
                "--log-facility=-"]
        if os.geteuid() == 0:
            args.append("--user=root")  # so that it can re-read the test's private directory
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._wait_ready()

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, addresses: list[str]) -> None:
        self.records[name] = list(addresses)
        self._write()
        self.proc.send_signal(signal.SIGHUP)

    def _write(self) -> None:
        tmp = self.hosts_path + ".tmp"
        with open(tmp, "w") as f:
            for name, addrs in self.records.items():
                for addr in addrs:
                    f.write(f"{addr} {name}\n")
        os.replace(tmp, self.hosts_path)

    def _wait_ready(self) -> None:
        """Until it answers a query (any answer will do), or fail with its own words."""
        query = bytes.fromhex("abcd01000001000000000000") + b"\x05probe\x00\x00\x01\x00\x01"
        deadline = time.monotonic() + 10
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.1)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"dnsmasq exited: {self.proc.stderr.read().decode(errors='replace')}")
                s.sendto(query, ("127.0.0.1", self.port))
                try:
                    s.recvfrom(512)
                    return
                except OSError:
                    continue
        raise RuntimeError("dnsmasq did not answer within 10 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


@pytest.fixture
def dnsmasq(tmp_path):
    if DNSMASQ is None:
        pytest.skip("dnsmasq is not installed (make test installs it when run as root with apt-get)")
    server = Dnsmasq(str(tmp_path))
    try:
        yield server
    finally:
        server.close()
