"""Where every leg of one attempt goes, and why: one function, :func:`place`.

Its inputs are what the request is (its context: the models its legs must serve, the
instances that failed it or timed out on it, its routing view with the block index's answer,
whether it has media, whether it is served whole) and what is known (:class:`Known`: each
role's host set and policy, the connector, the bounds of the rules below), plus two answers
the shell looked up first, only when their feature applies: the decode holding the request's
previous response (Responses' ``previous_response_id``) and the conversation's previous turn
(:class:`PreviousTurn`, multi-turn KV reuse). Its answer is a :class:`Placement`: the decode,
the prefill (or none: the decode computes the prompt), where the previous turn's KV is read
from, the connector, the decode's data-parallel rank, and a short reason for each choice.

The rules, in order (each one a step here, none anywhere else):

0. *Every decode stands still* (each one that is neither draining nor failed the request is out
   as ``wedged``: requests waiting, none running, its KV full of blocks vLLM pins for a later
   turn): no decode gets the request, not even by panic routing (it would wait until the pins
   expire, minutes). A prefill in rotation answers it alone (a full engine of the same model:
   without KV parameters it generates and pins nothing), else it is refused at once, 503
   ``overloaded``. A decode that stands still while another runs is out of the host set
   already (``instances/pool.py``).
1. *Served whole* (an API the proxy does not split): the decode holding the previous response
   (refused at once when it stands still: no other instance holds the response), else the
   decode role's pick.
2. *The decode*: the role's pick (``choose.py``: the half-open trial share, LoRA affinity, the
   policy; never one that timed out on this request).
3. *The prefill*, while the topology has the role: the role's pick, on the decode's base for an
   adapter (its KV is valid only there).
4. *The previous turn* (multi-turn reuse): the decode holding it computes the new part alone
   when that part is small (``--local-prefill-max-tokens``), the decode runs few other streams
   and it is within the load bound; else the prefill reads it from there (pull connector only).
5. *The block index* (KV events): a decode holding all but a few of the prompt's tokens computes
   it alone (``routing/disaggregation.py``), unless the prefill reads a previous turn or the
   request has media.
6. *The encoders*: each media item's (``media.py``: the encode role's policy among the encoders
   with room, never one that failed the request); the items an encoder fails are placed again
   the same way by the encode stage.

The host lists read are replaced, never changed in place, on every change of state (a
snapshot); the only state written is the policies' own and the trial share's count, as one
pick would, and in the request the model key its prefill must serve (an adapter's, on the
decode's base). :func:`place` called again with more instances in the request's
``excluded`` is the placement made anew (a stream moved off its decode); :func:`again`
replaces only the decode (a decode that refused the KV hand-over: the prefill's KV stays).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import msgspec

from epd_proxy.encode.multimodal import MediaItem
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import ModelKey, paired_key
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import Choice, pick
from epd_proxy.placement.media import place_items
from epd_proxy.routing.disaggregation import decode_alone, skips_prefill
from epd_proxy.routing.view import RequestView
from epd_proxy.wire.errors import ProxyError

# The refusal when every decode stands still and no prefill can answer alone: the proxy's own
# capacity, in the client API's envelope (the code request/admission.py's refusals carry).
OVERLOADED = "overloaded"

# Why (the reasons that are not a policy's name or choose.py's).
OWNER = "holds the previous response"
HOLDS_TURN = "holds the previous turn: computes the new part alone"
HOLDS_PROMPT = "holds the prompt (KV events): computes the rest alone"
NO_PREFILL = "none: the decode computes the prompt"
READS_TURN = "reads the previous turn's KV from its decode"
HAND_OVER = "the KV handed over: the decode chosen refused the connection"
PREFILL_ALONE = "every decode wedged: the prefill answers alone"
# The connector name when no prefill runs.
DECODE_ONLY = "none"


class Asking(Protocol):
    """What the decision reads of a request (``request/context.RequestContext`` has it)."""

    excluded: set[Instance]
    timed_out: frozenset[Instance]
    view: RequestView
    models: dict[str, ModelKey] | None


@dataclass(slots=True)
class PreviousTurn:
    """The conversation's previous turn, kept here (multi-turn reuse): the decode holding its KV,
    and the tokens a prefill would compute beyond it (estimated)."""

    holder: Instance
    new_tokens: int


@dataclass(slots=True)
class Known:
    """What the decision knows besides the request: the roles' host sets (each with its policy
    and affinity), the connector, and the bounds of the rules (from the configuration)."""

    decode: InstancePool
    prefill: InstancePool
    connector: str = "nixl"  # --kv-connector: the connector when a prefill runs
    prefill_needed: bool = False  # the topology has prefill even while it has no instance
    local_prefill_max_tokens: int = 0
    local_prefill_max_streams: float = 0
    balance_abs: float = 4
    balance_rel: float = 1.5
    ec_consumer_dp_size: int = 1  # an EC consumer's data-parallel ranks (--ec-consumer-dp-size)
    encode: InstancePool | None = None  # the encoders (None: media items are not placed here)
    encode_outstanding: dict[str, int] = field(default_factory=dict)  # items in flight per encoder URL
    encode_bound: int = 0  # --encoder-max-outstanding (0: none)
    ranks: itertools.count = field(default_factory=itertools.count)  # the ranks' rotation
    ranked: bool = field(init=False)  # every decode has data-parallel ranks to rotate over

    def __post_init__(self) -> None:
        self.ranked = self.ec_consumer_dp_size > 1

    @property
    def pull(self) -> bool:
        """Whether the prefill can read a previous turn's KV (the pull connector)."""
        return self.connector == "nixl"


class Placement(msgspec.Struct, eq=False):
    """Where one attempt's legs go, and why. ``prefill`` None: the decode computes the prompt
    (``connector`` is then "none"); ``kv_from``: the decode whose KV of the previous turn the
    prefill reads; ``rank``: the decode's data-parallel rank for an EC consumer (None: any).
    A ``msgspec.Struct``: built in C, without the ``__init__`` frame of a dataclass, on every
    attempt."""

    decode: Instance
    decode_why: str
    prefill: Instance | None = None
    prefill_why: str = NO_PREFILL
    connector: str = DECODE_ONLY
    kv_from: Instance | None = None
    rank: int | None = None
    consumer_zmq: str | None = None  # where the encoders push the embeddings (an EC consumer's)
    declined: bool = False  # a previous turn small enough to skip the prefill, its decode too busy
    decode_among: Sequence[Instance] = ()
    prefill_among: Sequence[Instance] = ()
    # The media items placed now and their encoders, in the items' order (placement/media.py;
    # None: no encode leg, or no encoder could be placed: the encode stage says why).
    encoders: tuple[list, list] | None = None
    # The prefill placed first when a hedge answered in its place (request/legs/hedged.py).
    hedged: Instance | None = None

    def alternatives(self, role: str) -> list[Instance]:
        """The other candidates of a leg (``role``), least loaded first: where it would go next."""
        among = self.decode_among if role == "decode" else self.prefill_among
        chosen = self.decode if role == "decode" else self.prefill
        return sorted((c for c in among if c is not chosen), key=lambda c: c.inflight + c.signals.others)

    def reasons(self) -> dict[str, str]:
        """Per leg, where it went and why, in words (the debug log)."""
        out = {"decode": f"{self.decode.url}: {self.decode_why}"}
        out["prefill"] = NO_PREFILL if self.prefill is None else f"{self.prefill.url}: {self.prefill_why}"
        if self.kv_from is not None:
            out["kv"] = f"{self.kv_from.url}: {READS_TURN}"
        if self.hedged is not None:
            out["hedged"] = self.hedged.url
        return out

    def summary(self) -> dict:
        """Per leg, the instance (URL) and why, as plain data (the console's recent requests)."""
        prefill = self.prefill
        out = {"decode": {"instance": self.decode.url, "why": self.decode_why},
                "prefill": {"instance": None if prefill is None else prefill.url, "why": self.prefill_why},
                "kv_from": None if self.kv_from is None else self.kv_from.url, "connector": self.connector,
                "rank": self.rank}
        if self.hedged is not None:  # a hedge answered for the prefill placed first (its URL)
            out["hedged"] = self.hedged.url
        return out


def place(ask: Asking, known: Known, media: bool = False, turn: PreviousTurn | None = None, whole: bool = False,
          owner: Instance | None = None, items: Sequence[MediaItem] = ()) -> Placement:
    """The placement of one attempt (the rules in the module's docstring); ``items``: the media
    items the encoders get (none: no encode leg)."""
    placed = _place(ask, known, media, turn, whole, owner)
    if items and known.encode is not None:
        placed.encoders = _encoders(ask, known, items)
    return placed


def _place(ask: Asking, known: Known, media: bool, turn: PreviousTurn | None, whole: bool,
           owner: Instance | None) -> Placement:
    models = ask.models
    if known.decode.wedged and known.decode.standing(None if models is None else models["decode"], ask.excluded):
        return _ranked(known, _prefill_alone(ask, known))
    if whole:
        if owner is not None and owner not in ask.timed_out:
            if owner in known.decode.wedged:
                raise _overloaded("the instance holding the previous response is")
            return Placement(owner, OWNER)
        d = pick(known.decode, ask.excluded, ask.view, None if models is None else models["decode"], ask.timed_out)
        return Placement(d[0], d[1], decode_among=d[2])
    d = pick(known.decode, ask.excluded, ask.view, None if models is None else models["decode"], ask.timed_out)
    if models is not None:  # an adapter's KV is valid only on its base: prefill's must match
        models["prefill"] = paired_key(models["decode"], d[0].served)
    p: Choice | None = None
    if known.prefill.instances or known.prefill_needed:
        p = pick(known.prefill, ask.excluded, ask.view, None if models is None else models["prefill"], ask.timed_out)
    # Positional arguments (one Placement per attempt).
    if p is not None:
        placed = Placement(d[0], d[1], p[0], p[1], known.connector, None, None, None, False, d[2], p[2])
    else:
        placed = Placement(d[0], d[1], None, NO_PREFILL, DECODE_ONLY, None, None, None, False, d[2])
    if turn is not None:
        holder = turn.holder
        if known.local_prefill_max_tokens and _within_bound(known, ask, holder):
            if skips_prefill(turn.new_tokens, holder.inflight + holder.signals.others,
                             known.local_prefill_max_tokens, known.local_prefill_max_streams):
                return _ranked(known, _alone(placed, holder, HOLDS_TURN))
            placed.declined = turn.new_tokens <= known.local_prefill_max_tokens
        if placed.prefill is not None and known.pull:
            placed.kv_from = holder
            placed.prefill_why = READS_TURN
            return _ranked(known, placed)
    if placed.prefill is not None and not media and ask.view.held is not None:
        alone = _holding_prompt(known, ask, placed.decode)
        if alone is not None:
            return _ranked(known, _alone(placed, alone, HOLDS_PROMPT))
    spec = placed.decode.spec
    return _ranked(known, placed) if known.ranked or spec.dp_size > 1 or spec.ec_zmq_addrs else placed


def _prefill_alone(ask: Asking, known: Known) -> Placement:
    """Step 0: a prefill in rotation (or half-open) that has not failed the request, serving
    its model, answers it whole (counted on the decode role); else 503 ``overloaded`` at once."""
    model = None if ask.models is None else ask.models["decode"]
    prefill = known.prefill
    counts = known.decode.wedged_routing
    if _prefill_can(ask, prefill, model):
        chosen, _, among = pick(prefill, ask.excluded, ask.view, model, ask.timed_out)
        counts["prefill_alone"] += 1
        return Placement(chosen, PREFILL_ALONE, None, NO_PREFILL, DECODE_ONLY, None, None, None, False, among)
    counts["refused"] += 1
    raise _overloaded("the decode instances are")


def _prefill_can(ask: Asking, prefill: InstancePool, model: ModelKey | None) -> bool:
    """Whether a prefill in rotation or half-open, serving ``model``, has neither failed the
    request nor timed out on it (never a panic pick: a prefill that is out may be down)."""
    healthy, half_open, _ = prefill.hosts(model)
    gone, late = ask.excluded, ask.timed_out
    return any(i not in gone and i not in late for i in healthy) or any(
        i not in gone and i not in late for i in half_open)


def _overloaded(what: str) -> ProxyError:
    """503: every instance that could answer stands still (its pinned KV will free in time)."""
    return ProxyError(503, f"{what} at capacity; retry later", code=OVERLOADED)


def can_answer(ask: Asking, known: Known) -> bool:
    """Whether an instance that has not failed the request can take it now: a decode, or, with
    every decode standing still, a prefill alone (step 0)."""
    models = ask.models
    model = None if models is None else models.get("decode")
    decode = known.decode
    if decode.spare(ask.excluded, model):
        return True
    return bool(decode.wedged) and decode.standing(model, ask.excluded) and _prefill_can(ask, known.prefill, model)


def again(placed: Placement, ask: Asking, known: Known) -> Instance | None:
    """Another decode for a placement whose decode refused the connection before it saw the
    prefill's KV parameters (``ask.excluded`` has it now): on the prefill's base for an adapter;
    None when there is none left, or when this decode must be the one (the EC consumer of the
    request's embeddings, or a chosen data-parallel rank)."""
    if placed.rank is not None or placed.decode.spec.ec_zmq_addrs:
        return None
    model = None if ask.models is None else ask.models.get("decode")
    if model is not None:
        model = paired_key(model, placed.prefill.served if placed.prefill is not None else None)
    pool = known.decode
    if not pool.spare(ask.excluded, model):
        return None
    chosen, _, among = pick(pool, ask.excluded, ask.view, model)
    placed.decode, placed.decode_why, placed.decode_among = chosen, HAND_OVER, among
    return chosen


def another_decode(ask: Asking, known: Known) -> bool:
    """Whether a decode that has not failed the request can take it (or, every decode standing
    still, a prefill alone: step 0): a broken stream is continued only elsewhere (its own decode
    may be wedged, or gone), never back where it broke."""
    return can_answer(ask, known)


def moved_off_wedged(ask: Asking, known: Known, tried: Sequence[Instance]) -> bool:
    """Whether a failed attempt's decode (among ``tried``, the attempt's instances) was taken
    out for standing still while the request waited in its queue, never admitted, and failed
    over: placed again without counting against ``--decode-retries`` (the caller bounds these
    by the decodes; each excludes one more of them). Two decodes filling at once would otherwise
    spend a request's one retry on the second, wedged two seconds after the first."""
    wedged = known.decode.wedged
    return bool(wedged) and any(i in wedged and i in ask.excluded for i in tried)


def worth_retrying(ask: Asking, known: Known, unsent: bool) -> bool:
    """Whether a failed attempt is worth placing again. A retry runs prefill again: only worth
    it when a decode can take the request now (or, every decode standing still, a prefill
    alone: step 0), one that has not failed it, or one still in
    rotation that failed it for the request's sake (an HTTP 500, an in-band error), not by
    refusing it (``unsent``) or timing out. Otherwise the failure is the answer, and no
    prefill's KV is left held for a decode that will not read it."""
    decode = known.decode
    if not known.prefill.instances or can_answer(ask, known):
        return True
    return not unsent and any(i.healthy and i in ask.excluded and i not in ask.timed_out
                              for i in decode.instances)


def _encoders(ask: Asking, known: Known, items: Sequence[MediaItem]) -> tuple[list, list] | None:
    """Step 6: each media item's encoder (placement/media.py), among the encoders with room."""
    assert known.encode is not None
    models = ask.models
    try:
        return place_items(known.encode, items, exclude=ask.excluded, timed_out=ask.timed_out,
                           outstanding=known.encode_outstanding, bound=known.encode_bound,
                           model=None if models is None else models.get("encode"))
    except ProxyError:  # no encoder at all: the encode stage answers it, or falls back to the consumer
        return None


def _alone(placed: Placement, decode: Instance, why: str) -> Placement:
    placed.decode, placed.decode_why = decode, why
    placed.prefill, placed.prefill_why, placed.connector = None, NO_PREFILL, DECODE_ONLY
    return placed


def _ranked(known: Known, placed: Placement) -> Placement:
    """The decode's data-parallel rank and EC consumer address (E+PD with a push EC connector:
    the replica that receives the embeddings), in rotation over its ranks."""
    spec = placed.decode.spec  # its addresses: from its registration or --ec-consumer-zmq-addrs
    dp = spec.dp_size if spec.dp_size > 1 else known.ec_consumer_dp_size
    if dp > 1:
        placed.rank = next(known.ranks) % dp
    addrs = spec.ec_zmq_addrs
    if addrs:
        placed.consumer_zmq = addrs[(placed.rank or 0) % len(addrs)]
    return placed


def _within_bound(known: Known, ask: Asking, holder: Instance) -> bool:
    """Whether the decode holding a conversation is a candidate within the load bound routing
    keeps (``--balance-abs`` requests beyond the least-loaded candidate)."""
    models = ask.models
    candidates = known.decode.candidates(ask.excluded, None if models is None else models.get("decode"))
    if holder not in candidates:
        return False
    low = min(c.inflight + c.signals.others for c in candidates)
    return holder.inflight + holder.signals.others <= low + known.balance_abs


def _holding_prompt(known: Known, ask: Asking, chosen: Instance) -> Instance | None:
    """The decode that holds all but a few of the prompt (the block index says) and computes it
    alone (``routing/disaggregation.py``), or None: disaggregate."""
    view = ask.view
    if view.held is None or not view.tokens or known.local_prefill_max_tokens <= 0:
        return None
    models = ask.models
    candidates: Sequence[Instance] = known.decode.candidates(
        ask.excluded, None if models is None else models.get("decode"))
    if ask.timed_out:
        candidates = [c for c in candidates if c not in ask.timed_out]
    return decode_alone(candidates, view.held, view.live, view.tokens, chosen, view.anchor,
                        max_tokens=known.local_prefill_max_tokens, max_streams=known.local_prefill_max_streams,
                        balance_abs=known.balance_abs, balance_rel=known.balance_rel)
