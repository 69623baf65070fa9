"""Request bodies for the benchmark: pure functions, deterministic for a seed.

A workload is a small set of distinct request bodies (``variants``), encoded
once to bytes before the run, that the load generator cycles through. Each
prepared request also carries the text the simulator will answer with
(``expected``), so every response can be verified byte for byte without
slowing the run down.

Workloads (``--workload``):

``stream``     text chat, P/D, streamed (``stream: true``)
``nonstream``  the same, not streamed
``mm``         chat with K images of S KiB each (base64 ``data:`` URLs), streamed:
               exercises E+P+D
``mixed``      stream : nonstream : mm = 2 : 1 : 1, interleaved
``messages``   the stream workload's prompts as Anthropic Messages (``/v1/messages``), streamed
``responses``  the same as OpenAI Responses (``/v1/responses``, ``store: false``), streamed
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass, replace
from typing import Callable

import msgspec

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"

WORKLOAD_NAMES = ("stream", "nonstream", "mm", "mixed", "messages", "responses")
# The API each workload speaks, by the kind its requests carry (chat for the rest).
API_PATHS = {"messages": MESSAGES_PATH, "responses": RESPONSES_PATH}

# A vocabulary for prompts: plain words, so a prompt's byte size is predictable.
_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "cluster", "serves",
    "prefill", "decode", "encoder", "tokens", "latency", "throughput", "request", "stream", "image",
    "model", "cache", "block", "transfer", "proxy", "router", "engine", "batch", "queue", "memory",
    "describe", "explain", "summarise", "compare", "careful", "detail", "answer", "question",
)

# Eight bytes that make a payload look like a PNG; the rest is noise (the simulator
# derives the image's grid from its bytes, it never decodes them).
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True, slots=True)
class Workload:
    """What to send. ``image_kb`` is the size of each image's bytes before base64."""

    name: str = "stream"
    stream: bool = True
    images: int = 0
    image_kb: float = 150.0
    prompt_bytes: int = 600
    max_tokens: int = 64
    variants: int = 16
    model: str = "sim-model"
    api: str = "chat"  # "chat", "messages" or "responses"

    @property
    def multimodal(self) -> bool:
        return self.images > 0

    def describe(self) -> str:
        kind = "stream" if self.stream else "non-stream"
        text = f"{kind}, ~{self.prompt_bytes} B prompt, {self.max_tokens} output tokens"
        if self.images:
            text += f", {self.images} x {self.image_kb:g} KiB image" + ("s" if self.images > 1 else "")
        if self.api != "chat":
            text = f"{API_PATHS[self.api]}, " + text
        return text


@dataclass(slots=True)
class Prepared:
    """One request ready to send: path, encoded body and what the answer must say."""

    kind: str  # the workload it comes from ("stream", "nonstream", "mm")
    path: str
    body: bytes
    stream: bool
    expected: str | None  # the simulator's deterministic text; None = not verified
    obj: dict  # the body as a dict (for stage-by-stage calls in the latency scenario)


def make_workload(name: str, *, images: int = 1, image_kb: float = 150.0, prompt_bytes: int = 600,
                  max_tokens: int = 64, variants: int = 16, model: str = "sim-model") -> list[Workload]:
    """The component workloads of ``name`` (several for ``mixed``). ``NAME@N`` is ``NAME`` with
    ``N`` output tokens: two lengths in one comparison split a target's CPU per request into
    its per-event and per-request parts (same run, same machine state)."""
    name, at, tokens = name.partition("@")
    if at:
        if not tokens.isdigit() or int(tokens) < 1:
            raise ValueError(f"workload {name}@{tokens}: the part after '@' is a number of output tokens")
        max_tokens = int(tokens)
    base = Workload(name=name, prompt_bytes=prompt_bytes, max_tokens=max_tokens, variants=variants,
                    model=model, image_kb=image_kb)
    if name == "stream":
        return [replace(base, stream=True, images=0)]
    if name == "nonstream":
        return [replace(base, stream=False, images=0)]
    if name == "mm":
        return [replace(base, stream=True, images=max(1, images))]
    if name == "mixed":
        return [replace(base, name="stream", stream=True, images=0),
                replace(base, name="stream", stream=True, images=0),
                replace(base, name="nonstream", stream=False, images=0),
                replace(base, name="mm", stream=True, images=max(1, images))]
    if name in API_PATHS:
        return [replace(base, stream=True, images=0, api=name)]
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOAD_NAMES)})")


def prompt_text(nbytes: int, rng: random.Random) -> str:
    """Words from a fixed vocabulary, about ``nbytes`` bytes long (never more)."""
    words: list[str] = []
    size = 0
    while True:
        w = rng.choice(_WORDS)
        extra = len(w) + (1 if words else 0)
        if size + extra > nbytes:
            break
        words.append(w)
        size += extra
    return " ".join(words) or "hello"


def image_bytes(kb: float, rng: random.Random) -> bytes:
    n = max(len(_PNG_MAGIC), int(kb * 1024))
    return _PNG_MAGIC + rng.randbytes(n - len(_PNG_MAGIC))


def image_data_url(kb: float, rng: random.Random) -> str:
    return "data:image/png;base64," + base64.b64encode(image_bytes(kb, rng)).decode("ascii")


def chat_body(w: Workload, index: int, seed: int = 0) -> dict:
    """Variant ``index`` of workload ``w`` as a chat-completions body."""
    rng = random.Random(f"{seed}:{w.name}:{w.images}:{w.image_kb}:{index}")
    text = f"[{index}] " + prompt_text(max(8, w.prompt_bytes - 8), rng)
    content: list | str
    if w.images:
        content = [{"type": "text", "text": text}]
        for _ in range(w.images):
            content.append({"type": "image_url", "image_url": {"url": image_data_url(w.image_kb, rng)}})
    else:
        content = text
    body = {"model": w.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": w.max_tokens, "stream": w.stream}
    return body


def prepare(workloads: list[Workload], *, seed: int = 0,
            expected: Callable[[dict], str] | None = None) -> list[Prepared]:
    """Every variant of every component workload, interleaved, encoded once.

    With several components (``mixed``) variant ``i`` of each comes in turn, so any
    window of the rotation has the mix's proportions.
    """
    out: list[Prepared] = []
    n = max(w.variants for w in workloads)
    for i in range(n):
        for w in workloads:
            if i >= w.variants:
                continue
            body = chat_body(w, i, seed)
            if w.api != "chat":  # the same prompt in that API's spelling; its text is chat's
                out.append(Prepared(kind=w.api, path=API_PATHS[w.api], body=msgspec.json.encode(api_body(w, body)),
                                    stream=w.stream, expected=expected(body) if expected is not None else None,
                                    obj=api_body(w, body)))
                continue
            kind = "mm" if w.images else ("stream" if w.stream else "nonstream")
            out.append(Prepared(kind=kind, path=CHAT_PATH, body=msgspec.json.encode(body), stream=w.stream,
                                expected=expected(body) if expected is not None else None, obj=body))
    return out


def api_body(w: Workload, chat: dict) -> dict:
    """A text chat body as a Messages or Responses request (the same prompt and limit: vLLM,
    and the simulator, turn it back into that chat request)."""
    text = chat["messages"][0]["content"]
    if w.api == "messages":
        return {"model": w.model, "max_tokens": w.max_tokens, "messages": [{"role": "user", "content": text}],
                "stream": w.stream}
    # Not stored: a benchmark's responses would only fill the instances' stores.
    return {"model": w.model, "input": text, "max_output_tokens": w.max_tokens, "stream": w.stream,
            "store": False}


def simulator_expected() -> Callable[[dict], str]:
    """``epd_proxy.sim.expected_text``: what the simulator answers to a body (the simulator is
    part of the package; an import failure here is a defect to see, not a reason to skip checks)."""
    from epd_proxy.sim import expected_text

    return expected_text
