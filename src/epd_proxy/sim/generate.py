"""``POST /inference/v1/generate``: vLLM 0.32's token-in, token-out API.

A scale-out route: vLLM answers it only when started with ``--enable-scale-out``
(``SimConfig.enable_scale_out``), else 403 (:data:`DISABLED_BODY`). The prompt is
``token_ids`` (a completions prompt of token ids, for the simulator) and the answer
the output's token ids, the simulator's vocabulary indices (``tokens.VOCAB``), so
``expected_tokens`` gives their text.
"""

from __future__ import annotations

from typing import Any

import msgspec

from epd_proxy.sim.api_format import ApiFormat
from epd_proxy.sim.engine import DONE_EVENT, Sequence
from epd_proxy.sim.responses import STREAM_GENERATION_ERROR, api_error_body
from epd_proxy.sim.validation import ApiError, schema_error, schema_item

_encode = msgspec.json.encode

DISABLED_BODY = api_error_body(ApiError(
    403, "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
    "PermissionDeniedError"))
# The sampling parameters the simulator reads, as the completions fields they act as.
_SAMPLING = {"max_tokens": "max_tokens", "min_tokens": "min_tokens", "n": "n", "seed": "seed"}
_CHOICE_TAIL = b',"routed_experts":null,"sampling_mask":null,"weight_versions":null,"logprobs":null}]}\n\n'


def to_completion(body: Any) -> dict:
    """The completions request the simulator runs for a generate request: ``token_ids`` as
    the prompt, ``sampling_params.max_tokens`` as the cap (none when unset)."""
    if not isinstance(body, dict):
        raise schema_error([schema_item("model_type", "body", "Input should be a valid dictionary or instance of "
                                        "GenerateRequest", body, {"class_name": "GenerateRequest"})])
    errors = [schema_item("missing", f"body.{k}", "Field required", body)
              for k in ("token_ids", "sampling_params") if k not in body]
    ids = body.get("token_ids")
    if "token_ids" in body and not (isinstance(ids, list) and ids and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        errors.append(schema_item("value_error", "body.token_ids",
                                  "token_ids must be a non-empty list of non-negative integers", ids))
    sp = body.get("sampling_params")
    if "sampling_params" in body and not isinstance(sp, dict):
        errors.append(schema_item("model_type", "body.sampling_params",
                                  "Input should be a valid dictionary or instance of SamplingParams", sp))
    if errors:
        raise schema_error(errors)
    assert isinstance(sp, dict)
    out: dict = {"prompt": ids, "max_tokens": sp.get("max_tokens")}
    for key, field in _SAMPLING.items():
        if key in sp and key != "max_tokens":
            out[field] = sp[key]
    for key in ("model", "request_id", "stream", "stream_options", "kv_transfer_params", "ec_transfer_params",
                "sim_fault"):
        if key in body:
            out[key] = body[key]
    return out


def _usage(seq: Sequence, completion: int) -> dict:
    out: dict = {"prompt_tokens": seq.prompt_tokens, "total_tokens": seq.prompt_tokens + completion,
           "completion_tokens": completion}
    if seq.cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": seq.cached_tokens}
    return out


class GenerateFormat(ApiFormat):
    """``/inference/v1/generate`` on one instance."""

    chat = False

    def __init__(self, created: int) -> None:
        self.created = created

    def translate(self, body: Any) -> dict:
        return to_completion(body)

    def request_id(self, body: dict) -> str | None:
        rid = body.get("request_id")
        return rid if isinstance(rid, str) and rid else None

    def ids(self, base: str, suffix: str, body: dict) -> tuple[str, str]:
        rid = "generate-tokens-" + base
        return rid, rid

    def body(self, g, seq: Sequence, kv_out: dict | None, ec_out: dict | None) -> dict:
        usage = _usage(seq, seq.n * len(seq.tokens))
        usage.setdefault("prompt_tokens_details", None)
        usage["completion_tokens_details"] = None
        choices = [{"index": c, "finish_reason": seq.finish_reason, "stop_reason": None, "token_ids": toks,
                    "routed_experts": None, "sampling_mask": None, "weight_versions": None, "logprobs": None}
                   for c, toks in enumerate(seq.tokens)]
        return {"request_id": g.resp_id, "model": g.model, "created": self.created, "usage": usage,
                "prompt_logprobs": None, "prompt_token_id_logprobs": None, "prompt_token_ids": None,
                "mm_placeholders": None, "metrics": None, "kv_transfer_params": kv_out,
                "ec_transfer_params": ec_out, "output_mode": "tokens", "choices": choices}

    def token_event(self, seq: Sequence, choice: int, i: int, tok: int) -> tuple[bytes, bytes, bytes]:
        head = b'data: {"request_id":' + _encode(seq.ctx.resp_id) + b',"usage":'
        if seq.continuous_usage:
            head += _encode(_usage(seq, i + 1))
        else:
            head += b"null"
        fin = b'"' + seq.finish_reason.encode() + b'"' if i == seq.n - 1 else b"null"
        head += (b',"output_mode":"tokens","choices":[{"index":%d,"finish_reason":' % choice + fin
                 + b',"stop_reason":null,"token_ids":[')
        return head, b"%d" % tok, b"]" + _CHOICE_TAIL

    def stream_tail(self, seq: Sequence) -> bytes:
        if not seq.include_usage:
            return DONE_EVENT
        final = {"request_id": seq.ctx.resp_id, "usage": _usage(seq, seq.n * len(seq.tokens)),
                 "output_mode": "tokens", "choices": []}
        return b"data: " + _encode(final) + b"\n\n" + DONE_EVENT

    def stream_error(self, seq: Sequence) -> bytes | None:
        return STREAM_GENERATION_ERROR + DONE_EVENT
