"""cfir-jax: Coarse-to-Fine Index-shared Retrieval (CFIR) with a Decoupling-BEiT-3 dual encoder in JAX/Flax."""

import glob
import importlib.util
import os

__version__ = "0.1.0"

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
    if device_files("/dev/accel*") or device_files("/dev/vfio/[0-9]*"):
        return None
    if any(find_spec(name) for name in _GPU_PLUGINS):
        return None
    return "cpu"


_platforms = tpu_free_platforms(os.environ)
if _platforms is not None:
    os.environ["JAX_PLATFORMS"] = _platforms
