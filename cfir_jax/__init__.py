"""cfir-jax: Coarse-to-Fine Index-shared Retrieval (CFIR) with a Decoupling-BEiT-3 dual encoder in JAX/Flax."""

import importlib
import os

from cfir_jax.core.platforms import tpu_free_platforms

__version__ = "0.1.0"

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
