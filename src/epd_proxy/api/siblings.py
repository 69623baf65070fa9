"""How one ``--workers`` process answers for the whole proxy.

The kernel hands a scrape of ``/metrics`` (or a probe of ``/ready``, a look at
``/status``) to any one worker. That worker asks each sibling for its own view
over a Unix socket in a directory the parent created before forking, and
combines the answers with its own. Nothing is shared while requests run: a
counter stays a plain ``+= 1`` in its process, and the cost (one local round
trip per sibling) is paid per scrape, not per request.

The wire format is one line naming what is asked (``metrics``, ``status``,
``ready``) and, in reply, one JSON document; the connection then closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, Callable

import msgspec

log = logging.getLogger("epd_proxy.siblings")

# A sibling that has not answered within this is left out of the answer (and the
# ``epd_proxy_workers`` gauge shows one fewer): a stuck worker cannot stall a scrape.
PEER_TIMEOUT = 2.0

Answer = Callable[[str], Awaitable[object]]


def socket_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"worker-{index}.sock")


class SiblingChannel:
    """This worker's socket for its siblings, and the questions it asks them."""

    def __init__(self, directory: str, index: int, count: int) -> None:
        self.directory = directory
        self.index = index
        self.count = count
        self._server: asyncio.AbstractServer | None = None
        self._answer: Answer | None = None

    async def start(self, answer: Answer) -> None:
        """Serve ``answer(question)`` (a JSON-encodable value) to the siblings."""
        self._answer = answer
        path = socket_path(self.directory, self.index)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self._server = await asyncio.start_unix_server(self._serve, path)

    async def close(self) -> None:
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
        others = [i for i in range(self.count) if i != self.index]
        if not others:
            return []
        answers = await asyncio.gather(*(self._ask_one(i, question) for i in others))
        return [a for a in answers if a is not None]

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
