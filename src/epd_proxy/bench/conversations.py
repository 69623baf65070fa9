"""Multi-turn chat conversations for the cluster scenario: pure, deterministic for a seed.

What decides where a disaggregated cluster's work should go is what its caches
already hold, so the workload is built to have something to hold:

* a few **shared system prompts** (``system_prompts``); with 0, every
  conversation has its own and no two prompts share a prefix;
* **conversations of several turns**: turn ``t``'s prompt is the system prompt,
  every earlier user message and answer, then the new user message. The
  answers are the ones actually received (the driver passes them in), so the
  prefix a cache can reuse is what the cluster itself produced;
* a share of turns carry an **image** drawn from a small pool
  (``image_pool``), so images repeat across conversations, and every later
  turn of a conversation sends its earlier images again (a chat history does);
* **think times** between a turn's answer and the next turn, so many
  conversations are live at once and the caches compete.

:func:`working_set` counts the distinct prefix-cache blocks of the whole
workload with the simulator's own token ids and block hashes (the answers are
the simulator's deterministic ones), so the per-instance capacity can be set
below it and the ratio reported.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass, replace

from epd_proxy.bench.workloads import _PNG_MAGIC, _WORDS

__all__ = ["ChatSpec", "Conversation", "Turn", "conversation_bodies", "image_pool",
           "make_conversations", "turn_body", "working_set"]


@dataclass(frozen=True)
class ChatSpec:
    """The conversation workload. Sizes are in words (one simulator token each)."""

    conversations: int = 120
    turns: int = 4
    system_prompts: int = 3  # shared system prompts; 0 = each conversation its own (no shared prefix)
    system_words: int = 300
    user_words: int = 40
    max_tokens: int = 48
    image_share: float = 0.25  # share of turns whose user message carries one image
    image_pool: int = 24  # distinct images those turns draw from
    image_kb: float = 32.0
    think_s: float = 1.0  # mean think time before a turn after the first (exponential)
    model: str = "sim-model"
    seed: int = 0

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    def text_only(self) -> "ChatSpec":
        """The same conversations without images (what a router with no encoder stage can serve)."""
        return replace(self, image_share=0.0)


@dataclass(frozen=True)
class Turn:
    user_text: str
    image: int | None  # index into the image pool, or None
    think_s: float  # wait before sending this turn, after the previous answer (0 for the first)


@dataclass(frozen=True)
class Conversation:
    index: int
    id: str  # sent as X-Session-ID (what session-affine routers key on)
    system: int | None  # which shared system prompt, or None (its own)
    system_text: str
    turns: tuple[Turn, ...]


def _words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(0, n)))


def system_prompt(spec: ChatSpec, index: int) -> str:
    """Shared system prompt ``index``; its first word makes its first block its own."""
    rng = random.Random(f"{spec.seed}:system:{index}")
    return f"[system-{index}] " + _words(spec.system_words - 1, rng)


def make_conversations(spec: ChatSpec) -> list[Conversation]:
    """Every conversation of the workload, each turn's text, image and think time."""
    out = []
    shared = [system_prompt(spec, i) for i in range(spec.system_prompts)]
    for c in range(spec.conversations):
        rng = random.Random(f"{spec.seed}:conversation:{c}")
        cid = f"conv-{spec.seed}-{c}"
        s: int | None
        if shared:
            s = rng.randrange(len(shared))
            text = shared[s]
        else:
            s = None
            text = f"[{cid}] " + _words(spec.system_words - 1, rng)
        turns = []
        for t in range(spec.turns):
            image = None
            if spec.image_pool > 0 and spec.image_share > 0 and rng.random() < spec.image_share:
                image = rng.randrange(spec.image_pool)
            think = rng.expovariate(1.0 / spec.think_s) if t and spec.think_s > 0 else 0.0
            turns.append(Turn(f"[{cid}/turn-{t}] " + _words(spec.user_words - 1, rng), image, think))
        out.append(Conversation(c, cid, s, text, tuple(turns)))
    return out


def image_pool(spec: ChatSpec) -> list[str]:
    """The pool's images as base64 ``data:`` URLs (PNG-looking bytes of ``image_kb`` KiB)."""
    out = []
    n = max(len(_PNG_MAGIC), int(spec.image_kb * 1024))
    for i in range(spec.image_pool if spec.image_share > 0 else 0):
        rng = random.Random(f"{spec.seed}:image:{i}")
        raw = _PNG_MAGIC + rng.randbytes(n - len(_PNG_MAGIC))
        out.append("data:image/png;base64," + base64.b64encode(raw).decode("ascii"))
    return out


def _user_message(turn: Turn, images: list[str]) -> dict:
    if turn.image is None:
        return {"role": "user", "content": turn.user_text}
    return {"role": "user", "content": [{"type": "text", "text": turn.user_text},
                                        {"type": "image_url", "image_url": {"url": images[turn.image]}}]}


def turn_body(spec: ChatSpec, conv: Conversation, t: int, answers: list[str], images: list[str]) -> dict:
    """The chat-completions body of turn ``t``: system prompt, turns ``0..t-1`` with their
    ``answers`` (as received), then turn ``t``'s user message. Streamed."""
    if len(answers) < t:
        raise ValueError(f"turn {t} needs the {t} earlier answers, got {len(answers)}")
    messages = [{"role": "system", "content": conv.system_text}]
    for k in range(t):
        messages.append(_user_message(conv.turns[k], images))
        messages.append({"role": "assistant", "content": answers[k]})
    messages.append(_user_message(conv.turns[t], images))
    return {"model": spec.model, "messages": messages, "max_tokens": spec.max_tokens, "stream": True}


def conversation_bodies(spec: ChatSpec, conv: Conversation, images: list[str], answer) -> list[dict]:
    """Every turn's body, each answer given by ``answer(body)`` (e.g. the simulator's
    ``expected_text``)."""
    bodies: list[dict] = []
    answers: list[str] = []
    for t in range(len(conv.turns)):
        body = turn_body(spec, conv, t, answers, images)
        bodies.append(body)
        answers.append(answer(body))
    return bodies


def working_set(spec: ChatSpec, convs: list[Conversation], images: list[str], block_size: int) -> dict:
    """The workload's working set, with the simulator's answers, token ids and block hashes:
    ``blocks`` = distinct full prefix-cache blocks over every prompt, ``prompt_tokens`` =
    the prompt tokens of all requests, ``image_tokens`` = the encoder outputs of the
    distinct images (what an encoder cache would hold to hit every repeat)."""
    from epd_proxy.sim.prefix_cache import block_hashes
    from epd_proxy.sim.tokens import analyze, expected_text, media_metadata, media_tokens, prompt_token_ids

    seen: set[int] = set()
    tokens = 0
    requests = 0
    used_images: set[int] = set()
    for conv in convs:
        for body in conversation_bodies(spec, conv, images, expected_text):
            prompt = analyze(body, True)
            ids = prompt_token_ids(body, True, prompt)
            seen.update(block_hashes(ids, block_size))
            tokens += prompt.tokens
            requests += 1
        used_images.update(t.image for t in conv.turns if t.image is not None)
    image_tokens = sum(media_tokens("image", media_metadata({"type": "image_url", "image_url": {"url": images[i]}}))
                       for i in used_images)
    return {"blocks": len(seen), "block_size": block_size, "prompt_tokens": tokens, "requests": requests,
            "distinct_images": len(used_images), "image_tokens": image_tokens}
