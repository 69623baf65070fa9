"""The workloads of the KV events comparison (pure): ``--cluster-kv-cases`` into :class:`KvCase`\\ s.

A case is ``+``-joined words: ``evict`` (each prefill's cache ``--cluster-cache-ratio`` of the
working set: evictions) or ``roomy`` (``--cluster-roomy-ratio``: none), ``rN`` (N proxy replicas,
turns of a conversation alternating between them), ``direct`` or ``directS`` (a second client
population straight to the instances, S times the proxy's conversations and rate; default
``--cluster-direct-share``), ``restart`` (a prefill restarted mid-run). ``evict+r3`` is evictions
with three replicas. The approximation fails in each of them: evictions, other replicas' and
other clients' traffic and a restart are what a proxy that only remembers where it sent
requests cannot see.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DEFAULT_KV_CASES = ("evict", "evict+r2", "evict+r3", "roomy", "evict+direct", "roomy+restart")


@dataclass(frozen=True)
class KvCase:
    """One workload of the comparison."""

    name: str
    evictions: bool = True
    replicas: int = 1
    direct: float = 0.0
    restart: bool = False

    @property
    def oracle_key(self) -> tuple:
        """What the oracle's cell depends on: not the replicas (it has no proxy)."""
        return (self.evictions, self.direct, self.restart)

    @property
    def plain(self) -> bool:
        """No second population, no restart: the cases the issue's targets are set on."""
        return not self.direct and not self.restart


def parse_case(text: str, direct_share: float = 0.3) -> KvCase:
    """One case from its words (module docstring); raises ValueError on an unknown word."""
    case = KvCase(text.strip())
    if not case.name:
        raise ValueError("an empty KV case")
    for word in case.name.split("+"):
        w = word.strip()
        if w == "evict":
            case = replace(case, evictions=True)
        elif w == "roomy":
            case = replace(case, evictions=False)
        elif w == "restart":
            case = replace(case, restart=True)
        elif w.startswith("direct"):
            share = float(w[len("direct"):]) if w != "direct" else direct_share
            if not 0 < share <= 4:
                raise ValueError(f"KV case {text!r}: the direct share must be in (0, 4]")
            case = replace(case, direct=share)
        elif w[:1] == "r" and w[1:].isdigit() and int(w[1:]) >= 1:
            case = replace(case, replicas=int(w[1:]))
        else:
            raise ValueError(f"KV case {text!r}: unknown word {w!r} (evict, roomy, rN, direct[S], restart)")
    return case


def parse_cases(names: list[str], direct_share: float = 0.3) -> list[KvCase]:
    out = [parse_case(n, direct_share) for n in names if n.strip()]
    if len({c.name for c in out}) != len(out):
        raise ValueError("a KV case is listed twice")
    return out


def oracle_cases(cases: list[KvCase]) -> dict[str, str]:
    """For each case, the case whose oracle cell it uses: the first with the same
    :attr:`KvCase.oracle_key` (the oracle runs once per key)."""
    first: dict[tuple, str] = {}
    out = {}
    for c in cases:
        out[c.name] = first.setdefault(c.oracle_key, c.name)
    return out
