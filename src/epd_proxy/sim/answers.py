"""A simulated generation request's state and its answer: the engine callbacks that write it
(the prompt's KV made, the whole answer or the stream's tail, a generation failure, a reset)
and the chat and completions bodies. The steps that lead there are ``generation.py``'s."""

from __future__ import annotations

import logging

import msgspec

from epd_proxy.sim import responses
from epd_proxy.sim.api_format import ApiFormat
from epd_proxy.sim.ec_store import store_outputs
from epd_proxy.sim.engine import DONE_EVENT, Sequence
from epd_proxy.sim.generate import GenerateFormat
from epd_proxy.sim.host import SimHost
from epd_proxy.sim.kv_reuse import ReadResult
from epd_proxy.sim.prefix_cache import block_hashes
from epd_proxy.sim.tokens import Prompt, continuation_ids, prompt_token_ids

log = logging.getLogger("epd_proxy.sim")
_encode = msgspec.json.encode


class GenerationRequest:
    """One generation request's state, shared by the steps and the engine callbacks."""

    __slots__ = ("chat", "resp_id", "internal_id", "model", "prompt", "hold_kv", "transfer_id",
                 "drop_kv", "headers", "n_choices", "ec_groups", "kv_out", "reset", "body", "seq",
                 "cached_tokens", "api", "final", "reuse", "ids", "read", "computed",
                 "lora")
    # Set once the request is validated.
    model: str
    prompt: Prompt
    n_choices: int
    body: dict

    def __init__(self, chat: bool, api: ApiFormat | None = None) -> None:
        self.chat = chat
        self.api = api  # None for chat and completions
        self.final: dict | None = None  # an ApiFormat's final answer
        self.resp_id = "?"
        self.internal_id = ""
        self.headers: list | None = None  # the X-Request-Id echo, on every answer
        self.hold_kv = False
        self.transfer_id: str | None = None
        self.drop_kv = False
        self.ec_groups: dict | None = None
        self.kv_out: dict | None = None
        self.reset = False
        self.seq: Sequence | None = None  # once there is one
        self.cached_tokens = 0  # prompt tokens found in this instance's prefix cache
        self.reuse: dict | None = None  # a prefill's decode parameters to read the last turn from
        self.ids: list[int] | None = None  # the prompt's token ids, once derived
        self.read = ReadResult()  # what it read from that decode
        self.computed = 0  # prompt tokens computed here
        self.lora: str | None = None  # the LoRA adapter it runs with (holding one of its slots)


class AnswerWriter:
    """The engine's callbacks for one instance's generation requests (``GenerationHandler``'s
    base): what a finished, failed or reset sequence writes, and the KV a prefill holds."""

    def __init__(self, inst: SimHost) -> None:
        self.inst = inst
        self.config = inst.config
        self.stats = inst.stats

    def _token_ids(self, g: GenerationRequest, body: dict, prompt: Prompt) -> list[int]:
        if g.ids is None:
            g.ids = prompt_token_ids(body, g.chat, prompt)
        return g.ids

    def on_complete(self, seq: Sequence) -> None:
        inst = self.inst
        g: GenerationRequest = seq.ctx
        st = self.stats
        kv_out = g.kv_out
        ec_out = None
        if g.ec_groups is not None:
            out, items = store_outputs(inst.ec_store, g.ec_groups, example=self.config.ec_connector == "example",
                                       hidden_size=self.config.hidden_size, producer=inst.name,
                                       host=inst.host, port=inst.port)
            st.encoded_items += items
            ec_out = out or None
        if self.config.bidirectional and inst.role == "decode" and g.body.get("kv_transfer_params"):
            # vLLM 0.32 (NixlConnector.request_finished: ``if not params: return False, None``)
            # pins only a request that came with parameters (a decode's pull from its prefill); a
            # plain one frees its blocks at once, bidirectional transfer or not.
            kv_out = self._keep(g, seq)
        ncomp = seq.n * g.n_choices
        st.success[seq.finish_reason] += 1
        st.prompt_tokens += seq.prompt_tokens
        st.generation_tokens += ncomp
        writer = seq.writer
        rec = seq.rec
        if g.api is not None:
            g.final = resp = g.api.body(g, seq, kv_out, ec_out)
            g.api.finished(g, resp)
        if seq.stream:
            tail = seq.stream_tail()
            if kv_out is not None and g.api is None and seq.head and self.config.bidirectional_stream_params:
                # A chunk of their own, just before [DONE].
                tail = (tail[:-len(DONE_EVENT)] + seq.head.partition(b',"choices":')[0]
                        + b',"choices":[],"kv_transfer_params":' + _encode(kv_out) + b"}\n\n" + DONE_EVENT)
            elif kv_out is not None and isinstance(g.api, GenerateFormat) and self.config.bidirectional_stream_params:
                # Generate's stream the same way (its chunks carry the token ids anyway).
                tail = (tail[:-len(DONE_EVENT)] + b'data: {"request_id":' + _encode(g.resp_id)
                        + b',"output_mode":"tokens","choices":[],"kv_transfer_params":' + _encode(kv_out)
                        + b"}\n\n" + DONE_EVENT)
            writer.end(tail)
        else:
            if g.api is None:
                resp = self._openai_body(g, seq, kv_out, ec_out, ncomp)
            writer.send(200, _encode(resp), headers=g.headers)
            if rec is not None:
                rec.answered(200)
        if rec is not None:
            rec.ended(writer.bytes_sent)
            rec.kv = kv_out
            if not self.config.record_responses:
                rec.response_chunks = None

    def _keep(self, g: GenerationRequest, seq: Sequence) -> dict:
        """Bidirectional transfer, on a decode: the finished request's blocks (prompt and
        answer) stay pinned for the next turn and in the prefix cache; its parameters."""
        inst = self.inst
        ids = continuation_ids(g.body, g.chat, self._token_ids(g, g.body, g.prompt), seq.tokens[0][:seq.n])
        cache = inst.prefix_cache
        hashes = None
        if cache is not None:
            hashes = block_hashes(ids, cache.block_size)
            cache.store(hashes, ids, g.lora)
        return inst.kv_reuse.keep(g.internal_id, ids, hashes)

    def _openai_body(self, g: GenerationRequest, seq: Sequence, kv_out: dict | None, ec_out: dict | None,
                     ncomp: int) -> dict:
        """vLLM 0.32's chat or completions response model, dumped whole (``model.model_dump()``)."""
        build = responses.chat_response if g.chat else responses.completion_response
        resp = build(resp_id=g.resp_id, created=self.inst.created, model=g.model,
                     texts=[seq.text(c) for c in range(g.n_choices)], finish_reason=seq.finish_reason,
                     fingerprint=self.inst.system_fingerprint,
                     usage=responses.usage(seq.prompt_tokens, ncomp, seq.cached_tokens),
                     kv_out=kv_out, ec_out=ec_out)
        if g.body.get("return_token_ids") is True:
            # The prompt's ids and each answer's, as the next turn's prompt spells them (what a
            # bidirectional decode keeps: ``continuation_ids``); completions carry the prompt's
            # on each choice, as vLLM does.
            ids = self._token_ids(g, g.body, g.prompt)
            if g.chat:
                resp["prompt_token_ids"] = ids
            for c, choice in enumerate(resp["choices"]):
                choice["token_ids"] = continuation_ids(g.body, g.chat, ids, seq.tokens[c][:seq.n])[len(ids):]
                if not g.chat:
                    choice["prompt_token_ids"] = ids
        return resp

    def _kv_key(self, g: GenerationRequest) -> str:
        """What held KV is checked against on load: the prompt, and the adapter's weights it was
        computed with (KV of another adapter, or of none, is refused like another prompt's)."""
        if g.lora is None:
            return g.prompt.hash_hex
        return f"{g.prompt.hash_hex}+lora:{self.inst.lora.path(g.lora)}"

    def on_prefilled(self, seq: Sequence) -> None:
        """The prompt's KV exists: hold it for (or push it to) the decoder. This happens when
        the prefill is computed, before the response is written, so faults on the response
        (error-after, stall-after, reset-after) leave the KV held or pushed, as with vLLM."""
        g: GenerationRequest = seq.ctx
        g.kv_out = self.inst.kv.produce(g.internal_id, g.prompt.tokens, self._kv_key(g), g.transfer_id,
                                        g.cached_tokens, g.read.wrong)
        if seq.rec is not None:
            seq.rec.kv = g.kv_out

    def on_error(self, seq: Sequence, message: str) -> None:
        """A generation failure (finish_reason "error"): 500, or in-band once streaming. vLLM
        says only "Internal server error" on the wire; the reason goes to the record and log."""
        self.stats.errors += 1
        self.stats.success["error"] += 1
        writer = seq.writer
        rec = seq.rec
        log.warning("%s: request %s failed: %s", self.inst.name, getattr(seq.ctx, "resp_id", "?"), message)
        api: ApiFormat | None = seq.ctx.api
        if api is not None:
            api.failed(seq.ctx)
        if writer.started:
            tail = (seq.error_head() + responses.STREAM_GENERATION_ERROR + DONE_EVENT if api is None
                    else api.stream_error(seq))
            if tail is None:
                writer.abort()
            else:
                writer.end(tail)
        else:
            writer.send(500, responses.GENERATION_ERROR_BODY if api is None else api.generation_error_body(),
                        headers=seq.ctx.headers)
            if rec is not None:
                rec.answered(500)
        if rec is not None:
            rec.ended(writer.bytes_sent)
            rec.error = message

    def on_reset(self, seq: Sequence) -> None:
        seq.ctx.reset = True
        rec = seq.rec
        if rec is not None:
            rec.ended(seq.writer.bytes_sent)
            rec.error = f"sim: connection reset after {seq.emitted} tokens (injected)"
        seq.writer.abort()
