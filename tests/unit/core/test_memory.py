"""cfir_jax.core.memory: the heap's free pages handed back to the system after a generation of objects is freed."""

import os

from cfir_jax.core.memory import release_freed


def _rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_the_pages_a_freed_generation_held_go_back_to_the_system():
    """200 MiB of 4 KiB buffers (malloc's heap, below its mmap threshold), one in eight kept alive among the rest as
    a served index's survivors would be: freeing the others leaves their pages in the RSS (214 of 215 MiB stay,
    without it); release_freed returns them."""
    buffers = [bytearray(4096) for _ in range(51_200)]
    for b in buffers:
        b[::512] = b"x" * 8  # touched: resident
    kept = buffers[::8]
    del buffers
    freed = _rss_mib()
    assert release_freed()  # glibc: the machines this runs on
    after = _rss_mib()
    assert freed - after > 100, (freed, after)  # most of the 175 MiB freed came back
    del kept  # alive until here: the survivors the freed pages sat among
