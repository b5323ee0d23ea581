"""A training task's batch schema: each field's dtype, its global shape in named sizes, and whether the mesh splits
its rows over the batch axes or every device holds it whole.

One schema per task (`step.batch_schema` for the text task, `full_step.FULL_BATCH` for Full) feeds three places that
used to write the batch down each on their own: the jitted step's in_shardings (`shardings`), the assembly of the
global batch from each process's rows (`assemble`), and the compile-only registry's abstract arguments
(`abstract`, cfir_jax/aot/programs.py).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections
import numpy as np

from cfir_jax.training import partition


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a batch: `dims` names its global sizes (`sizes` resolves them from the config)."""

    dtype: str
    dims: tuple[str, ...]
    split: bool = True  # rows split over the mesh's batch axes; False: replicated on every device


Schema = dict[str, Field]


def sizes(config: ml_collections.ConfigDict) -> dict[str, int]:
    """The named sizes a schema's dims refer to, from the config."""
    return {"batch": int(config.train.global_batch), "tokens": int(config.train.max_text_len),
            "embed": int(config.model.embed_dim), "side": int(config.model.image_size), "rgb": 3,
            "negatives": int(config.train.extra_negatives)}


def shardings(schema: Schema, mesh) -> dict:
    """The step's in_shardings for the batch."""
    split, whole = partition.batch_sharding(mesh), partition.replicated(mesh)
    return {name: split if field.split else whole for name, field in schema.items()}


def abstract(schema: Schema, config: ml_collections.ConfigDict, mesh) -> dict:
    """The global batch by shape alone, with its shardings (compile-only)."""
    size, sh = sizes(config), shardings(schema, mesh)
    return {name: jax.ShapeDtypeStruct(tuple(size[d] for d in field.dims), np.dtype(field.dtype), sharding=sh[name])
            for name, field in schema.items()}


def assemble(schema: Schema, host: dict, mesh) -> dict:
    """The global batch's jax.Arrays from this process's host arrays: its rows of every split field, and the whole
    of every replicated one (the same on every process)."""
    if set(host) != set(schema):
        raise ValueError(f"batch fields {sorted(host)} are not the schema's {sorted(schema)}")
    sh = shardings(schema, mesh)
    out = {}
    for name, field in schema.items():
        value = np.asarray(host[name], np.dtype(field.dtype))
        out[name] = (jax.make_array_from_process_local_data(sh[name], value) if field.split
                     else jax.device_put(value, sh[name]))
    return out
