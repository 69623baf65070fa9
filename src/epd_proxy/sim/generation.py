"""Generation requests (``POST /v1/chat/completions`` and ``/v1/completions``, and through an
:class:`~epd_proxy.sim.api_format.ApiFormat` the other generation APIs) on one simulated
instance: validation, the role's behaviour, and the sequence that answers (its callbacks,
which write the answer, are ``answers.py``'s ``AnswerWriter``).

A request goes through named steps, in vLLM's order:

1. :meth:`GenerationHandler._parse` -- content type and JSON;
2. :meth:`~GenerationHandler._apply_faults` -- faults that act before any work;
3. :meth:`~GenerationHandler._validate` -- vLLM's request validation;
4. :meth:`~GenerationHandler._assign_role` -- what the role makes of ``kv_transfer_params``;
5. :meth:`~GenerationHandler._local_work` -- encoding (encoder) or prefill and EC loads
   (everyone else), which set the time to the first token;
6. :meth:`~GenerationHandler._sequence` -- the engine sequence that writes the answer;
7. :meth:`~GenerationHandler._run` -- into the engine, after loading remote KV if any.

The engine then calls back :meth:`~epd_proxy.sim.answers.AnswerWriter.on_prefilled` (KV
exists), :meth:`~epd_proxy.sim.answers.AnswerWriter.on_complete`,
:meth:`~epd_proxy.sim.answers.AnswerWriter.on_error` or
:meth:`~epd_proxy.sim.answers.AnswerWriter.on_reset`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import msgspec

from epd_proxy.sim import faults as _faults
from epd_proxy.sim import responses
from epd_proxy.sim.answers import AnswerWriter, GenerationRequest
from epd_proxy.sim.api_format import ApiFormat, EventSequence, NullWriter
from epd_proxy.sim.ec_store import empty_embeds_refusal, encode_groups, load_for_consumer, mixing_refusal
from epd_proxy.sim.engine import DONE, Sequence
from epd_proxy.sim.host import SimHost
from epd_proxy.sim.prefix_cache import block_hashes
from epd_proxy.sim.records import SimRecord, TeeWriter
from epd_proxy.sim.responses import SSE, refusal
from epd_proxy.sim.tokens import (
    Prompt,
    PromptError,
    _seed_bytes,
    analyze,
    answer_chunk_ids,
    media_tokens,
    output_tokens,
)
from epd_proxy.sim.validation import (
    UNSUPPORTED_MEDIA_TYPE,
    ApiError,
    Checked,
    check_lengths,
    check_request,
    json_error,
    schema_error,
)

log = logging.getLogger("epd_proxy.sim")
_encode = msgspec.json.encode
_decode = msgspec.json.decode


class GenerationHandler(AnswerWriter):
    """Serves the generation routes of one instance."""

    def __init__(self, inst: SimHost) -> None:
        super().__init__(inst)
        self._counter = 0

    async def serve(self, req, writer, chat: bool, api: ApiFormat | None = None) -> None:
        inst = self.inst
        self.stats.requests += 1
        self._counter += 1
        rec = inst.new_record(req, time.monotonic())
        if rec is not None:
            # Response bodies are kept for failures always, for successes with record_responses.
            writer = TeeWriter(writer, rec)
        g = GenerationRequest(chat, api)
        try:
            await self._serve(req, writer, g, rec, self._counter)
        except asyncio.CancelledError:
            # The client went away (or the instance crashed) before the end.
            seq = g.seq
            if seq is None or seq.state != DONE:
                if seq is not None and inst.engine is not None:  # a sequence was submitted to it
                    inst.engine.retire(seq)
                if rec is not None:
                    rec.ended(writer.bytes_sent)
                if inst.crashed:
                    if rec is not None:
                        rec.error = f"{inst.name} crashed"
                else:
                    # Only the simulator's own counter: vLLM counts a client's disconnect in
                    # no vllm:request_success_total reason.
                    self.stats.aborted += 1
                    if rec is not None:
                        rec.aborted = True
            raise
        finally:
            if g.lora is not None:
                inst.lora.release(g.lora)

    async def _serve(self, req, writer, g: GenerationRequest, rec: SimRecord | None, counter: int) -> None:
        inst = self.inst
        # Identity of this request: vLLM uses X-Request-Id when there is one.
        rid_h = req.headers.get(b"x-request-id")
        base = rid_h.decode("latin-1") if rid_h else hashlib.sha256(
            f"{inst.created}/{inst.name}/{counter}".encode()).hexdigest()[:32]
        g.headers = [(b"x-request-id", rid_h or base.encode())] if self.config.echo_request_id else None
        try:
            body = self._parse(req, rec)
            if g.api is not None:
                body = g.api.translate(body)
                base = (None if rid_h else g.api.request_id(body)) or base
            plan = await self._apply_faults(req, body, rec)
            checked, body, prompt, n_out, by_length = self._validate(body, g.chat)
            if rec is not None:
                rec.stream = checked.stream
            remote_kv = self._assign_role(g, body.get("kv_transfer_params"), plan)
            if inst.role == "encode":
                n_out, by_length = 0, False
            if g.reuse is not None:
                await self._read_decode_kv(g, body, prompt)
            ttft_ms, gen_error = self._local_work(g, body, prompt, remote_kv is not None)
            if gen_error is None:
                gen_error = g.read.failure
            if inst.role != "encode" and inst.lora.path(body.get("model")) is not None:
                g.lora = body["model"]
                ttft_ms += inst.lora.acquire(g.lora)  # waits while the adapter is swapped into a slot
        except ApiError as exc:
            return inst.send_error(writer, rec, exc, g.headers, None if g.api is None else g.api.error_body(exc))
        g.body = body
        self._name(g, base, counter)
        # vLLM answers with the served name the request gave, else its first (whatever the request said).
        name = body.get("model")
        g.model = name if isinstance(name, str) and (name in self.config.served_names or g.lora) else self.config.model
        g.prompt = prompt
        g.n_choices = checked.n
        detached = g.api is not None and g.api.detach(g, writer)
        if detached:
            # The answer went out (a background response); the generation goes on by itself.
            if rec is not None:
                rec.t_headers = rec.t_end = time.monotonic()
                rec.status = 200
                if not self.config.record_responses:
                    rec.response_chunks = None
            writer, rec = NullWriter(), None
        seq = self._sequence(g, writer, rec, checked, n_out, by_length, ttft_ms, plan)
        if checked.stream:
            writer.start(200, SSE, g.headers)
            if rec is not None:
                rec.answered(200)
            if g.api is not None:
                writer.write(g.api.stream_open(g))
        if gen_error is not None:
            seq.state = DONE
            self.on_error(seq, gen_error)
            return
        g.seq = seq
        if detached:
            assert g.api is not None
            g.api.started(g, inst.spawn(self._background(seq, remote_kv)))
            return
        await self._run(g, seq, remote_kv)

    async def _background(self, seq: Sequence, remote_kv: dict | None) -> None:
        """A detached request's generation; cancelling it aborts the request, as vLLM's engine
        aborts a cancelled background response."""
        try:
            await self._run(seq.ctx, seq, remote_kv)
        except asyncio.CancelledError:
            if seq.state != DONE and self.inst.engine is not None:
                self.inst.engine.retire(seq)
                self.stats.success["abort"] += 1
            raise

    # -- steps ---------------------------------------------------------------------------
    @staticmethod
    def _parse(req, rec: SimRecord | None) -> object:
        """Content type and JSON, as pydantic's request parsing refuses them."""
        ct = req.headers.get(b"content-type", b"")
        if ct.split(b";", 1)[0].strip().lower() != b"application/json":
            raise schema_error([UNSUPPORTED_MEDIA_TYPE])
        try:
            body = _decode(req.body)
        except msgspec.DecodeError:
            raise json_error(req.body) from None
        if rec is not None:
            rec.json = body
            rec.stream = isinstance(body, dict) and body.get("stream") is True
        return body

    async def _apply_faults(self, req, body: object, rec: SimRecord | None) -> _faults.FaultPlan | None:
        """The request's faults; those that act before any work act here (``status`` raises
        the refusal, ``hang`` and ``crash`` never return)."""
        inst = self.inst
        try:
            plan = inst.faults.plan(req.headers.get(b"x-sim-fault"), body if isinstance(body, dict) else {})
        except _faults.FaultSyntaxError as exc:
            raise refusal(400, f"sim: {exc}", "x-sim-fault") from None
        if plan is None:
            return None
        self.stats.faults += 1
        if rec is not None:
            rec.fault = plan.describe
        if plan.unhealthy:
            inst.set_unhealthy_for(plan.unhealthy)
        if plan.crash:
            inst.spawn(inst.crash_and_restart(plan.crash_restart))
            await _forever()
        if plan.delay:
            await asyncio.sleep(plan.delay)
        if plan.hang or (plan.hang_item is not None and isinstance(body, dict)
                         and _faults.media_matches(body, plan.hang_item)):
            await _forever()
        if plan.status is not None:
            raise refusal(plan.status, f"sim: injected fault status={plan.status} on {inst.name}")
        return plan

    def _validate(self, body: object, chat: bool) -> tuple[Checked, dict, Prompt, int, bool]:
        """vLLM's request validation, in its order: the request schema, the model, the prompt,
        the token budget. Returns the checked request, the (converted) body, the prompt, the
        output length and whether it is cut by length."""
        cfg = self.config
        checked = check_request(body, chat)
        body = checked.body
        model = body.get("model")
        if cfg.check_model and model and model not in cfg.served_names and self.inst.lora.path(model) is None:
            raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {', '.join(cfg.served_names)}.",
                           "NotFoundError", "model")
        try:
            prompt = analyze(body, chat, self.inst.ec_store.content_of)
        except PromptError as exc:
            raise ApiError(400, str(exc), "BadRequestError") from None
        mixed = mixing_refusal(prompt.media)
        if mixed is not None:
            raise ApiError(400, mixed, "BadRequestError")
        n_out, by_length = check_lengths(body, chat, prompt.tokens, cfg.max_model_len, checked.n,
                                         exact_prompt=prompt.exact, natural_len=cfg.default_max_tokens)
        return checked, body, prompt, n_out, by_length

    def _assign_role(self, g: GenerationRequest, kv: dict | None, plan: _faults.FaultPlan | None) -> dict | None:
        """What this role does with ``kv_transfer_params``: a KV producer marks the request to
        hold its KV (``g.hold_kv``); a KV consumer returns the params to load from."""
        inst = self.inst
        cfg = self.config
        role = inst.role
        if role not in ("prefill", "decode"):
            return None
        produce = kv is not None and kv.get("do_remote_decode") is True
        if cfg.strict_roles:
            if role == "prefill" and not produce:
                raise refusal(
                    400, f"sim: {inst.name} is a prefill (KV producer) instance and needs "
                    "kv_transfer_params.do_remote_decode=true; without it nothing is kept for a decoder "
                    "(a request meant for a decoder or a plain instance was sent to a prefiller; "
                    "SimConfig.strict_roles)", "kv_transfer_params")
            if role == "decode" and produce:
                raise refusal(
                    400, f"sim: {inst.name} is a decode (KV consumer) instance but got "
                    "kv_transfer_params.do_remote_decode=true (a prefill request sent to a decoder; "
                    "SimConfig.strict_roles)", "kv_transfer_params")
        if produce:
            assert kv is not None
            if cfg.kv_connector != "nixl":
                tid = kv.get("transfer_id")
                if not isinstance(tid, str) or not tid:
                    raise refusal(
                        400, f"sim: {inst.name} runs the {cfg.kv_connector} connector: "
                        "kv_transfer_params.transfer_id is required to pair the prefill with its decode",
                        "kv_transfer_params")
                g.transfer_id = tid
            g.hold_kv = True
            g.drop_kv = plan is not None and plan.drop_kv
            if cfg.bidirectional and kv.get("remote_engine_id") and kv.get("remote_request_id"):
                g.reuse = kv  # decode's parameters: read the previous turn from it
            return None
        if kv and kv.get("do_remote_prefill") is True and (role == "decode" or not cfg.strict_roles):
            return kv
        return None

    def _local_work(self, g: GenerationRequest, body: dict, prompt: Prompt,
                    remote_kv: bool) -> tuple[float, str | None]:
        """The work before the first token: an encoder encodes its distinct items (those not
        in its cache); any other instance without remote KV prefills the prompt (the part not
        in its prefix cache) and loads (or encodes) its media. Returns the time to the first
        token (ms) and a generation failure, if any."""
        inst = self.inst
        cfg = self.config
        st = self.stats
        if inst.role == "encode":
            g.ec_groups = groups = encode_groups(prompt.media)
            return self._encode_ms(groups), None
        if remote_kv:
            return 0.0, None
        if cfg.ec_connector == "example" and prompt.media:
            refused = empty_embeds_refusal(prompt.media)
            if refused is not None:
                raise refusal(400, refused)
        st.local_prefills += 1
        g.cached_tokens = cached = self._cached_prefix(g, body, prompt)
        covered = max(cached, g.read.tokens and g.read.tokens + g.read.start)
        g.computed = computed = prompt.tokens - covered
        st.local_prompt_tokens += computed
        ec = load_for_consumer(inst.ec_store, prompt.media, inst.name)
        st.ec_hits += ec.hits
        st.local_encodes += ec.local_encodes
        if ec.error is not None:
            st.ec_failures += 1
        extra = cfg.local_encode_ms_per_item * ec.local_encodes
        return cfg.ttft_ms + cfg.ttft_per_token_ms * computed + extra, ec.error

    def _cached_prefix(self, g: GenerationRequest, body: dict, prompt: Prompt) -> int:
        """Look the prompt up in the prefix cache and keep its blocks there (vLLM caches a
        request's full blocks when it schedules them); returns the tokens found cached."""
        cache = self.inst.prefix_cache
        if cache is None:
            return 0
        hashes = block_hashes(ids := self._token_ids(g, body, prompt), cache.block_size)
        cached = cache.lookup(hashes, prompt.tokens)
        cache.store(hashes, ids, g.lora)
        return cached

    async def _read_decode_kv(self, g: GenerationRequest, body: dict, prompt: Prompt) -> None:
        """Bidirectional transfer, on a prefill given decode's parameters: read from that
        decode the previous turn's KV beyond this prefill's own prefix cache (``g.read``)."""
        assert g.reuse is not None
        st = self.stats
        ids = self._token_ids(g, body, prompt)
        cache = self.inst.prefix_cache
        cached = 0 if cache is None else cache.peek(block_hashes(ids, cache.block_size), prompt.tokens)
        g.read = read = await self.inst.kv_reuse.read(g.reuse, ids, cached)
        read.start = cached
        st.external_queried_tokens += prompt.tokens - cached
        if read.failure is not None:
            st.kv_reuse_failures += 1
            st.kv_pull_failures += 1
        elif read.tokens:
            st.kv_pulls += 1
            st.external_cached_tokens += read.tokens
            st.add_kv_transfer(-(-read.tokens // self.config.block_size) * self.config.kv_bytes_per_block)
            if read.wrong:
                st.wrong_answers += 1

    def _encode_ms(self, groups: dict[str, dict]) -> float:
        """An encoder's time for its distinct items: nothing for an item in its cache, else
        a fixed cost plus one proportional to the item's size."""
        cfg = self.config
        cache = self.inst.encoder_cache
        ms = 0.0
        for mm_hash, group in groups.items():
            tokens = media_tokens(group["family"], group["metadata"])
            if cache is not None and cache.lookup(mm_hash, tokens):
                continue
            ms += cfg.encode_ms_per_item + cfg.encode_ms_per_mm_token * tokens
            self.inst.stats.encoded_tokens += tokens
        self.inst.stats.encode_ms += ms
        return ms

    def _name(self, g: GenerationRequest, base: str, counter: int) -> None:
        """The response id and vLLM's internal request id (what ``remote_request_id`` names)."""
        inst = self.inst
        suffix = hashlib.sha256(f"{inst.engine_id}/{inst.created}/{counter}".encode()).hexdigest()[:8]
        if g.api is not None:
            g.resp_id, g.internal_id = g.api.ids(base, suffix, g.body)
        elif g.chat:
            g.resp_id = "chatcmpl-" + base
            g.internal_id = f"chatcmpl-{base}-{suffix}"
        else:
            g.resp_id = "cmpl-" + base
            g.internal_id = f"cmpl-{base}-0-{suffix}"

    def _sequence(self, g: GenerationRequest, writer, rec: SimRecord | None, checked: Checked,
                  n_out: int, by_length: bool, ttft_ms: float, plan: _faults.FaultPlan | None) -> Sequence:
        """The engine sequence that produces the request's tokens and writes its answer."""
        inst = self.inst
        stream = checked.stream
        seed = _seed_bytes(g.body, None if g.lora is None else inst.lora.path(g.lora))
        fp = g.prompt.fingerprint
        if g.read.wrong:
            fp = _wrong(fp)  # computed over another prompt's KV: vLLM answers, wrongly
        tokens = [output_tokens(fp, seed, n_out, c) for c in range(g.n_choices)]
        head = b""
        include_usage = continuous = False
        if stream:
            if g.api is None:
                head = responses.stream_head(g.resp_id, g.chat, inst.created_bytes, g.model)
            include_usage = checked.include_usage
            continuous = checked.continuous_usage
        seq = (Sequence if g.api is None or not stream else EventSequence)(
            writer=writer, rec=rec, stream=stream, chat=g.chat, tokens=tokens, prompt_tokens=g.prompt.tokens,
            ttft=ttft_ms / 1000.0, finish_reason="length" if by_length else "stop", head=head,
            include_usage=include_usage, continuous_usage=continuous, split=self.config.split_utf8,
            on_complete=self.on_complete, on_error=self.on_error, on_reset=self.on_reset, ctx=g,
            fingerprint=inst.fingerprint_json)
        if isinstance(seq, EventSequence):
            assert g.api is not None
            seq.fmt = g.api
        if g.hold_kv and not g.drop_kv:
            seq.on_ready = self.on_prefilled
        cfg = self.config
        if cfg.chunked_prefill_tokens > 0 and g.computed > 0:
            # Chunked prefill: the computed tokens go through the engine's steps.
            seq.prefill_tokens = g.computed
            seq.ttft = max(ttft_ms - cfg.ttft_per_token_ms * g.computed, 0.0) / 1000.0
        if self.config.prompt_tokens_details or (g.api is not None and g.api.always_cached):
            seq.cached_tokens = g.cached_tokens
        if stream and g.chat and g.api is None and g.body.get("return_token_ids") is True:
            # The ids a non-stream answer carries (_openai_body), spread over the chunks.
            seq.prompt_ids_json = _encode(self._token_ids(g, g.body, g.prompt))
            seq.chunk_ids = [[_encode(ids) for ids in answer_chunk_ids(t)] for t in tokens]
        if plan is not None and plan.streams_tokens:
            seq.set_faults(plan.error_after, plan.reset_after, plan.stall_after, plan.stall_seconds,
                           plan.slow_body)
        seq.done = asyncio.get_running_loop().create_future()
        return seq

    async def _run(self, g: GenerationRequest, seq: Sequence, remote_kv: dict | None) -> None:
        """Into the engine. A decode with remote KV is admitted first (it holds a slot while
        the KV loads, as vLLM's WAITING_FOR_REMOTE_KVS), then loads it."""
        inst = self.inst
        cfg = self.config
        st = self.stats
        engine = inst.engine
        assert engine is not None  # started with the instance
        loop = asyncio.get_running_loop()
        if remote_kv is None:
            engine.submit(seq)
            await seq.done  # type: ignore[misc]  # set by _submit's caller
            return
        seq.needs_load = True
        seq.admitted = loop.create_future()
        engine.submit(seq)
        await seq.admitted
        st.external_queried_tokens += g.prompt.tokens
        ok, info = await inst.kv.load(remote_kv, self._kv_key(g))
        if seq.state == DONE:
            return
        if not ok:
            st.kv_pull_failures += 1
            if cfg.kv_failure_delay_ms > 0:
                # Real NIXL notices a dead peer only after its handshake timeout.
                await asyncio.sleep(cfg.kv_failure_delay_ms / 1000.0)
                if seq.state == DONE:
                    return
            self.on_error(seq, info)
            engine.retire(seq)
            return
        ntok, nblocks, wrong = info
        if wrong:
            seq.tokens = [output_tokens(_wrong(g.prompt.fingerprint), _seed_bytes(g.body), seq.n, c)
                          for c in range(g.n_choices)]
        local = 0
        if cfg.bidirectional and inst.prefix_cache is not None:
            # A decode that keeps what it served finds earlier turns in its own prefix cache and
            # pulls only the blocks beyond them, as vLLM's connector asks only for those.
            local = self._cached_prefix(g, g.body, g.prompt)
            nblocks = max(nblocks - local // cfg.block_size, 0)
        st.kv_pulls += 1
        st.external_cached_tokens += max(ntok - local, 0)
        if cfg.kv_connector != "mooncake":
            st.add_kv_transfer(nblocks * cfg.kv_bytes_per_block)
        if cfg.prompt_tokens_details or (g.api is not None and g.api.always_cached):
            seq.cached_tokens = _reported_cached_tokens(remote_kv, ntok)
        engine.ready(seq, loop.time() + cfg.kv_load_ms / 1000.0)
        await seq.done  # type: ignore[misc]  # set by _submit's caller



def _reported_cached_tokens(kv: dict, loaded: int) -> int:
    """What a decode reports as cached after a KV load, as vLLM 0.31+ does: the prefill's own
    prefix-cache hits when the params carry them (``remote_prefill_cached_tokens``), else
    the tokens it loaded (vLLM 0.30, or a producer that does not send the field)."""
    remote = kv.get("remote_prefill_cached_tokens")
    if isinstance(remote, int) and not isinstance(remote, bool):
        return remote
    return loaded


def _wrong(fingerprint: bytes) -> bytes:
    """The fingerprint a wrong answer is drawn from (KV of another prompt was read)."""
    return hashlib.sha256(b"wrong-kv\x00" + fingerprint).digest()


async def _forever() -> None:
    await asyncio.get_running_loop().create_future()
