"""Continuing a broken stream on another decode, per API (the shell is ``migration.py``):
which requests may be continued (:func:`unsound`), what the client has received
(:func:`received`, parsed only when a stream broke), and from it the continuation's body and
each of its events made the stream's own (the received object's ``body`` and ``own``).

* chat and completions (``text.py``): a text continuation, the answer so far as a final
  assistant message to continue, or appended to the prompt;
* generate (``tokens.py``): token in, exact by construction;
* Messages (``messages.py``): vLLM 0.32's Messages endpoint does not continue a final
  assistant message, so the continuation is the same conversation on vLLM's chat endpoint
  (the conversion vLLM makes of it, continued there), its chunks rendered as the Messages
  stream's events;
* Responses (``responses.py``): the request with the text so far as a partial assistant
  message, which vLLM continues; ``store: false`` only.
"""

from __future__ import annotations

from epd_proxy.request.apis import GENERATE, MESSAGES, RESPONSES
from epd_proxy.request.continuation import messages, responses, text, tokens
from epd_proxy.request.continuation.text import Received, continuation_body, own_event, whole_usage
from epd_proxy.request.ingress import CHAT, COMPLETIONS

__all__ = ["Received", "continuation_body", "own_event", "received", "unsound", "whole_usage"]


def unsound(path: str, body: dict) -> str | None:
    """Why this request's stream cannot be continued (None: it can)."""
    if path == CHAT or path == COMPLETIONS:
        return text.unsound(path, body)
    if path == GENERATE:
        return tokens.unsound(body)
    if path == MESSAGES:
        return messages.unsound(body)
    if path == RESPONSES:
        return responses.unsound(body)
    return "api"


def received(path: str, data: bytes):
    """What the client has of the answer, from the reads its stream relayed."""
    if path == GENERATE:
        return tokens.received(data)
    if path == MESSAGES:
        return messages.received(data)
    if path == RESPONSES:
        return responses.received(data)
    return text.received(data)
