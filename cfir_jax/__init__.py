"""cfir-jax: Coarse-to-Fine Index-shared Retrieval (CFIR) with a Decoupling-BEiT-3 dual encoder in JAX/Flax."""

import glob
import importlib
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


# The library's names (docs/python.md), loaded on first use so that `import cfir_jax` stays light (no JAX): each is
# (module, attribute).
_API = {
    "open": ("cfir_jax.api.index", "open"),
    "Index": ("cfir_jax.api.index", "Index"),
    "build": ("cfir_jax.api.operations", "build"),
    "train": ("cfir_jax.api.operations", "train"),
    "verify": ("cfir_jax.api.operations", "verify"),
    "Verification": ("cfir_jax.api.operations", "Verification"),
    "Query": ("cfir_jax.core.query_rule", "Query"),
    "Client": ("cfir_jax.api.client", "Client"),
    "ServiceError": ("cfir_jax.api.client", "ServiceError"),
    "Result": ("cfir_jax.retrieve.results", "Result"),
    "Hit": ("cfir_jax.retrieve.results", "Hit"),
    "CfirError": ("cfir_jax.core.errors", "CfirError"),
}
# The names a user may import (every key of _API): tests/unit/api holds them equal.
__all__ = ["CfirError", "Client", "Hit", "Index", "Query", "Result", "ServiceError", "Verification", "__version__",
           "build", "open", "train", "verify"]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'cfir_jax' has no attribute {name!r}")
    module, attribute = _API[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
