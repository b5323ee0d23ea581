"""cfir_jax.core.memory: the heap's free pages handed back to the system after a generation of objects is freed, and
one scratch space reused by a program run step after step."""

import os
import subprocess
import sys

from cfir_jax.core.memory import release_freed, reuse_freed_memory, runs_on_cpu


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


# An XLA:CPU program with a 128 MiB scratch space (the loop's carried array), run 5 times after 5: each run's faults.
_STEPS = """
import resource, sys
from cfir_jax.core.memory import reuse_freed_memory
applied = reuse_freed_memory() if sys.argv[1] == "reuse" else False
import jax, jax.numpy as jnp
step = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, y: jnp.flip(y, 0) * 1.5 + i, x)[::1000].sum())
x = jnp.full((2048, 8192), 0.5, jnp.float32)
program = step.lower(x).compile()
for _ in range(5):  # the heap's first blocks taken (a run may start before the last one's scratch is freed)
    float(program(x))
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    float(program(x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, program.memory_analysis().temp_size_in_bytes, min(faults))
"""


def _faults_per_run(mode: str) -> tuple[bool, int, int]:
    """(applied, the scratch space's bytes, the fewest page faults of the 5 runs)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | {"JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], env=env, capture_output=True, text=True, check=True)
    applied, temp, faults = out.stdout.split()
    return applied == "True", int(temp), int(faults)


def test_a_program_run_step_after_step_reuses_its_scratch_space_instead_of_faulting_it_in_again():
    """glibc maps a block this large afresh for each run and unmaps it after (every page faulted in again: the demo's
    training step spent more time in the kernel than in its own arithmetic); with reuse_freed_memory the runs share
    the heap's blocks (the heap may still grow at a run that overlaps the last one's, on a busy machine: the fewest
    faults of 5 runs are compared)."""
    applied, temp, plain = _faults_per_run("plain")
    assert not applied and temp >= 128 << 20
    assert plain >= 0.9 * temp / 4096, (plain, temp)  # every page of the scratch space, even the best run
    applied, _, reused = _faults_per_run("reuse")
    assert applied
    assert reused < plain / 10, (reused, plain)


def test_the_heap_is_left_as_it_is_off_the_cpu_and_where_the_user_tuned_it():
    assert runs_on_cpu({"JAX_PLATFORMS": "cpu"})
    assert not runs_on_cpu({"JAX_PLATFORMS": "cuda"}) and not runs_on_cpu({"JAX_PLATFORMS": "tpu,cpu"})
    assert not reuse_freed_memory({"JAX_PLATFORMS": "cuda"})
    assert not reuse_freed_memory({"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
