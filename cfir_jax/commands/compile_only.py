"""The compile-only command (`python <command>.py --config C --compile-only --topology T`, MaxText's convention):
every accelerator program of the command compiled for a TPU topology with abstract inputs (`cfir_jax.aot`), nothing
run, built or read; prints each program's memory per device and refuses what does not fit."""

from __future__ import annotations

import ml_collections

from cfir_jax.aot import programs as programs_lib
from cfir_jax.aot.compile import HEADER, Compiled, compile_program
from cfir_jax.aot.topology import resolve
from cfir_jax.core.errors import CfirError


def run(command: str, config: ml_collections.ConfigDict, topology_name: str, out=print, **options) -> list[Compiled]:
    """`python <command>.py --compile-only --topology T`: compiles every program of the command, prints a table;
    a program that does not fit is a CfirError naming the knob (after the table)."""
    if not topology_name:
        raise CfirError("--compile-only needs --topology, e.g. --topology v5e:2x4 or v5p:4x4x4")
    topology = resolve(topology_name)
    out(f"compile-only {command} for {topology.describe()}: compiled for TPU with abstract inputs, not run")
    out(HEADER)
    results = []
    for program in programs_lib.programs(command, config, topology, **options):
        result = compile_program(program, topology)
        out(result.row())
        results.append(result)
    if any(r.per_host for r in results) and topology.hosts > 1:
        out(f"per-host programs are compiled over host 0's {len(topology.host_devices)} devices (each host runs "
            "the same one)")
    refused = [r.refusal() for r in results if not r.fits]
    if refused:
        raise CfirError("; ".join(refused))
    return results
