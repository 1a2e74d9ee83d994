"""glibc's malloc told to keep freed memory for the next array (Linux CPUs).

mlx's CPU allocator takes every array from ``malloc`` and hands it back when the array dies, and glibc maps
buffers past its threshold (128 KiB, raised as it goes up to 32 MiB) fresh from the kernel each time: every
step's new arrays then fault their pages in again, each zeroed by the kernel (an eighth of a batched
prompt's CPU time; bench/RESULTS.md). With the threshold fixed at 32 MiB and the heap trimmed only
past 1 GiB, a freed buffer is reused as it is. ``MLXPIPE_MALLOC=off`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import functools
import sys

from ..switches import turned_off_by

ENV = "MLXPIPE_MALLOC"
# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 1 << 30, _M_TOP_PAD: 64 << 20}


@functools.cache
def keep_freed_memory() -> str:
    """Set glibc's malloc to reuse freed buffers (once a process); what was done, for ``--model-info``."""
    if not sys.platform.startswith("linux"):
        return "not Linux: the platform's malloc"
    if off := turned_off_by(ENV):
        return f"turned off by {off}: glibc's defaults"
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's; other C libraries (musl) have none
    except (AttributeError, OSError):
        return "no mallopt (not glibc): the C library's defaults"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not all(mallopt(param, value) for param, value in SETTINGS.items()):
        return "mallopt refused: glibc's defaults"
    return "freed buffers kept for reuse (mmap threshold 32 MiB, trim past 1 GiB)"
