"""The processes of a jax.distributed run, as the index stages see them: who am I, wait for the others, what is mine.

index.py runs the same command on every host (one process per host); each process computes its share of a stage
into the shared workdir, and process 0 alone commits the store once every share is on disk. With one process (no
jax.distributed) every function here is trivial and imports nothing heavy.

The barrier is the distributed runtime client's (the coordination service on process 0; `jax._src.distributed`, as
JAX exposes no public barrier with a timeout), with an explicit long timeout: process 0 merging 10M documents'
chunks takes minutes while the others wait. A device collective (`multihost_utils.sync_global_devices`, an
all-gather) is the wrong tool for that wait: on CPU it goes through gloo, whose context set-up gave up after 30 s
in this project's tests while the other process had not arrived. When a process dies, the others fail at their
next barrier or by the runtime's heartbeat; the job is restarted as a whole and every stage resumes from its shards
and chunks.
"""

from __future__ import annotations

import itertools
import sys

from cfir_jax.core.errors import CfirError

# Long enough for process 0 to merge the largest store while the others wait; a dead process is detected by the
# distributed runtime's heartbeat well before this.
BARRIER_TIMEOUT_S = 24 * 3600

_barrier_count = itertools.count()


def _jax():
    """jax if this process imported it (a jax.distributed run always has), else None: a numpy-only stage run in one
    process must not pay for importing jax."""
    return sys.modules.get("jax")


def process_index() -> int:
    jax = _jax()
    return 0 if jax is None else int(jax.process_index())


def process_count() -> int:
    jax = _jax()
    return 1 if jax is None else int(jax.process_count())


def is_main() -> bool:
    """Process 0: the one that commits stores, writes W/index.json and prints."""
    return process_index() == 0


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Waits until every process reaches the barrier `name` (a no-op with one process).

    Every process calls the same barriers in the same order; a counter makes each call's id unique, so one name can
    serve a loop or a stage run twice.
    """
    if process_count() == 1:
        return
    # why: JAX's distributed client only where JAX is already running (hosts stays importable without JAX)
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise CfirError("several JAX processes but no jax.distributed client: call jax.distributed.initialize()")
    client.wait_at_barrier(f"cfir:{name}:{next(_barrier_count)}", int(timeout_s * 1000))


def owns(item: int, process: int | None = None, count: int | None = None) -> bool:
    """Whether work item `item` (a chunk number) is `process`'s (default: this one's): round-robin, so a stream of
    unknown length splits evenly, and any process count covers every item exactly once."""
    process = process_index() if process is None else process
    count = process_count() if count is None else count
    return item % count == process


def contiguous(num_items: int, process: int | None = None, count: int | None = None) -> range:
    """The contiguous range of `num_items` items that `process` (default: this one) takes; together they cover all."""
    process = process_index() if process is None else process
    count = process_count() if count is None else count
    return range(process * num_items // count, (process + 1) * num_items // count)


def owned_row_chunks(num_rows: int, chunk_rows: int) -> list[tuple[int, int, int]]:
    """(chunk, first row, end row) of every chunk of `chunk_rows` rows that this process owns (`owns`)."""
    return [(c, c * chunk_rows, min(num_rows, (c + 1) * chunk_rows))
            for c in range(-(-num_rows // chunk_rows)) if owns(c)]


def from_main(name: str, value: str = "") -> str:
    """Process 0's `value` on every process (one line of text, e.g. a decision the others must follow); with one
    process, `value` itself. Every process calls it, in the same order."""
    if process_count() == 1:
        return value
    # why: JAX's distributed client only where JAX is already running (hosts stays importable without JAX)
    from jax._src import distributed

    client = distributed.global_state.client
    key = f"cfir:{name}:{next(_barrier_count)}"
    if is_main():
        client.key_value_set(key, value)
        return value
    return client.blocking_key_value_get(key, BARRIER_TIMEOUT_S * 1000)
