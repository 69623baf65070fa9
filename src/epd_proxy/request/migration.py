"""A committed stream whose decode broke off, continued on another decode (issue: a stream
survives its decode).

After the commit point a chat, completions or generate stream is watched for four breaks: the
connection reset or closed before the terminator, decode's own in-band error event, the
instance ejected while streaming, and a stall: no read for ``stall_after`` (the stream's own
pace times :data:`STALL_PACES`, at least :data:`STALL_FLOOR` and at most :data:`STALL_CEILING`
seconds). Then the broken leg is aborted (its connection closed: vLLM aborts the request and
frees its KV) and released, what the client has received is parsed (the ``continuation`` package), the
placement is made again without that decode (its ``excluded``) and the continuation is opened
like any attempt (a prefill of the prompt plus the answer so far where the topology has one,
its prefix cache holding most of it). Its events reach the client as the same stream's. One
decode generates for a client at any time, at most ``limit`` times per request; past that, or
where continuing is unsound, the stream ends as it did before: an in-band error and the
terminator.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from time import perf_counter
from typing import TYPE_CHECKING, Awaitable, Callable

import msgspec

from epd_proxy.http.client import Response
from epd_proxy.http.response import ResponseWriter
from epd_proxy.http.transport import TransportTimeouts
from epd_proxy.instances.health import EJECTED, STALLED
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.pool import InstancePool
from epd_proxy.request.continuation import received, unsound
from epd_proxy.request.legs.stages import DecodeLeg, DecodeStage
from epd_proxy.request.relay import NOWHERE, StreamRelay
from epd_proxy.request.turns.answers import strip_token_ids, tokens_of
from epd_proxy.request.turns.reuse import tokenize_leg
from epd_proxy.request.turns.streams import MARK, strip_stream_params
from epd_proxy.request.usage.rewrite import rewrite_final_usage_events
from epd_proxy.wire.errors import ProxyError

if TYPE_CHECKING:
    from epd_proxy.request.context import RequestContext

log = logging.getLogger("epd_proxy.migration")

# The stall rule: no read for this many times the stream's mean gap between reads, bounded.
STALL_PACES = 10.0
STALL_FLOOR = 1.5
STALL_CEILING = 30.0
# How often the watched streams are looked at (never per event): a stream is found silent at
# most two looks past the rule (the look that saw its last read, the one that sees the rule
# passed), so with the 1.5 s floor a wedged decode's streams move within 1.7 s of their last
# event.
_TICK = 0.1
_IDLE_TICKS = 100  # the ticker ends after this many ticks (10 s) with no stream to watch
# A stream relayed in more reads than this is not kept for a continuation (memory: the reads
# are held by reference until the stream ends).
MAX_READS = 1 << 16

# Results, the metric's ``result`` label.
OK = "ok"  # the continuation finished the answer
FAILED = "failed"  # no decode could take the continuation: the stream ended in-band
LIMIT = "limit"  # the request's migration limit was reached: ended in-band
UNSOUND = "unsound"  # the answer cannot be continued exactly (a tool call, reasoning): ended in-band

OpenLeg = Callable[["RequestContext", dict], Awaitable[DecodeLeg]]
# A /tokenize call while a client's stream waits: bounded well under the stall rule's floor.
_TOKENIZE_TIMEOUTS = TransportTimeouts(connect=1.0, headers=2.0, idle=2.0)


def stall_after(events: int, since_first: float) -> float:
    """How long a stream may stay silent before it counts as broken: ``STALL_PACES`` times its
    mean gap between reads so far, within ``[STALL_FLOOR, STALL_CEILING]`` seconds."""
    pace = since_first / events if events else 0.0
    return min(max(STALL_FLOOR, STALL_PACES * pace), STALL_CEILING)


class Migrations:
    """The proxy's stream migration: on (``limit`` > 0) unless ``--no-stream-migration``."""

    def __init__(self, enabled: bool, limit: int, counts: dict[tuple[str, str], int],
                 decodes: InstancePool | None = None, stage: DecodeStage | None = None) -> None:
        self.limit = limit if enabled else 0
        self.counts = counts  # (reason, result) -> streams (the metrics' dict)
        self.decodes = decodes  # told of a stall (an instance signal); :meth:`_recount` asks one
        self.stage = stage  # decode's stage, for :meth:`_recount`'s /tokenize
        # The streams watched now: relay -> [its decode, its reads when last looked, since when].
        # One task looks at them all every _TICK while there are some (a stream adds an entry,
        # not a task or a timer).
        self.watched: dict[StreamRelay, list] = {}
        self._ticker: asyncio.Task | None = None

    def applies(self, path: str, body: dict, items: int) -> bool:
        """Whether this request's stream is watched and continued when it breaks."""
        return self.limit > 0 and not items and unsound(path, body) is None

    def watch(self, relay: StreamRelay, inst: Instance) -> None:
        """``relay``'s stream watched for a stall or its decode's ejection until :meth:`unwatch`."""
        relay.migrate = True
        relay.sent = []
        self.watched[relay] = [inst, -1, 0.0]  # the ticker's first look sets the rest
        if self._ticker is None:
            # In a context of its own: a copy of this request's would keep the request's
            # objects alive as long as the ticker runs.
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), context=contextvars.Context())

    def unwatch(self, relay: StreamRelay) -> None:
        self.watched.pop(relay, None)

    async def _tick(self) -> None:
        """Break off each watched stream that stalls past :func:`stall_after` or whose decode is
        ejected; a stream too long to keep is let go (it ends as before if it breaks)."""
        idle = 0
        try:
            while idle < _IDLE_TICKS:  # kept while streams come and go (a task is made again only after)
                await asyncio.sleep(_TICK)
                if not self.watched:
                    idle += 1
                    continue
                idle = 0
                self._look(perf_counter())
        finally:
            self._ticker = None

    def _look(self, now: float) -> None:
        """One look at every watched stream (in a call of its own: the ticker's frame, asleep
        between looks, holds no stream)."""
        for relay, state in list(self.watched.items()):
            if not relay.migrate or relay.broken is not None or relay.ended:
                continue
            inst, seen, since = state
            events = relay.events
            if events != seen:
                state[1], state[2] = events, now
            elif now - since > stall_after(events, since - relay.first_at):
                relay.break_off("stall")
                continue
            if inst.health.state is EJECTED:
                relay.break_off("ejected")
            elif len(relay.sent) > MAX_READS:
                relay.migrate = False
                relay.sent = deque(relay.sent, maxlen=2)  # its last two reads still kept (final_bytes)

    async def close(self) -> None:
        ticker = self._ticker
        if ticker is not None:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)

    def count(self, reason: str, result: str) -> None:
        key = (reason, result)
        self.counts[key] = self.counts.get(key, 0) + 1

    async def carry_on(self, writer: ResponseWriter, ctx: RequestContext, body: dict, leg: DecodeLeg,
                       relay: StreamRelay, hide: bool, open_leg: OpenLeg, moves: list,
                       settle: Callable[[asyncio.Task, bool], None], start: float) -> tuple[StreamRelay, DecodeLeg]:
        """``relay``'s stream broke: continued on other decodes until it ends (or ends in-band);
        returns the relay and leg that ended it. ``moves`` gets one (reason, result, from, to,
        when: seconds from ``start``, the request's arrival, took: seconds) per move, for the
        request's record; ``settle`` takes a broken leg's companion
        (push connectors' prefill) to cancel."""
        got = received(ctx.path, b"".join(relay.sent))
        relay.sent = NOWHERE
        while True:
            reason = relay.broken or "reset"
            t0 = perf_counter()
            broken = leg.inst
            if reason == "stall" and self.decodes is not None:
                # No read for the stall rule's time, its connection open: the instance stopped
                # answering (SIGSTOPped, hung), the signal a hedge's win gives. Streams stall
                # together on a wedged decode: a few of them take it out of rotation at once
                # (its pending requests failed over), not after the probes' timeouts.
                self.decodes.outliers.record_failure(
                    broken, "a stream silent past the stall rule, its connection open", STALLED, ctx)
            ctx.failed(broken)  # placed again without it
            ctx.release(broken)  # its connection is closed: vLLM aborted the request, its KV freed
            if leg.companion is not None:
                settle(leg.companion, False)
                leg.companion = None
            why = got.unsound or ("the answer was whole" if got.finished else None)
            if why is not None or got.id is None:
                return self._end(relay, leg, reason, UNSOUND, f"the answer cannot be continued ({why or 'no event'})",
                                 moves, broken, t0, start)
            if len(moves) >= self.limit:
                return self._end(relay, leg, reason, LIMIT, f"the migration limit ({self.limit}) was reached",
                                 moves, broken, t0, start)
            if self.stage is not None and hasattr(got, "recount"):
                await self._recount(ctx, got, body)
            log.info("request %s: decode %s broke off (%s) after %d tokens; continuing elsewhere",
                     ctx.request_id, broken.url, reason, got.tokens)
            path, api = ctx.path, ctx.api
            if got.via is not None:  # continued through another endpoint (Messages: chat's)
                ctx.path, ctx.api = got.via, None
            try:
                new = await open_leg(ctx, got.body(path, body))
            except ProxyError as err:
                return self._end(relay, leg, reason, FAILED, f"no decode could continue it: {err.message}",
                                 moves, broken, t0, start)
            finally:
                ctx.path, ctx.api = path, api
            moves.append((reason, OK, broken.url, new.inst.url, t0 - start, perf_counter() - t0))
            got.before = got.tokens
            follow = ContinuedRelay(writer, new.resp, got, hide and got.via is None, ctx)
            await self._follow(follow, new)
            if follow.broken is None:
                self.count(reason, OK)
                return follow, new
            relay, leg = follow, new
            moves[-1] = moves[-1][:1] + ("moved",) + moves[-1][2:]
            self.count(reason, "moved")

    async def _recount(self, ctx: RequestContext, got, body: dict) -> None:
        """The answer so far counted in tokens by a decode that has not failed the request
        (``got.recount``'s two ``/tokenize`` calls; Responses: a delta may hold several tokens),
        so the continuation's budget and the whole answer's usage are right. Any failure leaves
        the count as it was: the continuation goes on all the same."""
        pool, stage = self.decodes, self.stage
        assert pool is not None and stage is not None
        models = ctx.models
        spare = [i for i in pool.candidates(ctx.excluded, None if models is None else models.get("decode"))
                 if i not in ctx.excluded]
        if not spare:
            return
        found: list[list[int] | None] = []
        for asked in got.recount(body):
            called, t0 = len(ctx.legs), perf_counter()
            try:
                found.append(tokens_of(await stage.exchange(ctx, spare[0], "/tokenize", msgspec.json.encode(asked),
                                                             ctx.upstream_headers(), _TOKENIZE_TIMEOUTS)))
            except ProxyError:
                return
            finally:
                tokenize_leg(ctx, called, perf_counter() - t0)
        got.counted(*found)

    def _end(self, relay: StreamRelay, leg: DecodeLeg, reason: str, result: str, why: str, moves: list,
             broken: Instance, t0: float, start: float) -> tuple[StreamRelay, DecodeLeg]:
        """The stream ends as without migration: the in-band error and the terminator."""
        self.count(reason, result)
        moves.append((reason, result, broken.url, None, t0 - start, perf_counter() - t0))
        relay.migrate = False
        relay.broken = None
        said = f": {relay.said}" if relay.said else ""  # decode's own error message, kept
        relay.fail(ProxyError(502, f"decode stream broke off ({reason}{said}); {why}"))
        return relay, leg

    async def _follow(self, relay: ContinuedRelay, leg: DecodeLeg) -> None:
        """The continuation relayed to its end (or its own break: past the limit, the loop ends
        it in-band) on the committed stream."""
        writer = relay.writer
        writer.flow = relay
        if writer.writing_paused:
            relay.pause()
        self.watch(relay, leg.inst)
        resp = leg.resp
        try:
            if leg.first:
                relay.on_data(leg.first)
            relay.events, relay.first_at = 0, perf_counter()
            resp.relay(relay)
            await resp.wait()
        except Exception:
            pass  # the relay has ended the stream in-band, or says it broke
        finally:
            self.unwatch(relay)
            relay.last_at = perf_counter()
            relay.migrate = False  # a client gone ends the stream as before (no move)
            resp.close()
            relay.resp = None


class ContinuedRelay(StreamRelay):
    """The continuation's stream on the client's: each event parsed and made the stream's own
    (the received answer's ``own``: its id, created and model, no second role, the usage of the
    whole answer; the usage event taken out when the client did not ask for it). A stream that
    was continued pays this per event; one that never broke, nothing."""

    __slots__ = ("got", "hide", "ctx", "pending")

    def __init__(self, writer: ResponseWriter, resp: Response, got, hide: bool, ctx) -> None:
        super().__init__(writer, resp)
        self.got = got
        self.hide = hide
        self.ctx = ctx
        self.pending = b""

    def on_data(self, data: bytes) -> None:
        self.events += 1
        if self.broken is not None or self.ended:
            return
        data = self.pending + data if self.pending else data
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self.pending = data
            return
        self.pending = data[cut + 2:]
        events = data[:cut + 2]
        got = self.got
        report = self.ctx.prefill_report
        if report is not None and events.find(b'"usage"') >= 0:
            api = self.ctx.api
            if got.via is None and api is not None and api.usage_event:  # Responses' own fields
                events = api.client_events(events, report)
            else:
                events = rewrite_final_usage_events(events, report)
        if got.strip_ids and events.find(b'"token_ids"') >= 0:
            events = strip_token_ids(events)
        if events.find(MARK) >= 0:  # decode's parameters, in a Responses stream's last event
            events = strip_stream_params(events)[0]
        out = []
        for raw in events.split(b"\n\n"):
            at = raw.find(b"data: ")  # after a named event's ``event:`` line (Responses)
            if at < 0:
                continue
            payload = raw[at + 6:].strip()
            if payload == b"[DONE]":
                out.append(self.got.done())
                self.migrate = False
                continue
            try:
                event = msgspec.json.decode(payload)
            except msgspec.DecodeError:
                continue
            if not isinstance(event, dict):
                continue
            if got.is_error(event):
                if self.migrate:
                    self._out(out)
                    err = event.get("error", event)
                    self.said = err.get("message") if isinstance(err, dict) else None
                    self.break_off("error")
                    return
                out.append(self.got.error(event, raw))
                continue
            event.pop("kv_transfer_params", None)
            finished = got.finished
            own = got.own(event)
            if got.finished and not finished:
                self.migrate = False  # the answer is whole: a break from here ends as before
            if own is None:
                continue
            if "usage" in event and not event.get("choices"):
                self.prev, self.last = self.last, own  # the access log's usage
                if self.hide:
                    continue
            elif got.via is None and own.find(b'"usage":{') >= 0:  # Responses' response.completed
                self.prev, self.last = self.last, own
            out.append(own)
        self._out(out)

    def error_event(self, error: ProxyError) -> bytes:
        return self.got.in_band(error)

    def _out(self, out: list[bytes]) -> None:
        if out:
            self.writer.write(b"".join(out))

    def on_end(self) -> None:
        self.pending = b""
        super().on_end()
