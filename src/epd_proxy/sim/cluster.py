"""A whole simulated deployment (E, P, D and PD instances) in one process."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from epd_proxy.sim.config import INSTANCE_NAME, KV_CONNECTORS, ROLES, SimConfig
from epd_proxy.sim.ec_store import EcStore
from epd_proxy.sim.instance import SimInstance
from epd_proxy.sim.records import SimRecord

_ROLE_ALIASES = {"encode": "encode", "e": "encode", "encoder": "encode", "encoders": "encode",
                 "prefill": "prefill", "p": "prefill", "prefiller": "prefill", "prefillers": "prefill",
                 "decode": "decode", "d": "decode", "decoder": "decode", "decoders": "decode",
                 "pd": "pd"}


def unknown_key(key: str) -> str:
    """One line for a topology spec key that is none: the valid keys, and the closest."""
    import difflib

    keys = ["encode", "prefill", "decode", "pd", "kv", "base_port", "host", *SimConfig.field_names()]
    close = difflib.get_close_matches(key, [*keys, *_ROLE_ALIASES], n=1)
    return (f"unknown topology spec key {key!r}" + (f" (did you mean {_ROLE_ALIASES.get(close[0], close[0])!r}?)"
                                                    if close else "")
            + "; keys: encode, prefill, decode, pd (counts), kv, base_port, host, a simulator setting "
              "(e.g. itl_ms) or ROLE.setting")


class SimCluster:
    """Simulated vLLM instances sharing one encoder cache and nothing else.

    ``async with SimCluster(encode=2, prefill=1, decode=2) as cluster:`` starts
    every instance on an ephemeral loopback port (or on consecutive ports from
    ``base_port``: encoders first, then prefills, decodes and PDs; Mooncake
    bootstrap ports follow) and stops them on exit.
    """

    def __init__(self, encode: int = 0, prefill: int = 0, decode: int = 0, pd: int = 0,
                 config: SimConfig | None = None, *, host: str = "127.0.0.1", base_port: int | None = None,
                 kv_connector: str | None = None) -> None:
        config = config or SimConfig()
        if kv_connector is not None:
            config = dataclasses.replace(config, kv_connector=kv_connector)
        self.config = config
        self.host = host
        self.base_port = base_port
        self.counts = {"encode": encode, "prefill": prefill, "decode": decode, "pd": pd}
        for role, n in self.counts.items():
            if n < 0:
                raise ValueError(f"negative instance count for {role}")
        self.created = config.created if config.created is not None else int(time.time())
        self.ec_store = EcStore(config.ec_store_capacity)
        self._by_role: dict[str, list[SimInstance]] = {r: [] for r in ROLES}
        port = base_port
        for role in ROLES:
            for i in range(self.counts[role]):
                inst = SimInstance(role, i, config, host=host, port=port or 0, ec_store=self.ec_store,
                                   created=self.created)
                self._by_role[role].append(inst)
                if port:
                    port += 1
        if port and config.kv_connector == "mooncake":
            for inst in self._by_role["prefill"]:
                inst.bootstrap_port = port
                port += 1
        self.started = False

    # -- construction from a topology spec ------------------------------------------------
    @classmethod
    def parse_spec(cls, spec: str) -> tuple[dict[str, int], dict[str, str], dict[str, dict[str, str]], dict]:
        """Split ``"encode=2,prefill=1,decode=2,kv=nixl-push,itl_ms=5,decode.itl_ms=3"`` into
        (counts, config values, per-role config values, cluster options)."""
        counts = {r: 0 for r in ROLES}
        values: dict[str, str] = {}
        per_role: dict[str, dict[str, str]] = {}
        options: dict = {}
        for raw in spec.split(","):
            item = raw.strip()
            if not item:
                continue
            key, sep, value = item.partition("=")
            key = key.strip().lower().replace("-", "_")
            value = value.strip()
            if not sep:
                raise ValueError(f"topology spec item {item!r} is not key=value")
            if key in _ROLE_ALIASES:
                if not value.isdigit():
                    raise ValueError(f"{key}={value!r}: a count of instances, e.g. {key}=2")
                counts[_ROLE_ALIASES[key]] = int(value)
            elif key in ("kv", "kv_connector", "connector"):
                if value not in KV_CONNECTORS:
                    raise ValueError(f"kv connector must be one of {KV_CONNECTORS}, not {value!r}")
                values["kv_connector"] = value
            elif key in ("base_port", "port"):
                if not value.isdigit():
                    raise ValueError(f"{key}={value!r}: a port number")
                options["base_port"] = int(value)
            elif key == "host":
                options["host"] = value
            elif "." in key:
                role, _, field = key.partition(".")
                head, _, index = role.rpartition("_")  # an instance: decode-1 (its "-" read as "_" above)
                role = f"{_ROLE_ALIASES.get(head, head)}-{index}" if head and index.isdigit() else \
                    _ROLE_ALIASES.get(role, role)
                if (role not in ROLES and not INSTANCE_NAME.match(role)) or field not in SimConfig.field_names():
                    raise ValueError(f"unknown per-role setting {key!r}")
                per_role.setdefault(role, {})[field] = value
            elif key in SimConfig.field_names():
                values[key] = value
            else:
                raise ValueError(unknown_key(key))
        return counts, values, per_role, options

    @classmethod
    def from_spec(cls, spec: str, config: SimConfig | None = None, **kwargs) -> "SimCluster":
        """A cluster from ``"encode=2,prefill=1,decode=2"``; also ``pd=N``, ``kv=nixl|nixl-push|mooncake``,
        ``base_port=N``, any :class:`SimConfig` field (``itl_ms=5``) and per-role fields
        (``decode.itl_ms=5``) and per-instance fields (``decode-1.lora_modules=a=/x``). Keyword
        arguments go to the constructor."""
        counts, values, per_role, options = cls.parse_spec(spec)
        config = (config or SimConfig()).with_values(values)
        if per_role:
            roles = {r: dict(v) for r, v in config.roles.items()}
            for role, vals in per_role.items():
                typed = SimConfig().with_values(vals)
                roles.setdefault(role, {}).update({k: getattr(typed, k) for k in vals})
            config = dataclasses.replace(config, roles=roles)
        options.update(kwargs)
        return cls(**counts, config=config, **options)  # type: ignore[arg-type]  # counts: role -> int

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> "SimCluster":
        started: list[SimInstance] = []
        try:
            for inst in self.all_instances():
                await inst.start()
                started.append(inst)
        except BaseException:
            for inst in started:
                await inst.stop()
            raise
        self.started = True
        return self

    async def stop(self) -> None:
        await asyncio.gather(*(inst.stop() for inst in self.all_instances()), return_exceptions=True)
        self.started = False

    close = stop  # alias

    async def __aenter__(self) -> "SimCluster":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # -- lookup -----------------------------------------------------------------------------
    def instances(self, role: str) -> list[SimInstance]:
        return list(self._by_role[_ROLE_ALIASES.get(role, role)])

    def urls(self, role: str) -> list[str]:
        return [inst.url for inst in self.instances(role)]

    def all_instances(self) -> list[SimInstance]:
        return [inst for role in ROLES for inst in self._by_role[role]]

    def instance(self, name: str) -> SimInstance:
        for inst in self.all_instances():
            if inst.name == name:
                return inst
        raise KeyError(name)

    def prefill_identity(self, i: int = 0) -> dict:
        """engine_id, kv_host, kv_port, tp, pp (and url, bootstrap_addr for Mooncake) of prefill ``i``."""
        return self._by_role["prefill"][i].identity()

    def prefill_identities(self) -> list[dict]:
        return [inst.identity() for inst in self._by_role["prefill"]]

    def records(self, role: str | None = None) -> list[SimRecord]:
        """Every instance's records (or one role's), in arrival order."""
        insts = self.all_instances() if role is None else self.instances(role)
        out = [r for inst in insts for r in inst.records]
        out.sort(key=lambda r: r.t_received)
        return out

    def clear_records(self) -> None:
        for inst in self.all_instances():
            inst.clear_records()

    @property
    def held_kv_blocks(self) -> int:
        return sum(inst.held_kv_blocks for inst in self._by_role["prefill"])

    def describe(self) -> str:
        """Human-readable URLs and prefill identities (what the CLI prints)."""
        lines = []
        for role in ROLES:
            insts = self._by_role[role]
            if insts:
                lines.append(f"{role:8s} " + " ".join(inst.url for inst in insts))
        lines.append(f"kv connector: {self.config.kv_connector}")
        for ident in self.prefill_identities():
            extra = f" bootstrap={ident['bootstrap_addr']}" if "bootstrap_addr" in ident else ""
            lines.append(f"prefill identity: engine_id={ident['engine_id']} kv_host={ident['kv_host']} "
                         f"kv_port={ident['kv_port']} tp={ident['tp']} pp={ident['pp']}{extra}")
        for inst in self.all_instances():
            if inst.kv_events is not None:
                lines.append(f"kv events: {inst.role} {inst.url} {inst.kv_events.endpoint} "
                             f"{inst.kv_events.replay_endpoint}")
        return "\n".join(lines)
