"""Processes under test: start, pin, measure (CPU and memory from ``/proc``), stop.

CPU is ``utime + stime`` from ``/proc/<pid>/stat`` summed over a process and
all its live descendants (a proxy with ``--workers``, nginx's master and
worker, ...). Its resolution is one clock tick (10 ms at USER_HZ=100), so
measurement windows are kept long enough for that to be well under 1 %.
"""

from __future__ import annotations

import http.client
import math
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable, Sequence

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    comm: str
    state: str
    ppid: int
    utime: int  # clock ticks
    stime: int
    num_threads: int
    rss_pages: int

    @property
    def cpu_ticks(self) -> int:
        return self.utime + self.stime


def parse_proc_stat(text: str) -> ProcStat:
    """Parse one ``/proc/<pid>/stat`` line. ``comm`` may hold spaces and
    parentheses, so the fields are counted from the *last* ``)``."""
    open_ = text.index("(")
    close = text.rindex(")")
    pid = int(text[:open_].strip())
    comm = text[open_ + 1:close]
    rest = text[close + 1:].split()
    # rest[0] is field 3 (state); field N is rest[N - 3].
    return ProcStat(pid=pid, comm=comm, state=rest[0], ppid=int(rest[1]), utime=int(rest[11]),
                    stime=int(rest[12]), num_threads=int(rest[17]), rss_pages=int(rest[21]))


def read_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat", "r", encoding="latin-1") as f:
            return parse_proc_stat(f.read())
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None


def all_stats() -> dict[int, ProcStat]:
    out: dict[int, ProcStat] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = read_stat(int(name))
            if st is not None:
                out[st.pid] = st
    return out


def tree_pids(root: int, stats: dict[int, ProcStat] | None = None) -> list[int]:
    """``root`` and all its live descendants."""
    stats = stats if stats is not None else all_stats()
    children: dict[int, list[int]] = {}
    for st in stats.values():
        children.setdefault(st.ppid, []).append(st.pid)
    out: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid not in stats:
            continue
        out.append(pid)
        stack.extend(children.get(pid, ()))
    return out


def tree_cpu_seconds(roots: int | Iterable[int]) -> float:
    """CPU seconds (user + system) used so far by the process trees under ``roots``."""
    if isinstance(roots, int):
        roots = (roots,)
    stats = all_stats()
    seen: set[int] = set()
    ticks = 0
    for root in roots:
        for pid in tree_pids(root, stats):
            if pid not in seen:
                seen.add(pid)
                ticks += stats[pid].cpu_ticks
    return ticks / CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (``VmRSS``), 0 if gone."""
    try:
        with open(f"/proc/{pid}/status", "r", encoding="latin-1") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def tree_rss_bytes(root: int) -> int:
    return sum(rss_bytes(pid) for pid in tree_pids(root))


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have used (``/proc/stat``: every state but
    idle and iowait, summed over cores)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return float("nan")
    vals = [int(x) for x in fields[:8]]
    return (sum(vals) - vals[3] - vals[4]) / CLK_TCK


def steal_ticks() -> int:
    """Time the hypervisor ran something else while this machine's cores wanted to run
    (``/proc/stat`` "steal", all cores, in clock ticks); 0 on bare metal."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return 0
    return int(fields[8]) if len(fields) > 8 else 0


def self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def available_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def pin(pid: int, cpus: Sequence[int] | None, *, threads: bool = True) -> None:
    """Pin a process (and, by default, all its threads) to ``cpus``."""
    if not cpus:
        return
    targets = [pid]
    if threads:
        try:
            targets = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except FileNotFoundError:
            return
    for tid in targets:
        try:
            os.sched_setaffinity(tid, set(cpus))
        except (ProcessLookupError, OSError):
            pass


def pin_tree(root: int, cpus: Sequence[int] | None) -> None:
    for pid in tree_pids(root):
        pin(pid, cpus)


def set_sched_idle(pid: int = 0) -> bool:
    """Lowest CPU priority (``SCHED_IDLE``): runs only on time no normal task wants."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        return True
    except (AttributeError, OSError):
        return False


def set_sched_normal(pid: int = 0) -> None:
    try:
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def raise_nofile(want: int) -> int:
    """Raise the soft open-files limit towards ``want`` (up to the hard limit); returns it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def nofile_limits() -> tuple[int, int]:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)


def http_get_status(url: str, path: str = "/health", timeout: float = 1.0) -> int | None:
    """Status of a GET (None when the server does not answer)."""
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)  # type: ignore[arg-type]  # has a host
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


class Service:
    """A process under test or a helper (simulator), started in its own session so
    that it and its children can be stopped together, by its id."""

    def __init__(self, name: str, argv: list[str], *, cpus: Sequence[int] | None = None,
                 log_path: str | None = None, env: dict | None = None, url: str | None = None,
                 ready_path: str = "/health", cwd: str | None = None, sched_idle: bool = False) -> None:
        self.name = name
        self.argv = argv
        self.cpus = list(cpus) if cpus else None
        self.log_path = log_path
        self.env = env
        self.url = url
        self.ready_path = ready_path
        self.cwd = cwd
        self.sched_idle = sched_idle
        self.proc: subprocess.Popen | None = None
        self._log: BinaryIO | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, *, pipe_stdout: bool = False) -> "Service":
        """Start the process (stdout to a pipe when ``pipe_stdout``, else to the log)."""
        cpus = self.cpus
        idle = self.sched_idle

        def child_setup() -> None:  # runs in the child before exec
            if cpus:
                os.sched_setaffinity(0, set(cpus))
            if idle:
                set_sched_idle(0)

        self._log = open(self.log_path, "ab") if self.log_path else None
        sink = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE if pipe_stdout else sink,
                                     stderr=sink if pipe_stdout else subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                     preexec_fn=child_setup, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 60.0, *, path: str | None = None) -> None:
        """Until ``GET <url><ready_path>`` answers 200; raises if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        path = path or self.ready_path
        while True:
            if not self.alive():
                assert self.proc is not None  # started
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}; "
                                   f"see {self.log_path or 'its output'}: {self.tail_log()}")
            if self.url and http_get_status(self.url, path, timeout=1.0) == 200:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready at {self.url}{path} after {timeout:g} s: "
                                   f"{self.tail_log()}")
            time.sleep(0.1)

    def tail_log(self, n: int = 800) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            data = f.read()
        return data[-n:].decode("utf-8", "replace").strip()

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid) if self.alive() else 0.0

    def rss_bytes(self) -> int:
        return tree_rss_bytes(self.pid) if self.alive() else 0

    def pids(self) -> list[int]:
        return tree_pids(self.pid) if self.alive() else []

    def repin(self) -> None:
        """Pin every process and thread of the tree (threads created after start
        inherit the affinity anyway; this catches anything that reset it)."""
        if self.cpus and self.alive():
            pin_tree(self.pid, self.cpus)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the process group this service leads, then SIGKILL."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
        else:
            # The leader is gone; its group may still hold children.
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not None:
            self._log.close()
            self._log = None


@contextmanager
def _peer(x, y, our_core: int, peer_core: int, serve: Callable):
    """A forked process pinned to ``peer_core`` running ``serve(y)`` while this one,
    pinned to ``our_core``, uses ``x``; afterwards ``x`` is closed, the peer reaped
    and this process's affinity restored."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.sched_setaffinity(0, {peer_core})
            x.close()
            serve(y)
        finally:
            os._exit(0)
    y.close()
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {our_core})
    try:
        yield x
    finally:
        x.close()
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, old)


def _echo(sock) -> None:
    while sock.recv(1):
        sock.send(b"x")


def _drain(sock) -> None:
    while sock.recv(65536):
        pass


def cross_core_rtt(a: int | None, b: int | None, n: int = 2000) -> dict:
    """Median round trip (µs) of one byte over a socket pair between two processes,
    on the same core and across ``a``/``b``: the price of a wake-up on this machine."""
    import socket

    from epd_proxy.bench.stats import summarize

    def one(ca: int, cb: int) -> float:
        times = []
        with _peer(*socket.socketpair(), ca, cb, _echo) as x:
            for i in range(n):
                t0 = time.perf_counter()
                x.send(b"x")
                x.recv(1)
                times.append(time.perf_counter() - t0)
                if i % 8 == 0:
                    time.sleep(0.0005)  # let the cores idle, as between stages
        return summarize(times, 1e6)["p50"]

    if a is None or b is None or a == b:
        return {}
    return {"same_core_us": one(b, b), "cross_core_us": one(a, b)}


def wake_write_cost(a: int | None, b: int | None, n: int = 400) -> dict:
    """Median time (µs) of one small ``send()`` from core ``a`` to a process on core ``b``
    that sleeps in ``recv`` (the write pays for waking it) and that is kept busy.

    Waking a process on another core sends that core an interrupt; on a VM this can be
    far dearer than on bare metal, and it is charged to the writer. It is why a proxy's
    CPU per request depends on whether its peers were asleep (spread-out arrivals) or
    busy (bursts)."""
    import socket

    from epd_proxy.bench.stats import summarize

    if a is None or b is None or a == b:
        return {}
    with socket.create_server(("127.0.0.1", 0)) as ls:  # loopback TCP, as the proxy's peers
        x = socket.create_connection(ls.getsockname())
        y, _ = ls.accept()
    x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = b"x" * 200
    asleep, awake = [], []
    with _peer(x, y, a, b, _drain):
        for _ in range(n):
            time.sleep(0.001)  # the receiver drains and goes back to sleep
            t0 = time.perf_counter()
            x.send(data)
            asleep.append(time.perf_counter() - t0)
        for _ in range(n):
            t0 = time.perf_counter()
            x.send(data)
            awake.append(time.perf_counter() - t0)
    return {"asleep_us": summarize(asleep, 1e6)["p50"], "awake_us": summarize(awake, 1e6)["p50"]}


def voluntary_switches(pid: int) -> float:
    """How many times ``pid`` has blocked (``voluntary_ctxt_switches``, summed over its
    threads): a process that is the bottleneck never runs out of work, so this stays
    flat; one that waits for its load keeps blocking."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return math.nan
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return float(total)
