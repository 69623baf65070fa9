"""How one ``--workers`` process answers for the whole proxy.

The kernel hands a scrape of ``/metrics`` (or a probe of ``/ready``, a look at
``/status``) to any one worker. That worker asks each sibling for its own view
over a Unix socket in a directory the parent created before forking, and
combines the answers with its own. Nothing is shared while requests run: a
counter stays a plain ``+= 1`` in its process, and the cost (one local round
trip per sibling) is paid per scrape, not per request.

The wire format is one line naming what is asked (``metrics``, ``status``,
``ready``) and, in reply, one JSON document; the connection then closes.

A worker that is gone (killed, being replaced) or stuck does not answer. Its
counters still count: every counter snapshot a worker lets out is first handed
to the parent (``parent.publish``), a scrape that misses a worker takes that
slot's kept counters from the parent, and a replacement counts on from them
(``carried``). So a scrape never shows less than an earlier one
(``runtime/workers.py`` says why); gauges are only ever the live workers'.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, Callable, Protocol

import msgspec

from epd_proxy.observe.metrics import carried, combine

log = logging.getLogger("epd_proxy.siblings")

# A sibling that has not answered within this is left out of the answer (and the
# ``epd_proxy_workers`` gauge shows one fewer): a stuck worker cannot stall a scrape.
PEER_TIMEOUT = 2.0

# How often a worker hands its counters to the parent unasked: the most counting a SIGKILL
# can lose (never any that a scrape has shown).
PUBLISH_INTERVAL = 1.0

Answer = Callable[[str], Awaitable[object]]


class Parent(Protocol):
    """The supervising process (``runtime.workers.PeerLink``)."""

    def publish(self, counters: dict) -> None: ...

    async def ask(self, slots: list[int]) -> dict | None: ...


def socket_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"worker-{index}.sock")


class SiblingChannel:
    """This worker's socket for its siblings, and the questions it asks them."""

    def __init__(self, directory: str, index: int, count: int, carried: dict | None = None) -> None:
        self.directory = directory
        self.index = index
        self.count = count  # workers configured
        self.carried = carried  # the counters of the workers this one replaces
        self.parent: Parent | None = None
        self._server: asyncio.AbstractServer | None = None
        self._answer: Answer | None = None
        self._publisher: asyncio.Task | None = None

    async def start(self, answer: Answer) -> None:
        """Serve ``answer(question)`` (a JSON-encodable value) to the siblings."""
        self._answer = answer
        path = socket_path(self.directory, self.index)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self._server = await asyncio.start_unix_server(self._serve, path)
        if self.parent is not None:
            self._publisher = asyncio.get_running_loop().create_task(self._publish_periodically())

    def own(self, snapshot: dict) -> dict:
        """This worker's metrics snapshot counted on from its predecessors', its counters
        handed to the parent before anyone sees them."""
        if self.carried:
            snapshot = dict(snapshot, families=combine(self.carried, snapshot["families"]))
        if self.parent is not None:
            self.parent.publish(carried(snapshot["families"]))
        return snapshot

    async def _publish_periodically(self) -> None:
        assert self._answer is not None
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL)
            try:
                await self._answer("metrics")  # publishes (the app answers with ``own``)
            except Exception:
                log.exception("handing the counters to the parent")

    async def metrics(self) -> list[dict]:
        """The siblings' snapshots for a scrape: each live one's, and for one that did not
        answer, its slot's kept counters (the parent's)."""
        answers = await self.ask_each("metrics")
        missing = [i for i, a in answers.items() if a is None]
        found: list[dict] = [a for a in answers.values() if isinstance(a, dict)]
        if missing and self.parent is not None:
            view = await self.parent.ask(missing)
            for families in (view or {}).get("kept", {}).values():
                found.append({"families": families})
        return found

    async def supervisor(self) -> list[dict] | None:
        """The parent's view of each worker: pid, restarts, last exit, back-off."""
        if self.parent is None:
            return None
        view = await self.parent.ask([])
        return view["workers"] if view else None

    async def close(self) -> None:
        if self._publisher is not None:
            self._publisher.cancel()
            self._publisher = None
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._answer is not None  # set before the server starts
        try:
            question = (await asyncio.wait_for(reader.readline(), PEER_TIMEOUT)).decode("ascii").strip()
            writer.write(msgspec.json.encode(await self._answer(question)))
            await writer.drain()
        except (OSError, asyncio.TimeoutError, UnicodeDecodeError):
            pass
        except Exception:  # a bug in an answer must not take the worker down
            log.exception("answering a sibling worker")
        finally:
            writer.close()

    async def ask(self, question: str) -> list:
        """Every sibling's answer to ``question`` (those that answered in time)."""
        return [a for a in (await self.ask_each(question)).values() if a is not None]

    async def ask_each(self, question: str) -> dict[int, object]:
        """Each sibling's answer to ``question`` by worker index (None: no answer in time)."""
        others = [i for i in range(self.count) if i != self.index]
        answers = await asyncio.gather(*(self._ask_one(i, question) for i in others))
        return dict(zip(others, answers))

    async def _ask_one(self, index: int, question: str):
        writer = None
        try:
            async with asyncio.timeout(PEER_TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(socket_path(self.directory, index))
                writer.write(question.encode("ascii") + b"\n")
                data = await reader.read()
            return msgspec.json.decode(data) if data else None
        except (OSError, asyncio.TimeoutError, msgspec.DecodeError):
            return None  # not started yet, gone, or stuck: left out
        finally:
            if writer is not None:
                writer.close()
