"""Whether a P/D request is disaggregated at all: the decode that computes it alone.

The prefill hop (a prefill, a KV transfer, then decode) costs a fixed 15-40 ms; a decode
that already holds all but a few of the prompt's tokens computes the rest faster than the
hop takes. With the block index's answer (``RequestView.held``, per instance URL, over
``live``), the decodes holding the prompt are weighed here: the one holding the longest
prefix, of those that would compute at most ``max_tokens`` (the multi-turn prefill skip's
rule, :func:`skips_prefill`), run at most ``max_streams`` other
requests (vLLM batches a prefill with the running streams: each of them would wait for
it), and are within ``cache-aware``'s load bound of the least loaded candidate. Ties go
to the policy's own pick, then to the less loaded, then in rendezvous order of the
anchor (every replica computes the same). None: disaggregate, with the policy's decode.

Pure: candidates, the index's answer and the bounds in, one candidate or None out.
"""

from __future__ import annotations

from typing import Sequence

from epd_proxy.routing.candidate import C
from epd_proxy.routing.view import instance_seed, mix64


def decode_alone(candidates: Sequence[C], held: dict[str, int], live: frozenset[str], tokens: int,
                 chosen: C, anchor: int, *, max_tokens: int, max_streams: float, balance_abs: float,
                 balance_rel: float) -> C | None:
    """The decode that computes the prompt alone, or None (disaggregate). ``chosen``: the
    decode the pool's policy picked; only candidates whose events are ``live`` are judged
    (a decode the index does not speak for cannot be shown to hold anything)."""
    if max_tokens <= 0 or tokens <= 0 or not candidates:
        return None
    loads = [c.inflight + c.signals.others for c in candidates]
    low = min(loads)
    bound = low + max(balance_abs, low * (balance_rel - 1.0))
    best: C | None = None
    top: tuple = ()
    for c, load in zip(candidates, loads):
        url = c.url
        if url not in live:
            continue
        has = held.get(url, 0)
        if tokens - has > max_tokens or load > max_streams or load > bound:
            continue
        score = (has, c is chosen, -load, mix64(anchor ^ instance_seed(url)))
        if score > top:
            best, top = c, score
    return best


def skips_prefill(new_tokens: int, streams: float, max_tokens: int, max_streams: float) -> bool:
    """Whether a turn goes to the decode holding its history alone: its prefill would compute
    at most ``max_tokens``, and that decode runs at most ``max_streams`` other requests. vLLM
    batches a prefill with the running streams, so each of their steps waits for it: on a busy
    decode the hop it saves one turn is paid by every other stream in inter-token latency."""
    return 0 < max_tokens and new_tokens <= max_tokens and streams <= max_streams
