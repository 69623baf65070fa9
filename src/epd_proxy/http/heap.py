"""Giving freed request-body memory back to the operating system.

A large body arrives as many reads of up to 256 KiB. glibc serves blocks that size
from its heap once its dynamic mmap threshold has risen (it rises to the size of any
mapped block freed, up to 32 MiB), and a heap page is returned only from the top of
the heap, so after a burst of large uploads the process keeps their memory for good.
``malloc_trim`` releases the free pages anywhere in the heap; it is called after many
large bodies were freed (see ``BodyBudget``), never per request. On a libc without it
(musl, macOS) these are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_trim = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes = [ctypes.c_size_t]
    _trim.restype = ctypes.c_int
except (OSError, AttributeError):  # pragma: no cover - not glibc
    _trim = None


def trim_heap() -> bool:
    """Return free heap pages to the OS; True if the call exists here."""
    if _trim is None:  # pragma: no cover
        return False
    _trim(0)
    return True
