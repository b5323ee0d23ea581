"""Compiles registered programs for a topology, reads each device's memory, and refuses what does not fit."""

from __future__ import annotations

import dataclasses
import re
import time

import jax

from cfir_jax.aot import programs as programs_lib
from cfir_jax.aot.topology import Topology

GIB = 2**30


@dataclasses.dataclass
class Compiled:
    """Per-device bytes of one compiled program (XLA's memory analysis of the TPU executable) and its compile time."""

    program: str
    topology: str
    shapes: str
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    hbm: int
    compile_s: float
    knob: str
    per_host: bool

    @property
    def total(self) -> int:
        """Live bytes at the peak: arguments + outputs not aliased to (donated) arguments + temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm

    def refusal(self) -> str:
        return (f"{self.program} does not fit {self.topology}: {self.total / GIB:.2f} GiB per device of "
                f"{self.hbm / GIB:.0f} GiB ({self.shapes}); {self.knob}")

    def row(self) -> str:
        return (f"{self.program:<22} {self.arguments / GIB:7.2f} {(self.outputs - self.aliased) / GIB:7.2f} "
                f"{self.temporaries / GIB:7.2f} {self.total / GIB:7.2f} {self.hbm / GIB:5.0f} "
                f"{'yes' if self.fits else 'NO':>4} {self.compile_s:7.1f}  {self.shapes}")


HEADER = (f"{'program':<22} {'args':>7} {'out':>7} {'temps':>7} {'total':>7} {'HBM':>5} {'fits':>4} "
          f"{'compile':>7}  (GiB per device, seconds)")


def compile_program(program: programs_lib.Program, topology: Topology) -> Compiled:
    """Lowers and compiles `program` with the TPU compiler; nothing runs and nothing is allocated."""
    start = time.perf_counter()
    lowered = program.lower()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        # The TPU compiler itself refuses temporaries beyond the HBM ("... HLO temporaries (1.41T) exceeds
        # available HBM (15.75G)"): a record that does not fit, with the temporaries it reported.
        needed = _reported_bytes(str(e))
        if "RESOURCE_EXHAUSTED" not in str(e) or needed is None:
            raise
        return Compiled(program.name, topology.name, program.shapes, 0, 0, 0, needed, topology.hbm_bytes,
                      time.perf_counter() - start, program.knob("temporaries"), program.per_host)
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    args, temps = int(m.argument_size_in_bytes), int(m.temp_size_in_bytes)
    dominant = "arguments" if args >= temps else "temporaries"
    return Compiled(program.name, topology.name, program.shapes, args, int(m.output_size_in_bytes),
                  int(m.alias_size_in_bytes), temps, topology.hbm_bytes, seconds, program.knob(dominant),
                  program.per_host)


def _reported_bytes(message: str) -> int | None:
    """The first '(1.41T)'-style size in a compiler message, in bytes."""
    match = re.search(r"\((\d+(?:\.\d+)?)([KMGT])\)", message)
    if not match:
        return None
    return int(float(match.group(1)) * 1024 ** "KMGT".index(match.group(2)) * 1024)
