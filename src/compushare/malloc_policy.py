"""How a long-running process asks glibc's allocator to give memory back.

A server's large, short-lived buffers (a prefill's activations, a session's KV
cache, a frame from a peer) are freed within seconds, but glibc keeps much of
what it freed: each free of an mmap'd chunk raises its mmap threshold (up to 32
MiB), so later buffers of that size come from the heap, whose freed middle
cannot be returned; and every worker thread gets an arena of its own that holds
its peak. A peer that made a node hold 100 MB for a minute then left it holding
most of that for good (measured by bench/hostile.py). Fixing the threshold makes
every buffer of at least MMAP_THRESHOLD bytes its own mapping, returned on free;
capping the arenas bounds what idle threads keep. The cost is a page fault per
new page of such buffers, small beside the compute that fills them
(docs/performance.md has the measurement).

No trim calls: the process holds no more than it uses, rather than cleaning up
afterwards. On a libc without mallopt (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's malloc.h parameter numbers
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 256 * 1024  # glibc's default starts at 128 KiB and grows; this one stays
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # glibc's pairing when the threshold is fixed
ARENA_MAX = 2  # the event loop's thread and one compute thread at a time


def bound_retention() -> bool:
    """Set the allocator parameters above; True if the libc took them."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_ARENA_MAX, ARENA_MAX)))
    if not ok:
        log.debug("the C library refused a mallopt parameter")
    return ok
