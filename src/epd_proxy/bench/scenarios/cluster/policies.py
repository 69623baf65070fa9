r"""The policies under test (pure): ``--policies`` and ``--policy-def`` into :class:`PolicySpec`\s, and
which of them the targets are checked for."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

BASELINES = ("round-robin", "least-loaded")


@dataclass(frozen=True)
class PolicySpec:
    """One routing policy under test: who routes (``kind``) and how (``args``)."""

    name: str
    kind: str  # "proxy", "oracle" or "vllm-router"
    args: tuple[str, ...] = ()  # proxy: extra `epd-proxy serve` flags; vllm-router: (policy,)
    # proxy: subscribed to the instances' KV events (the instances then publish them)
    kv_events: bool = False

    @property
    def text_only(self) -> bool:
        return self.kind == "vllm-router"


def parse_policies(names: list[str], defs: list[str] | None = None) -> list[PolicySpec]:
    """``--policies`` names, resolved against the built-ins and ``--policy-def NAME=ARGS``."""
    table: dict[str, PolicySpec] = {
        "round-robin": PolicySpec("round-robin", "proxy", ("--routing", "round-robin")),
        "least-loaded": PolicySpec("least-loaded", "proxy", ("--routing", "least-loaded")),
        # The proxy's own policies (docs/architecture.md, "Routing"); the last is its per-role default.
        "load-aware": PolicySpec("load-aware", "proxy", ("--routing", "load-aware")),
        "power-of-two": PolicySpec("power-of-two", "proxy", ("--routing", "power-of-two")),
        "cache-aware": PolicySpec("cache-aware", "proxy", ("--prefill-policy", "cache-aware", "--decode-policy",
                                                          "load-aware", "--encode-policy", "cache-aware")),
        # The same, routing on the block index that vLLM's KV events keep exact.
        "exact": PolicySpec("exact", "proxy", ("--prefill-policy", "cache-aware", "--decode-policy", "load-aware",
                                              "--encode-policy", "cache-aware"), kv_events=True),
        "oracle": PolicySpec("oracle", "oracle"),
    }
    for d in defs or []:
        name, sep, argv = d.partition("=")
        name = name.strip()
        if not sep or not name or ":" in name:
            raise ValueError(f"--policy-def expects NAME=ARGS (epd-proxy serve flags), got {d!r}")
        table[name] = PolicySpec(name, "proxy", tuple(shlex.split(argv)))
    out: list[PolicySpec] = []
    for n in names:
        if n.startswith("vllm-router:"):
            pol = n.split(":", 1)[1]
            if not pol:
                raise ValueError(f"{n!r}: name a vllm-router policy, e.g. vllm-router:cache_aware")
            out.append(PolicySpec(n, "vllm-router", (pol,)))
        elif n in table:
            out.append(table[n])
        else:
            raise ValueError(f"unknown policy {n!r}: define it with --policy-def {n}='--flag value ...' "
                             f"(built-in: {', '.join(table)}, vllm-router:POLICY)")
    if len({p.name for p in out}) != len(out):
        raise ValueError("a policy is listed twice")
    return out


def candidate_policy(policies: list[PolicySpec], name: str | None = None) -> PolicySpec | None:
    """The proxy policy the targets are checked for: ``name``, else the last proxy policy that
    is not a baseline (the cache-aware ones are listed last), else least-loaded."""
    proxies = [p for p in policies if p.kind == "proxy"]
    if name:
        for p in proxies:
            if p.name == name:
                return p
        raise ValueError(f"--cluster-candidate {name!r} is not one of the proxy policies run")
    rest = [p for p in proxies if p.name not in BASELINES]
    if rest:
        return rest[-1]
    for p in proxies:
        if p.name == "least-loaded":
            return p
    return proxies[-1] if proxies else None
