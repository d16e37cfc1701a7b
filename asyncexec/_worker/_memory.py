"""How a worker process's C allocator keeps memory it frees: as glibc's main thread does once
its dynamic thresholds have grown, for every thread from the start.

glibc serves a thread other than the main one from an arena of its own, whose heap it shrinks
as soon as more than the trim threshold is free at its top. A threaded worker pickles and
unpickles a pushed state in Ray's threads, so each push of a state of some megabytes would
give them back to the kernel and take them again, page by page, at both ends. The main thread
of a plain actor does not pay that: glibc raises its thresholds when the first large block is
freed.
"""

from __future__ import annotations

import ctypes

__all__ = ["keep_freed_memory"]

#: ``mallopt``'s parameters (``malloc.h``).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: The values glibc's dynamic thresholds reach at most (``DEFAULT_MMAP_THRESHOLD_MAX`` on
#: 64-bit, and twice it): blocks from 32 MiB up are mapped and unmapped apart, as before; up to
#: 64 MiB free at the top of an arena stays there for the next push.
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD


def keep_freed_memory() -> bool:
    """Set this process's allocator thresholds (see the module's docstring); return whether it
    could (False where the C library has no ``mallopt``: not glibc)."""
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: the C library's among them
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
