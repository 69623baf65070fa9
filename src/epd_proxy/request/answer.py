"""What decode's answer goes through on its way to the client, composed in one place.

A whole answer passes through at most two transforms, in this order: *the turn's parameters*
(multi-turn reuse, ``turns/reuse.py``: decode's ``kv_transfer_params`` taken out and kept for
the conversation's next turn; or the token ids the proxy asked for, taken out), then *the
usage* (a P/D client's usage is the request's, ``usage/``; in another API's fields for Messages
and Responses). A stream's relay is composed from the same parts as one relay class
(``relay.py``): the usage of its final event rewritten and, when the client did not ask for it,
the usage event taken out (``UsageRelay``), the API's in-band error form (``ApiRelay``),
decode's bytes kept for the next turn (the ``Keeping`` relays) and the token ids the proxy
asked for taken out (``IdStrippingRelay``); at its end, decode's parameters kept or let go.

Each part applies only where the request needs it, decided here from the request (its API,
its body, whether it asked for usage) and its placement (a prefill ran: the usage is
rewritten; a decode asked for token ids): the pipeline asks for the answer, and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epd_proxy.http import Headers
from epd_proxy.http.response import ResponseWriter
from epd_proxy.request.apis import GENERATE, GenerationApi
from epd_proxy.request.legs.stages import DecodeLeg
from epd_proxy.request.migration import Migrations
from epd_proxy.request.relay import (
    ApiRelay,
    IdStrippingRelay,
    KeepingApiRelay,
    KeepingMovingApiRelay,
    KeepingUsageRelay,
    MovingApiRelay,
    StreamRelay,
    UsageRelay,
    kept_bytes,
    relay_stream,
)
from epd_proxy.request.turns.answers import NO_PARAMS, NO_PARAMS_TAIL, carries_params, strip_token_ids
from epd_proxy.request.turns.reuse import TurnReuse
from epd_proxy.request.turns.streams import MARK
from epd_proxy.request.usage.hidden import HiddenUsage
from epd_proxy.request.usage.rewrite import rewrite_answer_usage

if TYPE_CHECKING:
    from epd_proxy.request.context import RequestContext


class Answers:
    """Composes each request's answer chain; ``reuse``: multi-turn KV reuse (its store None
    with ``--no-kv-reuse``: answers still lose decode's parameters)."""

    def __init__(self, reuse: TurnReuse) -> None:
        self.reuse = reuse
        self.turns = reuse.store
        self.writes = reuse.writes  # kept turns on their way to the shared store (see :meth:`written`)

    async def written(self) -> None:
        """Wait until the turns kept so far are in the shared store: before the answer that made
        them is sent, so that a next turn on another replica finds them."""
        await self.reuse.written()

    def whole(self, ctx: RequestContext, body: dict, leg: DecodeLeg, api: GenerationApi | None
              ) -> tuple[bytes, tuple | None]:
        """A whole answer as the client gets it (then :meth:`written`, while ``writes`` has some),
        and its tokens when the usage rewrite read them (None: not read; ``usage_of`` reads them)."""
        answer = leg.body
        assert answer is not None
        # An answer without decode's parameters is told by its last bytes (inline: every
        # non-stream answer passes here; answers.carries_params is the whole test).
        if answer.find(NO_PARAMS, len(answer) - NO_PARAMS_TAIL) < 0 and carries_params(answer):
            answer = self.reuse.keep(ctx, body, leg, answer)
        elif ctx.ids_asked:
            answer = strip_token_ids(answer)
            self.reuse.answered_plain(ctx, leg.inst)  # a decode that keeps no blocks: not asked again
        report = ctx.prefill_report  # P/D: the client's usage is the request's (usage/rewrite.py)
        if report is None:
            return answer, None
        if api is None:
            return rewrite_answer_usage(answer, report)
        return (api.client_answer(answer, report) if api.rewrite_usage else answer), None

    async def stream(self, writer: ResponseWriter, ctx: RequestContext, body: dict, leg: DecodeLeg,
                     headers: Headers, hide: bool, api: GenerationApi | None,
                     migrations: Migrations | None = None) -> StreamRelay:
        """A stream relayed to the end through the relay composed for it; then decode's
        parameters, if its last event carried them, kept for the next turn or let go. With
        ``migrations`` the stream is watched, and ends broken (``relay.broken``) rather than
        in-band when its decode breaks off: the caller continues it (migration.py)."""
        report = ctx.prefill_report
        if api is not None and not api.rewrite_usage:
            report = None
        turns = self.turns
        if turns is None or not (turns.active or ctx.ids_asked):
            # No decode keeps blocks (yet): the plain relays, and a look at the last event.
            usage = hide or ((report is not None or leg.companion is not None)
                             and (_wants_usage(body) or (api is not None and api.usage_event)))
            relay = _relay(writer, leg, ctx if usage or migrations else None, hide, body, api, False, False,
                           migrations is not None)
            if migrations is not None:
                migrations.watch(relay, leg.inst)
            try:
                relay = await relay_stream(writer, relay, leg.first, headers, leg.companion)
            finally:
                if migrations is not None:
                    migrations.unwatch(relay)
            if turns is not None:
                final = relay.final_bytes()
                if final.find(MARK) >= 0:
                    # The first stream whose decode says it keeps blocks (vLLM 0.32's Responses
                    # stream, a later vLLM's chat or completions stream, in its last event):
                    # reuse is on from here; these blocks are let go.
                    self.reuse.keep_stream(ctx, body, leg, final, whole=False)
            return relay
        # Decodes keep blocks: the last event's parameters (turns/streams.py) taken out by a relay
        # that looks at the ending events, and with the token ids decode holds in the stream
        # (generate's; chat's and completions' when the client asked), the whole stream kept to
        # read the answer back for the next turn.
        asked = ctx.ids_asked  # the proxy asked for them: kept, and taken out of each event
        keeping = asked or ctx.path == GENERATE or (api is None and body.get("return_token_ids") is True)
        usage = hide or api is None or ((report is not None or leg.companion is not None)
                                        and (_wants_usage(body) or api.usage_event))
        relay = _relay(writer, leg, ctx if usage or migrations else None, hide, body, api, keeping, asked,
                       migrations is not None)
        if migrations is not None:
            migrations.watch(relay, leg.inst)
        try:
            relay = await relay_stream(writer, relay, leg.first, headers, leg.companion)
        finally:
            if migrations is not None:
                migrations.unwatch(relay)
        kept = kept_bytes(relay) if keeping else None
        whole = kept is not None
        if kept is None:
            kept = relay.final_bytes()  # the last event: its parameters, to let them go
        if kept.find(MARK) >= 0:
            self.reuse.keep_stream(ctx, body, leg, kept, whole)
        elif relay.error is None and relay.broken is None and api is None:
            self.reuse.stream_ended_plain(ctx, leg.inst, body)
        return relay


def _relay(writer: ResponseWriter, leg: DecodeLeg, usage_ctx, hide: bool, body: dict, api: GenerationApi | None,
           keeping: bool, strip_ids: bool, moving: bool = False) -> StreamRelay:
    """The relay a stream needs: with ``usage_ctx`` (the request's context) the final usage event
    rewritten, and with ``hide`` taken out (UsageRelay); with ``api`` an in-band error in its form
    (ApiRelay); ``keeping``: decode's bytes kept too, for the parameters of its last event;
    ``moving``: Messages' and Responses' reads kept for a continuation (MovingApiRelay);
    ``strip_ids`` (with ``usage_ctx``): the token ids the proxy asked for kept and taken out of
    what the client gets (IdStrippingRelay)."""
    resp = leg.resp
    if api is not None and api.usage_event:
        if moving:  # continued elsewhere when it breaks: its reads kept (``usage_ctx`` is the context)
            return (KeepingMovingApiRelay if keeping else MovingApiRelay)(writer, resp, api, usage_ctx, leg.first)
        return (KeepingApiRelay if keeping else ApiRelay)(writer, resp, api, usage_ctx, leg.first)
    if usage_ctx is not None:
        cls = IdStrippingRelay if strip_ids else KeepingUsageRelay if keeping else UsageRelay
        return cls(writer, resp, usage_ctx, HiddenUsage() if hide else None, body.get("n") in (None, 1))
    if api is not None:
        return (KeepingApiRelay if keeping else ApiRelay)(writer, resp, api, None, leg.first)
    return StreamRelay(writer, resp)


def _wants_usage(body: dict) -> bool:
    """A stream whose client asked for the usage event (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
