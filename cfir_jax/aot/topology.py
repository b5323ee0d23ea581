"""TPU topologies that are not attached: their devices (from libtpu's description), hosts and HBM per device."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import tempfile
from collections.abc import Iterator

from cfir_jax.core.errors import CfirError

# HBM per chip, GiB (Cloud TPU system architecture pages).
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
# Chips per host of multi-host slices: 4 (2x2x1) on every generation; v5e and v6e slices of up to 8 chips are one
# host (2x4).
_HOST_CHIPS = (2, 2, 1)
# The Cloud names the README uses for the slices it tabulates.
ALIASES = {"v4-8": "v4:2x2x1", "v5e-8": "v5e:2x4", "v5e-16": "v5e:4x4", "v5p-64": "v5p:4x4x4", "v6e-8": "v6e:2x4"}


@dataclasses.dataclass(frozen=True)
class Topology:
    """`devices`: every device of the slice (the mesh of a multi-host program); `host_devices`: those of host 0
    (the mesh of a per-host program, as `jax.local_devices()` on that host)."""

    name: str
    generation: str
    chips: int
    devices: tuple
    hosts: int
    hbm_bytes: int  # per device (one device per chip)

    @property
    def host_devices(self) -> tuple:
        return tuple(d for d in self.devices if d.process_index == 0)

    def describe(self) -> str:
        return (f"{self.name} ({self.chips} chips, {len(self.devices)} devices, {self.hosts} host"
                f"{'s' if self.hosts > 1 else ''}, {self.hbm_bytes / 2**30:.0f} GiB HBM per device)")


def libtpu_problem() -> str | None:
    """Why TPU programs cannot be compiled here (libtpu missing or unloadable), or None."""
    try:
        _devices("v5e:2x2", (2, 2, 1))
    except CfirError as e:
        return str(e)
    return None


@functools.cache
def _devices(name: str, host_bounds: tuple[int, int, int], chip_config: str = "default") -> tuple:
    # libtpu warns about TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES when no TPU is attached: harmless, hushed.
    os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "3")
    os.environ.setdefault("TPU_MIN_LOG_LEVEL", "3")
    # libtpu takes /tmp/libtpu_lockfile for a process that owns TPU chips; compiling owns none, so several processes
    # (a test and the command it runs, two compile-only jobs) may load it at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        # why: libtpu (the TPU compiler) loads only when a topology is resolved; it may be absent
        import libtpu  # noqa: F401
    except ImportError:
        raise CfirError("compile-only needs libtpu (the TPU compiler): pip install 'jax[tpu]==<your jax version>' "
                        "(bash scripts/setup.sh test installs it)") from None
    # why: libtpu's topologies load only when a topology is resolved
    from jax.experimental import topologies

    with _libtpu_stderr() as said:
        try:
            desc = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name=chip_config,
                                                chips_per_host_bounds=host_bounds, num_slices=1)
        except Exception as e:  # noqa: BLE001 - libtpu raises plain RuntimeErrors/XlaRuntimeErrors
            error = e
        else:
            return tuple(desc.devices)
    why = " ".join((str(error) or said[0]).split())  # libtpu's own lines only when its error says nothing
    raise CfirError(f"--topology {name}: libtpu does not resolve it ({why[:300]})") from None


@contextlib.contextmanager
def _libtpu_stderr() -> Iterator[list[str]]:
    """Holds back what libtpu writes to the process's stderr (fd 2) while it starts without a TPU: its probes of the
    cloud metadata (accelerator type, worker hostnames) fail on any other host and print half a dozen error lines
    that mean nothing to a compile-only run. The text is handed back (`said[0]`) for an error that has no message."""
    said = [""]
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            said[0] = sink.read(4096).decode(errors="replace")


def resolve(name: str) -> Topology:
    """'v5p:4x4x4' (generation:chip grid) or one of ALIASES ('v5p-64') -> its Topology."""
    name = ALIASES.get(name, name)
    generation, _, grid = name.partition(":")
    if generation not in HBM_GIB or not grid:
        raise CfirError(f"--topology {name!r}: use GENERATION:GRID with a generation of {', '.join(HBM_GIB)} "
                        f"(e.g. v5e:2x4, v5p:4x4x4) or one of {', '.join(ALIASES)}")
    try:
        dims = tuple(int(d) for d in grid.split("x"))
    except ValueError:
        raise CfirError(f"--topology {name!r}: the grid must be integers joined by 'x' (e.g. 4x4x4)") from None
    if not 2 <= len(dims) <= 3 or min(dims) < 1:
        raise CfirError(f"--topology {name!r}: the grid has 2 or 3 positive dimensions")
    dims3 = dims + (1,) * (3 - len(dims))
    chips = math.prod(dims)
    if generation in ("v5e", "v6e") and chips <= 8:
        bounds = dims3
    else:
        bounds = tuple(min(d, b) for d, b in zip(dims3, _HOST_CHIPS))
    # A v4 chip's two TensorCores as one device (megacore), as jax.make_mesh requires of TPUs after v3.
    devices = _devices(name, bounds, "megacore" if generation == "v4" else "default")
    hosts = len({d.process_index for d in devices})
    hbm = HBM_GIB[generation] * 2**30 * chips // len(devices)
    return Topology(name, generation, chips, devices, hosts, hbm)
