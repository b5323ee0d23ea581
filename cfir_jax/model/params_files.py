"""A model directory's parameters read straight from the files orbax wrote, with tensorstore: what orbax's restore
reads, without orbax's import (a quarter of a second, most of a model's load at a query's start).

`model/checkpoint.py` saves `DIR/params` with orbax's StandardCheckpointer: `_METADATA` names every array of the tree
(its path as a tuple of keys), and each array is a zarr array, named by its keys joined with ".", in an OCDBT
key-value store. `read` opens exactly those arrays and checks that they are the arrays the target asks for: the same
names, each of the target's shape and dtype. Anything else (another layout, a name, shape or dtype that differs, a
file tensorstore cannot read) is None, and orbax restores the directory as before, with its own errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np


def read(params: Path, target: Any) -> Any | None:
    """The arrays of the orbax directory `params` as the pytree `target` (`jax.ShapeDtypeStruct` leaves with
    shardings) holds them, placed as its shardings say; None when they are not exactly those arrays."""
    # why: tensorstore's own import is milliseconds once JAX is loaded; orbax's is what this avoids
    import tensorstore as ts

    try:
        meta = json.loads((params / "_METADATA").read_text())
        if meta.get("use_ocdbt") is not True:
            return None
        leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
        names = [tuple(str(getattr(k, "key", k)) for k in path) for path, _ in leaves]
        if sorted(str(n) for n in names) != sorted(meta["tree_metadata"]):
            return None
        driver = "zarr3" if meta.get("use_zarr3") else "zarr"
        kvstore = {"driver": "ocdbt", "base": f"file://{params.absolute()}/"}
        opened = [ts.open({"driver": driver, "kvstore": kvstore, "path": ".".join(n)}, open=True, read=True)
                  for n in names]
        arrays = [np.asarray(store.result().read().result()) for store in opened]
    except Exception:  # any surprise: orbax restores it, and says what is wrong if anything is
        return None
    if any(a.shape != leaf.shape or a.dtype != leaf.dtype for a, (_, leaf) in zip(arrays, leaves)):
        return None
    return jax.tree_util.tree_unflatten(treedef, [jax.device_put(a, leaf.sharding)
                                                  for a, (_, leaf) in zip(arrays, leaves)])
