"""``--workers N``: the parent process, and the channel workers share membership over.

The parent forks the workers (each binds the port with ``SO_REUSEPORT``) and
then only supervises: SIGINT/SIGTERM go to every worker as SIGTERM (a graceful
shutdown; a second one as SIGQUIT: at once); SIGHUP — the one
reload path — goes to every worker too, and so does a change to the cluster
file, which the parent watches so that the workers do not each poll it.

A worker that dies is replaced in its slot, and said so in one line naming the
old and the new process and how the old one ended. The first death is replaced
at once; a slot whose workers keep dying within ``STABLE`` seconds of their
start waits ``BACKOFF_FIRST`` seconds, then twice as long each time, up to
``BACKOFF_CAP`` (``/status`` shows the restarts, the last exit and the wait). A
worker of the first generation that exits before it served (it could not
listen, say) is not replaced: every worker would fail alike.

Membership is shared through the parent: each worker holds one end of a
``SOCK_SEQPACKET`` socket pair made before its fork, and sends each roster
change made through it (registration, removal, drain) as one message; the
parent passes every message on to all the other workers, which apply it to
their own roster. Messages are whole records (the socket keeps their
boundaries), in the order each worker sent them. No file, no lock, no
polling: a change reaches the other workers within one event-loop turn of
the parent's ``select``. Health stays per worker (each probes for itself).
The parent keeps the last of these changes per instance, so a replacement
starts with the roster its siblings have (``Carry.roster``).

Counters survive a replacement: every counter snapshot that leaves a worker
(for a scrape, or every second: ``api/siblings.py``) is first sent to the parent (a
``M`` message), which keeps the latest per slot. A replacement starts from it
(``Carry.counters``), and a scrape that misses a worker asks the parent (``?``,
answered ``!``) for that slot's kept numbers; the parent reads everything
queued on every channel before it answers. So whatever a scrape has shown was
kept first, and no later scrape shows less. What a SIGKILL can lose is what
no scrape has seen: at most the last second of counting.

Without ``--state-store`` the parent is the workers' shared state store
(``state/parent.py``): a worker's call is one ``S`` datagram, answered at once
with one ``s`` datagram from the parent's ``MemoryTable``, so a conversation's
next turn on another worker finds what the first kept. The parent's table
outlives any worker: a worker killed mid-conversation loses nothing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import selectors
import signal
import socket
import time
from typing import Callable

import msgspec

from epd_proxy.runtime.reload import WATCH_INTERVAL, FileWatch
from epd_proxy.state.memory import MemoryTable
from epd_proxy.state.parent import answer as answer_store

log = logging.getLogger("epd_proxy.workers")

# Largest message: a roster record is well under 1 KiB; a counters snapshot grows with the
# instances (about 0.5 KiB each) and must fit the socket's send buffer.
MAX_MESSAGE = 1024 * 1024
# Crash-loop back-off: a worker that lived less than STABLE seconds makes its slot wait
# BACKOFF_FIRST, then twice as long each time, up to BACKOFF_CAP. The first death: at once.
STABLE = 60.0
BACKOFF_FIRST = 1.0
BACKOFF_CAP = 30.0
# How long a worker waits for the parent's answer (a scrape must not stall on it).
ASK_TIMEOUT = 2.0

# Message kinds by first byte: a roster change is a JSON object.
_ROSTER = b"{"
_COUNTERS = b"M"  # worker -> parent: this slot's counters (JSON families)
_UP = b"U"  # worker -> parent: serving
_ASK = b"?"  # worker -> parent: {"id", "slots"}
_ANSWER = b"!"  # parent -> worker: {"id", "workers", "kept"}
_STORE = b"S"  # worker -> parent: 8-byte call id, a state-store call (state/parent.py)
_STORED = b"s"  # parent -> worker: 8-byte call id, its answer


@dataclasses.dataclass
class Carry:
    """What a worker starts from (set in the parent's memory before the fork):
    its slot's kept counters, the roster changes made at run time, and whether it
    replaces one (it then reloads the cluster file, which may have changed since)."""
    counters: dict | None = None
    roster: list[bytes] = dataclasses.field(default_factory=list)
    replacement: bool = False


class PeerLink:
    """A worker's end of the channel to the parent: ``send`` a roster change to the other
    workers (``on_message`` gets each change one of them made); ``publish`` counters,
    ``ask`` for the supervisor's view."""

    def __init__(self, sock: socket.socket, backlog: list[bytes] | None = None) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.on_message: Callable[[dict], None] | None = None
        self.sent = 0
        self.received = 0
        self._backlog = list(backlog or ())  # changes made before this worker started
        self._loop: asyncio.AbstractEventLoop | None = None
        self._asks: dict[int, asyncio.Future] = {}
        self._calls: dict[bytes, asyncio.Future] = {}  # state-store calls awaiting the parent
        self._ids = itertools.count(1)
        self._warned = False

    def start(self, on_message: Callable[[dict], None]) -> None:
        self.on_message = on_message
        self._loop = asyncio.get_running_loop()
        backlog, self._backlog = self._backlog, []
        for data in backlog:
            self._deliver(data)
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

    def publish(self, counters: dict) -> None:
        """This slot's counters, kept by the parent (sent before any scrape shows them)."""
        self._control(_COUNTERS + msgspec.json.encode(counters))

    def serving(self) -> None:
        self._control(_UP)

    async def ask(self, slots: list[int]) -> dict | None:
        """The supervisor's view of the workers, and the kept counters of ``slots``."""
        if self._loop is None:
            return None
        n = next(self._ids)
        future = self._asks[n] = self._loop.create_future()
        try:
            if not self._control(_ASK + msgspec.json.encode({"id": n, "slots": slots})):
                return None
            return await asyncio.wait_for(future, ASK_TIMEOUT)
        except asyncio.TimeoutError:
            return None
        finally:
            self._asks.pop(n, None)

    async def store_call(self, request: bytes) -> bytes | None:
        """One state-store call answered by the parent (the caller bounds the wait; the answer
        is read once ``start`` has registered the channel with the loop)."""
        n = next(self._ids).to_bytes(8, "big")
        future = self._calls[n] = asyncio.get_running_loop().create_future()
        try:
            try:
                self.sock.send(_STORE + n + request)
            except OSError:
                return None
            return await future
        finally:
            self._calls.pop(n, None)

    def _control(self, data: bytes) -> bool:
        try:
            self.sock.send(data)
            return True
        except OSError as exc:  # full (the parent is stopping), closed, or too large
            if not self._warned:
                self._warned = True
                log.warning("channel to the parent: message not sent (%s)", exc)
            return False

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
            self._deliver(data)

    def _deliver(self, data: bytes) -> None:
        if data[:1] == _STORED:
            call = self._calls.get(data[1:9])
            if call is not None and not call.done():
                call.set_result(data[9:])
            return
        if data[:1] == _ANSWER:
            answer = msgspec.json.decode(data[1:])
            future = self._asks.get(answer.get("id"))
            if future is not None and not future.done():
                future.set_result(answer)
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


def describe_exit(code: int) -> str:
    """A ``waitpid`` status in words: ``killed by SIGKILL``, ``exited with status 1``."""
    if os.WIFSIGNALED(code):
        sig = os.WTERMSIG(code)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"
    return f"exited with status {os.waitstatus_to_exitcode(code)}"


def backoff(streak: int) -> float:
    """The wait before restarting a slot whose last ``streak`` workers died young."""
    if streak <= 0:
        return 0.0
    return min(BACKOFF_CAP, BACKOFF_FIRST * 2 ** (streak - 1))


class _Slot:
    """One worker's place: its process, channel, counters and restart history."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.pid: int | None = None
        self.end: socket.socket | None = None
        self.outbox: collections.deque[bytes] = collections.deque()
        self.started = 0.0  # monotonic
        self.up = False  # this worker said it serves
        self.ever_up = False
        self.generation = 0
        self.restarts = 0
        self.streak = 0  # workers in a row that died young
        self.last_exit: str | None = None
        self.restart_at: float | None = None  # monotonic, while backing off
        self.backoff_until: float | None = None  # wall clock, for /status
        self.kept: bytes | None = None  # the latest counters (JSON)
        self.old_pid: int | None = None  # the worker a restart replaces

    def view(self) -> dict:
        return {"index": self.index, "pid": self.pid, "alive": self.pid is not None, "serving": self.up,
                "restarts": self.restarts, "last_exit": self.last_exit, "backing_off_until": self.backoff_until}


def supervise(count: int, start: Callable[[int, socket.socket, Carry], None], watch_path: str | None, *,
              reload_now: bool = False) -> int:
    """Fork ``count`` workers (``start(index, channel, carry)`` runs in each and never
    returns), then the parent's loop until every worker has exited: replace the dead,
    relay roster changes, keep counters, pass signals on, watch the cluster file.
    ``reload_now``: a SIGHUP came before this. Returns the exit status."""
    return _Supervisor(count, start, watch_path).run(reload_now)


class _Supervisor:
    def __init__(self, count: int, start: Callable[[int, socket.socket, Carry], None],
                 watch_path: str | None) -> None:
        self.start = start
        self.slots = [_Slot(i) for i in range(count)]
        self.by_pid: dict[int, _Slot] = {}
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        self.watch = FileWatch(watch_path) if watch_path else None
        self.roster: dict[str, list[bytes]] = {}  # url -> its shared changes since it registered
        self.table = MemoryTable()  # the workers' shared state (state/parent.py)
        self.stopping = 0  # SIGINT/SIGTERM received
        self.status = 0
        self.previous: dict = {}
        self.old_wakeup = -1

    # -- processes ---------------------------------------------------------------------
    def spawn(self, slot: _Slot) -> None:
        parent_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        carry = Carry(counters=msgspec.json.decode(slot.kept) if slot.kept else None,
                      roster=[m for changes in self.roster.values() for m in changes],
                      replacement=slot.generation > 0)
        pid = os.fork()
        if pid == 0:
            parent_end.close()
            self._in_child()
            self.start(slot.index, worker_end, carry)
            os._exit(1)  # pragma: no cover - start never returns
        worker_end.close()
        parent_end.setblocking(False)
        slot.pid, slot.end, slot.started, slot.up = pid, parent_end, time.monotonic(), False
        slot.outbox.clear()
        slot.restart_at = slot.backoff_until = None
        self.by_pid[pid] = slot
        self.sel.register(parent_end, selectors.EVENT_READ, slot)

    def _in_child(self) -> None:
        """Drop what is the parent's: its channels, selector, signal handling."""
        signal.set_wakeup_fd(self.old_wakeup)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        for slot in self.slots:
            if slot.end is not None:
                slot.end.close()
        self.sel.close()
        self.wake_r.close()
        self.wake_w.close()

    def tell(self, sig: int) -> None:
        for slot in self.slots:
            if slot.pid is not None:
                try:
                    os.kill(slot.pid, sig)
                except ProcessLookupError:
                    pass

    def reap(self) -> None:
        while True:
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = self.by_pid.pop(pid, None)
            if slot is None:
                continue
            self.drain(slot)  # what it sent before it died: counters, roster changes
            if slot.end is not None:
                self.sel.unregister(slot.end)
                slot.end.close()
                slot.end = None
            lived = time.monotonic() - slot.started
            how = describe_exit(code)
            slot.old_pid = pid
            slot.pid, slot.last_exit = None, how
            was_up, slot.up = slot.up, False
            if self.stopping:
                if code:
                    self.status = 1
                continue
            if slot.generation == 0 and not was_up:
                self.status = 1
                log.error("worker %d (pid %d) %s before serving: not replaced", slot.index, pid, how)
                continue
            # The first death in a slot, or one after a stable run: at once; then backing off.
            slot.streak = slot.streak + 1 if slot.restarts and lived < STABLE else 0
            delay = backoff(slot.streak)
            slot.restarts += 1
            slot.generation += 1
            if delay == 0 and self.respawn(slot):
                log.error("worker %d (pid %d) %s; started pid %d", slot.index, pid, how, slot.pid)
            elif delay == 0:
                log.error("worker %d (pid %d) %s; not restarted yet", slot.index, pid, how)
            else:
                slot.restart_at = time.monotonic() + delay
                slot.backoff_until = time.time() + delay
                log.error("worker %d (pid %d) %s after %.1f s; restarting in %.0f s (restart %d)",
                          slot.index, pid, how, lived, delay, slot.restarts)

    def restart_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.restart_at is not None and slot.restart_at <= now and not self.stopping:
                if self.respawn(slot):
                    log.error("worker %d (pid %s) replaced: started pid %d", slot.index, slot.old_pid, slot.pid)

    def respawn(self, slot: _Slot) -> bool:
        """``spawn``, or try again in ``BACKOFF_CAP`` seconds if the system cannot fork now."""
        try:
            self.spawn(slot)
            return True
        except OSError as exc:
            slot.restart_at = time.monotonic() + BACKOFF_CAP
            slot.backoff_until = time.time() + BACKOFF_CAP
            log.error("worker %d: cannot start a process (%s); trying again in %.0f s", slot.index, exc, BACKOFF_CAP)
            return False

    # -- messages ----------------------------------------------------------------------
    def drain(self, slot: _Slot) -> list[tuple[_Slot, bytes]]:
        """Read everything queued from one worker; returns its questions (answered by the caller,
        after every channel has been read)."""
        asks = []
        while slot.end is not None:
            try:
                data = slot.end.recv(MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:  # that worker exited (reaped separately)
                self.sel.unregister(slot.end)
                slot.end.close()
                slot.end = None
                break
            kind = data[:1]
            if kind == _ROSTER:
                self.relay(slot, data)
            elif kind == _COUNTERS:
                slot.kept = data[1:]
            elif kind == _UP:
                slot.up = slot.ever_up = True
            elif kind == _ASK:
                asks.append((slot, data[1:]))
            elif kind == _STORE:
                self.send(slot, _STORED + data[1:9] + answer_store(self.table, data[9:]))
        return asks

    def relay(self, source: _Slot, data: bytes) -> None:
        """A roster change to every other worker, and into the record a replacement starts from."""
        try:
            message = msgspec.json.decode(data)
            url, event = message["spec"]["url"], message["event"]
        except (msgspec.DecodeError, KeyError, TypeError):
            url = event = None
        if event in ("registered", "refreshed", "updated"):
            self.roster.pop(url, None)
            self.roster[url] = [data]
        elif event == "draining" and url in self.roster:
            self.roster[url].append(data)
        elif event == "removed":
            self.roster.pop(url, None)
        for slot in self.slots:
            if slot is not source and slot.end is not None:
                self.send(slot, data)

    def send(self, slot: _Slot, data: bytes) -> None:
        if slot.outbox:
            slot.outbox.append(data)
            return
        end = slot.end
        if end is None:
            return
        try:
            end.send(data)
        except BlockingIOError:
            slot.outbox.append(data)
            self.sel.modify(end, selectors.EVENT_READ | selectors.EVENT_WRITE, slot)
        except OSError:
            pass

    def flush(self, slot: _Slot) -> None:
        while slot.outbox and slot.end is not None:
            try:
                slot.end.send(slot.outbox[0])
            except BlockingIOError:
                return
            except OSError:
                slot.outbox.clear()
                break
            slot.outbox.popleft()
        if slot.end is not None:
            self.sel.modify(slot.end, selectors.EVENT_READ, slot)

    def answer(self, slot: _Slot, question: bytes) -> None:
        try:
            q = msgspec.json.decode(question)
            kept = {str(i): msgspec.Raw(self.slots[i].kept) for i in q.get("slots", ())
                    if 0 <= i < len(self.slots) and self.slots[i].kept}
        except (msgspec.DecodeError, TypeError, AttributeError):
            return
        reply = {"id": q.get("id"), "workers": [s.view() for s in self.slots], "kept": kept}
        if slot.end is not None:
            self.send(slot, _ANSWER + msgspec.json.encode(reply))

    # -- the loop ----------------------------------------------------------------------
    def on_signal(self, signum, _frame) -> None:
        if signum in (signal.SIGINT, signal.SIGTERM):
            # A graceful shutdown; a second signal: at once (the workers exit on SIGQUIT).
            self.stopping += 1
            self.tell(signal.SIGTERM if self.stopping == 1 else signal.SIGQUIT)
        elif signum == signal.SIGHUP:
            log.info("SIGHUP: reloading every worker")
            self.tell(signal.SIGHUP)
        # SIGCHLD: only wakes the loop (the wakeup fd) to reap.

    def timeout(self) -> float | None:
        waits = [WATCH_INTERVAL] if self.watch else []
        now = time.monotonic()
        waits += [max(0.0, s.restart_at - now) for s in self.slots if s.restart_at is not None]
        return min(waits) if waits else None

    def run(self, reload_now: bool) -> int:
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.sel.register(self.wake_r, selectors.EVENT_READ, None)
        self.previous = {sig: signal.signal(sig, self.on_signal)
                         for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD)}
        self.old_wakeup = signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)
        try:
            for slot in self.slots:
                self.spawn(slot)
            log.info("started %d workers: %s", len(self.slots), [s.pid for s in self.slots])
            if reload_now:
                self.tell(signal.SIGHUP)
            while any(s.pid is not None or (s.restart_at is not None and not self.stopping) for s in self.slots):
                asks = []
                for key, events in self.sel.select(self.timeout()):
                    if key.data is None:
                        try:
                            while self.wake_r.recv(512):
                                pass
                        except (BlockingIOError, InterruptedError):
                            pass
                        continue
                    if events & selectors.EVENT_WRITE:
                        self.flush(key.data)
                    if events & selectors.EVENT_READ:
                        asks += self.drain(key.data)
                if asks:
                    # Everything sent before a question is read before it is answered.
                    for slot in self.slots:
                        asks += self.drain(slot)
                    for slot, question in asks:
                        self.answer(slot, question)
                self.reap()
                self.restart_due()
                if self.watch is not None and self.watch.changed():
                    log.info("%s changed: reloading every worker", self.watch.path)
                    self.tell(signal.SIGHUP)
        finally:
            signal.set_wakeup_fd(self.old_wakeup)
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            self.sel.close()
            self.wake_r.close()
            self.wake_w.close()
            for slot in self.slots:
                if slot.end is not None:
                    slot.end.close()
        return self.status
