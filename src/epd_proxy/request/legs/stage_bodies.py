"""The bodies sent to the prefill and decode stages.

Both are shallow copies of the (possibly rewritten) client body with a few
keys changed, so P and D see identical prompt content (docs/protocol.md §2.3) and the client's
body stays untouched for a retry (docs/protocol.md §5.1).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

import msgspec

from epd_proxy.wire.blobs import encode_json

if TYPE_CHECKING:
    from epd_proxy.request.apis import GenerationApi

# What the proxy sends P so that it prefills for a remote decoder and keeps
# the blocks (docs/protocol.md §2.4: NIXL pull, NIXL push and E+P+D).
NIXL_PREFILL_PARAMS = MappingProxyType(
    {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)

# Fields that would make P reject or mis-run a 1-token, non-streaming call
# (docs/protocol.md §2.3 rules 1 and 2).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def nixl_prefill_request_params(transfer_id: str | None = None) -> dict:
    """A fresh copy of the "send to P" object (docs/protocol.md §2.4), plus ``transfer_id`` if given."""
    out: dict[str, object] = dict(NIXL_PREFILL_PARAMS)
    if transfer_id is not None:
        out["transfer_id"] = transfer_id
    return out


def prompt_once(body: dict) -> dict:
    """``body`` (chat's or completions') with its prompt, the ``messages`` or the ``prompt``,
    encoded to JSON once, as a ``msgspec.Raw`` that :func:`~epd_proxy.wire.blobs.encode_json`
    writes back verbatim: the prefill's and the decode's bodies made from it carry the same
    bytes as before, and their largest value is encoded once between them, not once each."""
    key = "messages" if "messages" in body else "prompt"
    prompt = body.get(key)
    if prompt is None:
        return body
    out = dict(body)
    out[key] = msgspec.Raw(encode_json(prompt))
    return out


def prefill_body(body: dict, kv_transfer_params: dict | None, api: GenerationApi | None = None) -> dict:
    """The prefill leg: one token, not streamed (docs/protocol.md §2.3); ``api``: another
    generation API's spelling of it (apis.py).

    - ``stream: false``, and ``stream_options`` removed (400 otherwise);
    - ``max_tokens: 1``, and ``max_completion_tokens: 1`` if the client set it
      (it takes precedence over ``max_tokens`` on chat);
    - ``min_tokens`` / ``min_completion_tokens`` removed (min > max is a 400);
    - ``n: 1`` if the client set ``n`` (absent already means 1);
    - ``kv_transfer_params`` set to the given object, or absent with None (a
      client's value never gets here: ``parse_body`` drops it).
    """
    if api is not None:
        return api.prefill_body(body, kv_transfer_params)
    out = dict(body)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in _PREFILL_DROPPED:
        if key in out:
            del out[key]
    if "n" in out:
        out["n"] = 1
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    else:
        out.pop("kv_transfer_params", None)
    return out


class _Keep:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<keep client value>"


_KEEP = _Keep()


def decode_body(body: dict, *, kv: dict | msgspec.Raw | None | _Keep = _KEEP, ec: dict | None | _Keep = _KEEP) -> dict:
    """The decode leg: the client's body with the transfer params the proxy owns.

    For each of ``kv`` (``kv_transfer_params``) and ``ec``
    (``ec_transfer_params``):
    - omitted: the body's value, if any, is kept (a client's own never gets
      here: ``parse_body`` drops it; this is what the encoder fan-out set);
    - a dict: it replaces the client's value;
    - None: the key is removed, so a stale value from the client or from a
      previous attempt can never reach D (docs/protocol.md §5.1).

    Callers on a P/D or EPD route always pass the argument they own.
    """
    out = dict(body)
    # Unrolled over the two keys: every decode leg's body is made here.
    if kv is not _KEEP:
        if kv is None:
            out.pop("kv_transfer_params", None)
        else:
            out["kv_transfer_params"] = kv
    if ec is not _KEEP:
        if ec is None:
            out.pop("ec_transfer_params", None)
        else:
            out["ec_transfer_params"] = ec
    return out


def stream_options_with_usage(options: object) -> dict | None:
    """The ``stream_options`` that make decode end a stream with its usage event, for a
    client that did not ask for it (usage/hidden.py takes the event out again); None when
    the client asked. ``continuous_usage_stats`` is dropped: without ``include_usage`` it
    did nothing, and with it every event would carry usage."""
    if isinstance(options, dict):
        if options.get("include_usage"):
            return None
        out = {k: v for k, v in options.items() if k != "continuous_usage_stats"}
        out["include_usage"] = True
        return out
    return {"include_usage": True}
