"""What each instance of one role serves, as it said: its ``/v1/models`` answer read within its
``models`` attribute (``learned``, after every probe that answered: ``probes.py``), or that
attribute alone until it answers again (``pin``); which LoRA adapter a request's model key
names, and where each adapter lives (its homes, for ``routing/lora_affinity.py``).

Beside the host set (``pool.py``), which rebuilds its lists when an instance's models change,
and the cluster's catalog over every role (``model_directory.py``), which it tells of every
change. The pure rules of what a model list says are ``models.py``'s.
"""

from __future__ import annotations

import logging
from typing import Protocol, Sequence

from epd_proxy.instances.instance import Instance
from epd_proxy.instances.model_directory import ModelDirectory
from epd_proxy.instances.models import ModelKey, parse_models, pinned
from epd_proxy.routing.lora_affinity import AdapterAffinity

# The pool's logger: operators filter on it (docs/architecture.md, "Modules").
log = logging.getLogger("epd_proxy.pool")


class Hosts(Protocol):
    """The host set, as far as what its instances serve reads and tells it (``pool.InstancePool``)."""

    @property
    def role(self) -> str: ...
    @property
    def instances(self) -> Sequence[Instance]: ...
    @property
    def every(self) -> Sequence[Instance]: ...

    def refresh(self) -> None: ...


class ServedModels:
    """What the instances of one role serve, and where its LoRA adapters live."""

    def __init__(self, hosts: Hosts, directory: ModelDirectory, affinity: AdapterAffinity | None = None) -> None:
        self.hosts = hosts
        self.role = hosts.role
        self.directory = directory  # the cluster's models, told of every change here
        # A LoRA adapter's requests concentrated on few of its instances (None: the policy places them).
        self.affinity = affinity
        self._homes_stale = True  # the adapters' homes to compute on the next adapter request
        directory.track(hosts)

    def changed(self) -> None:
        """The host set changed (a state, a member, what one serves): the catalog is rebuilt
        now, the adapters' homes on the next adapter request."""
        self._homes_stale = True
        self.directory.changed()

    def learned(self, inst: Instance, body: bytes) -> None:
        """``inst``'s /v1/models answer (``body``), within its ``models`` attribute; ValueError
        when it is not a model list."""
        served = parse_models(body, inst.spec.models, self.directory.cards)
        if served != inst.served:
            if inst.spec.models and not served.parents:
                log.warning("%s instance %s serves none of its models (%s)", self.role, inst.url,
                            ", ".join(inst.spec.models))
            # What it serves at first is in /status; a change later is worth a line.
            log.log(logging.DEBUG if inst.served is None else logging.INFO, "%s instance %s serves %s", self.role,
                    inst.url, ", ".join(served.names) or "nothing")
            inst.served = served
            self.hosts.refresh()

    def pin(self, inst: Instance) -> None:
        """Its ``models`` attribute changed: what it serves is that (or unknown) until it answers again."""
        inst.served = pinned(inst.spec.models) if inst.spec.models else None
        self.hosts.refresh()

    def adapter_of(self, model: ModelKey) -> str | None:
        """The LoRA adapter a request's model key names (None: a base model)."""
        if isinstance(model, tuple):
            return model[0]
        return model if self.directory.current.parents.get(model) else None

    def rehome(self) -> None:
        """The adapters' homes (affinity) computed again after a change of the roster."""
        if self._homes_stale and self.affinity is not None:
            self._homes_stale = False
            self.affinity.rehome(self.adapters_served())

    def adapters_served(self) -> dict[str, list[str]]:
        """Per LoRA adapter, the URLs of the instances (not draining) that serve it."""
        out: dict[str, list[str]] = {}
        for inst in self.hosts.every:
            if inst.served is not None:
                for name, parent in inst.served.parents.items():
                    if parent is not None:
                        out.setdefault(name, []).append(inst.url)
        return out
