"""``--workers N``: the parent process, and the channel workers share membership over.

The parent forks the workers (each binds the port with ``SO_REUSEPORT``) and
then only supervises: SIGINT/SIGTERM go to every worker as SIGTERM (a graceful
shutdown; a second one as SIGQUIT: at once); SIGHUP — the one
reload path — goes to every worker too, and so does a change to the cluster
file, which the parent watches so that the workers do not each poll it.

Membership is shared through the parent: each worker holds one end of a
``SOCK_SEQPACKET`` socket pair made before the fork, and sends each roster
change made through it (registration, removal, drain) as one message; the
parent passes every message on to all the other workers, which apply it to
their own roster. Messages are whole records (the socket keeps their
boundaries), in the order each worker sent them. No file, no lock, no
polling: a change reaches the other workers within one event-loop turn of
the parent's ``select``. Health stays per worker (each probes for itself).
"""

from __future__ import annotations

import asyncio
import logging
import os
import selectors
import signal
import socket
from typing import Callable

import msgspec

from epd_proxy.runtime.reload import WATCH_INTERVAL, FileWatch

log = logging.getLogger("epd_proxy.workers")

# Largest roster message: a registration record is well under 1 KiB.
MAX_MESSAGE = 64 * 1024


class PeerLink:
    """A worker's end of the membership channel: ``send`` a change to the other
    workers; ``on_message`` is called with each change one of them made."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.on_message: Callable[[dict], None] | None = None
        self.sent = 0
        self.received = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, on_message: Callable[[dict], None]) -> None:
        self.on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.fileno(), self._readable)

    def send(self, message: dict) -> None:
        data = msgspec.json.encode(message)
        try:
            self.sock.send(data)
            self.sent += 1
        except BlockingIOError:
            # The parent is not reading (it is stopping): the others stop too.
            log.warning("membership channel full: change not shared with the other workers")
        except OSError as exc:
            log.warning("membership channel closed: change not shared with the other workers (%s)", exc)

    def _readable(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:  # the parent is gone
                self.close()
                return
            self.received += 1
            try:
                message = msgspec.json.decode(data)
                if self.on_message is not None:
                    self.on_message(message)
            except Exception:
                log.exception("applying a roster change from another worker")

    def close(self) -> None:
        if self._loop is not None:
            try:
                self._loop.remove_reader(self.sock.fileno())
            except (ValueError, OSError):
                pass
            self._loop = None
        self.sock.close()


def make_links(workers: int) -> list[tuple[socket.socket, socket.socket]]:
    """(parent end, worker end) per worker, made before the fork."""
    return [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(workers)]


def supervise(children: list[int], parent_ends: list[socket.socket], watch_path: str | None, *,
              reload_now: bool = False) -> int:
    """The parent's loop until every worker has exited: relay roster changes, pass
    signals on, watch the cluster file. ``reload_now``: a SIGHUP came while forking.
    Returns the exit status."""
    sel = selectors.DefaultSelector()
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    sel.register(wake_r, selectors.EVENT_READ, None)
    ends = dict(zip(parent_ends, children))
    for end in parent_ends:
        end.setblocking(False)
        sel.register(end, selectors.EVENT_READ, end)
    alive = set(children)
    watch = FileWatch(watch_path) if watch_path else None
    status = 0

    def tell(sig: int) -> None:
        for child in alive:
            try:
                os.kill(child, sig)
            except ProcessLookupError:
                pass

    received = []

    def on_signal(signum, _frame):
        if signum in (signal.SIGINT, signal.SIGTERM):
            # A graceful shutdown; a second signal: at once (the workers exit on SIGQUIT).
            received.append(signum)
            tell(signal.SIGTERM if len(received) == 1 else signal.SIGQUIT)
        elif signum == signal.SIGHUP:
            log.info("SIGHUP: reloading every worker")
            tell(signal.SIGHUP)
        # SIGCHLD: only wakes the loop (the wakeup fd) to reap.

    previous = {sig: signal.signal(sig, on_signal)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD)}
    old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    if reload_now:
        tell(signal.SIGHUP)
    try:
        while alive:
            for key, _ in sel.select(WATCH_INTERVAL if watch else None):
                if key.data is None:
                    try:
                        while wake_r.recv(512):
                            pass
                    except (BlockingIOError, InterruptedError):
                        pass
                    continue
                _relay(sel, key.data, ends)
            while alive:
                try:
                    pid, code = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    alive.clear()
                    break
                if pid == 0:
                    break
                alive.discard(pid)
                if code:
                    status = 1
            if watch is not None and watch.changed():
                log.info("%s changed: reloading every worker", watch.path)
                tell(signal.SIGHUP)
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sel.close()
        wake_r.close()
        wake_w.close()
        for end in parent_ends:
            end.close()
    return status


def _relay(sel: selectors.BaseSelector, source: socket.socket, ends: dict) -> None:
    """Every message from one worker to every other worker."""
    while True:
        try:
            data = source.recv(MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # that worker exited
            sel.unregister(source)
            return
        for end in ends:
            if end is source or end.fileno() < 0:
                continue
            try:
                end.send(data)
            except BlockingIOError:
                log.warning("worker %d is not reading roster changes: one dropped", ends[end])
            except OSError:
                pass
