"""Freed memory handed back to the operating system (glibc's `malloc_trim`), after a served index is replaced.

glibc keeps what a process frees for its next allocations. A reload opens the new index beside the serving one (two
side by side at its peak); once the old one is dropped, the pages its arrays and objects held stay in the process's
heap, free but counted in its RSS, wherever a live allocation sits above them. `malloc_trim(0)` gives every whole
free page back. Where the C library is not glibc (musl, macOS) there is nothing to call and nothing is done.
"""

from __future__ import annotations

import ctypes


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def release_freed() -> bool:
    """Returns the heap's free pages to the system (ctypes releases the GIL meanwhile: serving threads go on); False
    where the C library has no malloc_trim."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
