"""Per-request state that outlives a single attempt: the id, what failed, what is in flight."""

from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING

import msgspec

from epd_proxy.http import Headers
from epd_proxy.instances.instance import Instance
from epd_proxy.instances.models import ModelKey
from epd_proxy.routing.view import EMPTY_VIEW, RequestView

if TYPE_CHECKING:
    from epd_proxy.observe.tracing import RequestTrace
    from epd_proxy.placement.decision import Placement
    from epd_proxy.placement.steered import Steered
    from epd_proxy.request.apis import GenerationApi
    from epd_proxy.request.turns.multiturn import KVReuse
    from epd_proxy.request.usage.rewrite import PrefillReport

_JSON_HEADER = (b"content-type", b"application/json")
_NONE: frozenset = frozenset()


class RequestContext(msgspec.Struct, eq=False):
    """What every stage of one client request shares.

    ``excluded`` collects the instances that failed this request, so a retry
    prefers others; ``hold``/``release`` keep each instance's in-flight count
    (the least-loaded policy's signal) exact even when a request is cancelled.

    A ``msgspec.Struct``: built in C with its defaults (the empty collections copied), without
    the ``__init__`` frame a class pays on every request. Made with the request's id, its path
    and the headers every upstream call carries (``--upstream-api-key``'s, the forwarded ones).
    """

    request_id: str
    path: str
    _base_headers: Headers
    excluded: set[Instance] = set()
    timings: dict[str, float] = {}
    upstream: float = 0.0  # wall time in the stage phases (the proxy's overhead is the rest)
    # The routing keys, when a policy reads them (the one EMPTY_VIEW else, from a C callable:
    # a Struct default must be immutable or made by a factory).
    view: RequestView = msgspec.field(default_factory=repeat(EMPTY_VIEW).__next__)
    _first_headers: tuple | None = None  # upstream_headers' first two, for this request's id
    # The instances whose legs are open (``hold``; the stages append inline on every leg).
    held: list[Instance] = []
    # Prompt tokens counted in instances' backlog for this request (``queue``), with KV events.
    _backlog: list[tuple[Instance, int]] | None = None
    legs: list[Instance] = []  # every instance called, in order (the access log's record)
    trace: RequestTrace | None = None  # when tracing is on
    # The prefill's answer about the prompt (usage/rewrite.py), for the client's usage; set by
    # the prefill stage, cleared at each attempt's start.
    prefill_report: PrefillReport | None = None
    # The instances that timed out on this request: no attempt goes back to them.
    timed_out: frozenset[Instance] = _NONE
    # A generation API besides chat and completions (apis.py), and then ``whole``: why
    # it is served by one instance (None: disaggregated). Only set with ``api``.
    api: GenerationApi | None = None
    whole: str | None = None
    # Per role, the model its instances must serve (instances/models.py); None: any
    # instance serves it (one set of models in the cluster, the common case).
    models: dict[str, ModelKey] | None = None
    # Multi-turn KV reuse (multiturn.py): the client's conversation_id hint, whether this
    # request looked for its previous turn's parameters (once: never on a retry), and
    # the parameters the prefill gets instead of the plain ones.
    conversation: str | None = None
    turn_tried: bool = False
    kv_reuse: KVReuse | None = None
    ids_asked: bool = False  # decode was asked for token ids the client did not ask for
    kv_outcome: str | None = None  # the turn's outcome (turns/outcomes.py), once looked up
    tokenized: list[Instance] | None = None  # instances that tokenized the prompt for the token check
    # The scope of the client key the request presented (tenants/key_scope.py): what it
    # stores or reads back (responses, turns, media uuids) is its key's. None without keys.
    scope: bytes | None = None
    placement: Placement | None = None  # the last attempt's (placement/decision.py)
    steered: Steered | None = None  # what the gateway named (placement/steered.py; the sidecar)

    def upstream_headers(self, request_id: str | None = None, extra: Headers | None = None) -> Headers:
        if not request_id:
            first = self._first_headers  # made once: a request has two or more legs
            if first is None:
                first = self._first_headers = (_JSON_HEADER, (b"x-request-id", self.request_id.encode()))
            headers = [*first, *self._base_headers]
        else:
            headers = [_JSON_HEADER, (b"x-request-id", request_id.encode()), *self._base_headers]
        if extra:
            headers += extra
        return headers

    def model_for(self, role: str) -> ModelKey | None:
        """What ``role``'s candidates must serve for this request (None: any instance)."""
        models = self.models
        return None if models is None else models.get(role)

    def failed(self, inst: Instance) -> None:
        self.excluded.add(inst)

    def timed_out_on(self, inst: Instance) -> None:
        self.timed_out = self.timed_out | {inst}

    def timing(self, stage: str, seconds: float) -> None:
        self.timings[stage] = self.timings.get(stage, 0.0) + seconds

    def hold(self, inst: Instance) -> None:
        inst.inflight += 1
        self.held.append(inst)
        self.legs.append(inst)

    def release(self, inst: Instance) -> None:
        try:
            self.held.remove(inst)
        except ValueError:
            return
        inst.inflight -= 1
        if self._backlog is not None:
            self._unqueue(inst)
        if self.trace is not None:
            self.trace.end(inst)

    def release_all(self) -> None:
        for inst in self.held:
            inst.inflight -= 1
        self.held.clear()
        if self._backlog is not None:
            self._unqueue(None)

    def queue(self, inst: Instance, tokens: int) -> None:
        """``inst`` computes ``tokens`` of this request's prompt: in its backlog until the leg
        there is released (or the request ends)."""
        inst.backlog += tokens
        if self._backlog is None:
            self._backlog = []
        self._backlog.append((inst, tokens))

    def _unqueue(self, inst: Instance | None) -> None:
        """Take ``inst``'s entries (every entry: None) out of the instances' backlogs."""
        kept = []
        for entry in self._backlog or ():
            if inst is None or entry[0] is inst:
                entry[0].backlog -= entry[1]
            else:
                kept.append(entry)
        self._backlog = kept or None
