"""Profiling the proxy under load with py-spy, and reading its collapsed stacks.

``py-spy record --format raw`` writes one line per distinct stack,
``frame;frame;...;frame count`` (outermost first). Self time is the last
frame's, inclusive time counts a function once per stack it appears in.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def find_py_spy() -> str | None:
    path = shutil.which("py-spy")
    if path:
        return path
    cand = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return cand if os.access(cand, os.X_OK) else None


def frame_name(frame: str) -> str:
    """``handle (epd_proxy/request/pipeline.py:88)`` -> ``pipeline.py:handle``; native frames as they are."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    f = m.group("file")
    base = f.rsplit("/", 1)[-1] if f else ""
    return f"{base}:{m.group('func')}" if base else m.group("func")


def parse_collapsed(text: str) -> list[tuple[list[str], int]]:
    out = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        out.append(([frame_name(f) for f in stack.split(";") if f], n))
    return out


# Frames every stack of a running server shares: left out of the inclusive ranking.
_GENERIC = re.compile(r'^(process \d+:.*|<frozen runpy>:.*|__main__.py:<module>|runners.py:run|cli.py:main|'
                      r'serve_command.py:run|serve.py:serve|event_loop.py:run|serve.py:_serve_forever|'
                      r'base_events.py:run_until_complete|<module>|thread \(.*)$')
EVENT_LOOP = "event loop C code (uvloop: epoll, socket reads/writes, callbacks)"


def summarize_profile(stacks: list[tuple[list[str], int]], top: int = 20) -> dict:
    """Top functions by self and by inclusive samples, as shares of all samples."""
    total = sum(n for _, n in stacks)
    self_c: Counter = Counter()
    incl: Counter = Counter()
    for frames, n in stacks:
        if not frames:
            continue
        last = frames[-1]
        if last in ("runners.py:Runner.run", "base_events.py:run_forever"):
            last = EVENT_LOOP
        self_c[last] += n
        for f in set(frames):
            if not _GENERIC.match(f) and f != "runners.py:Runner.run":
                incl[f] += n
    def rows(c: Counter) -> list[dict]:
        return [{"function": f, "samples": k, "share": k / total if total else 0.0} for f, k in c.most_common(top)]
    return {"samples": total, "self": rows(self_c), "inclusive": rows(incl)}


class PySpy:
    """``py-spy record`` on a running process for a fixed time (non-blocking sampling)."""

    def __init__(self, pid: int, out_path: str, duration: float, rate: int = 1000, native: bool = False,
                 subprocesses: bool = True) -> None:
        self.pid = pid
        self.out_path = out_path
        self.duration = duration
        self.rate = rate
        self.native = native
        self.subprocesses = subprocesses
        self.proc: subprocess.Popen | None = None
        self.error: str | None = None

    def start(self) -> bool:
        exe = find_py_spy()
        if exe is None:
            self.error = "py-spy not installed"
            return False
        # Native (C) frames need the process paused per sample: fewer samples then.
        rate = min(self.rate, 200) if self.native else self.rate
        argv = [exe, "record", "--pid", str(self.pid), "--duration", str(max(1, int(round(self.duration)))),
                "--rate", str(rate), "--format", "raw", "--output", self.out_path, "--nolineno"]
        if not self.native:
            argv.append("--nonblocking")
        if self.subprocesses:
            argv.append("--subprocesses")
        if self.native:
            argv.append("--native")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL)
        return True

    def finish(self, timeout: float = 60.0) -> dict | None:
        if self.proc is None:
            return None
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not os.path.exists(self.out_path):
            self.error = (err or b"").decode("utf-8", "replace")[-500:] or "py-spy wrote nothing"
            return None
        with open(self.out_path) as f:
            return summarize_profile(parse_collapsed(f.read()))
