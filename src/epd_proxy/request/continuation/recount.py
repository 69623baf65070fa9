"""The answer so far counted in tokens, for a text continuation (chat, completions, Messages,
Responses): the two ``/tokenize`` requests whose difference it is, and the count from their
answers. The calls themselves are the shell's (``migration.py``); generate streams token ids
and needs none of this (``tokens.py``).

Why: vLLM merges the outputs a stream has not sent yet into one event when the stream falls
behind the engine (measured on vLLM 0.32: 829-900 Responses deltas per 1,000 tokens, 952-959
chat chunks), so one token per event undercounts, the continuation would get a larger budget
than is left and the whole answer could run past the client's ``max_tokens``. The tokens the
text so far renders to, after the prompt, are the answer's own wherever the continuation can
be exact at all (the text re-tokenizes to the ids that made it); never fewer than the events.

* a conversation (chat, and the chat vLLM makes of a Messages or Responses request): rendered
  with the generation prompt, and with the text so far as the final assistant message to
  continue (``continue_final_message``, no generation prompt), as the continuation renders it,
  with the request's fields that change the rendering;
* a text prompt (completions): the prompt, and the prompt with the text so far appended, as
  the continuation's prompt is, with the request's ``add_special_tokens``.
"""

from __future__ import annotations

# The chat request's fields that change what its conversation renders to (vLLM's
# ``TokenizeChatRequest`` has them all); tools make a stream unsound before this is asked.
_CHAT_FIELDS = ("chat_template", "chat_template_kwargs", "add_special_tokens", "mm_processor_kwargs")


def chat_requests(body: dict, messages: list, text: str) -> tuple[dict, dict]:
    """The ``/tokenize`` requests of ``messages`` (the conversation the request renders) with
    the generation prompt, and with ``text`` as the final assistant message to continue."""
    common: dict = {"model": body.get("model")}
    for name in _CHAT_FIELDS:
        value = body.get(name)
        if value is not None:
            common[name] = value
    return (dict(common, messages=messages, add_generation_prompt=True),
            dict(common, messages=messages + [{"role": "assistant", "content": text}],
                 add_generation_prompt=False, continue_final_message=True))


def prompt_requests(body: dict, prompt: str, text: str) -> tuple[dict, dict]:
    """The ``/tokenize`` requests of a completions ``prompt`` and of the prompt with ``text``
    appended (vLLM tokenizes both as a completions prompt: special tokens added unless the
    request says otherwise, the same on both sides)."""
    common: dict = {"model": body.get("model")}
    if body.get("add_special_tokens") is not None:
        common["add_special_tokens"] = body["add_special_tokens"]
    return dict(common, prompt=prompt), dict(common, prompt=prompt + text)


def answer_tokens(events: int, prompt: list[int] | None, continued: list[int] | None) -> int:
    """The answer so far in tokens from the two requests' ids: what the continued prompt holds
    after the original one, never fewer than ``events`` (the count so far). ``events`` when
    either is missing or the original is no prefix of the continued one (the text merged with
    the prompt's last token: the difference would not be the answer's)."""
    if prompt is None or continued is None or len(continued) < len(prompt) or continued[:len(prompt)] != prompt:
        return events
    return max(events, len(continued) - len(prompt))
