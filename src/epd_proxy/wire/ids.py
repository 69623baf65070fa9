"""Identifiers made on the hot path, without a system call each.

``uuid.uuid4()`` reads ``os.urandom`` (a ``getrandom`` system call) every time,
which showed up in profiles at thousands of requests per second. These ids
must be unique, not secret, so a generator seeded once per process from
``os.urandom`` (and again in every forked worker) is enough.
"""

from __future__ import annotations

import os
import random
import uuid

_rng = random.Random(os.urandom(32))
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _rng.seed(os.urandom(32)))


def hex_id(bits: int = 128) -> str:
    """``bits // 4`` random hex digits."""
    return "%0*x" % (bits // 4, _rng.getrandbits(bits))


def uuid4_str() -> str:
    """A random UUID in the usual 8-4-4-4-12 form (version 4)."""
    return str(uuid.UUID(int=_rng.getrandbits(128), version=4))
