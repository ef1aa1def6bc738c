"""Giving freed memory back to the operating system between the stages of a command (a check, an
export).

glibc's allocator serves blocks up to a threshold that it raises as large blocks are freed
(``M_MMAP_THRESHOLD``, up to 32 MiB on 64-bit systems: mallopt(3)) from its heap, and returns a
heap page to the system only from the heap's top. At a 262,144-token vocabulary the slices a
weight check works through are tens of MiB each, so after it the heap held about 0.9 GB of free
pages that the next stage's peak sat on top of. ``malloc_trim(0)`` returns every whole free page
of the heap (malloc_trim(3)); elsewhere than glibc there is nothing to call and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _libc_trim() -> Any:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def give_back_freed_memory() -> bool:
    """Collect unreachable Python objects, then hand the heap's free pages back to the system;
    whether the C library could be asked to."""
    gc.collect()
    trim = _libc_trim()
    if trim is None:
        return False
    trim(0)
    return True
