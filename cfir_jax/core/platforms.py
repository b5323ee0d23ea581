"""Which platforms JAX may use on this host, decided before JAX starts (nothing heavy imported): read by `import
cfir_jax` (JAX_PLATFORMS=cpu where libtpu is installed without a chip) and by `cfir_jax.core.memory` (the heap tuned
only where JAX runs on the CPU)."""

from __future__ import annotations

import glob
import importlib.util

_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def tpu_free_platforms(environ, find_spec=importlib.util.find_spec, device_files=glob.glob) -> str | None:
    """The JAX_PLATFORMS to set on a host that has libtpu installed but no TPU chip, or None to leave JAX alone.

    libtpu (installed by the test set for `--compile-only`) probes for chips when JAX starts and, on a host without
    one, prints a screen of warnings before JAX falls back to the CPU. Without a TPU device file (/dev/accel*,
    /dev/vfio/N) and without a GPU plugin (whose platform must stay), the CPU is all JAX could use anyway. Compiling
    for a TPU topology does not need the TPU platform. A JAX_PLATFORMS the user set is never changed.
    """
    if "JAX_PLATFORMS" in environ or find_spec("libtpu") is None:
        return None
    return None if accelerator_present(find_spec, device_files) else "cpu"


def accelerator_present(find_spec=importlib.util.find_spec, device_files=glob.glob) -> bool:
    """Whether JAX may run on something other than the CPU here: a TPU device file (/dev/accel*, /dev/vfio/N) or a
    GPU plugin installed."""
    if device_files("/dev/accel*") or device_files("/dev/vfio/[0-9]*"):
        return True
    return any(find_spec(name) for name in _GPU_PLUGINS)
