"""The device mesh, logical-axis sharding and the per-parameter rules: trainable or frozen, weight decay, layer lr.

Rules are (regex over the '/'-joined parameter path, value) pairs; the first regex that fully matches wins, as
big_vision freezes a tower with `('img/.*', None)`. CFIR's "train only the language expert" is the one rule
`('B/.*|language_head/.*|logit_scale', 'train')` followed by `('.*', 'frozen')`.

Mesh axes: `data` (pure data parallelism) and `fsdp` (the batch is split over it too, and parameter axes that the
config's logical_axis_rules map to 'fsdp' are sharded over it). Both axes carry the batch. Parameters declare
logical axis names in the model (`model.axes`: 'embed', 'mlp', 'heads', 'vocab', 'layers', ...); the config's
(logical name, mesh axis) pairs decide the layout, so a new layout is a config change, not a code change.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cfir_jax.core.errors import CfirError
from cfir_jax.model.beit3 import param_path

MESH_AXES = ("data", "fsdp")
BATCH_AXES = ("data", "fsdp")


def first_match(path: str, rules: Sequence[tuple[str, Any]], what: str) -> Any:
    for regex, value in rules:
        if re.fullmatch(regex, path):
            return value
    raise CfirError(f"no {what} rule matches parameter {path!r}: end the rule list with ('.*', ...)")


def make_mesh(data: int = -1, fsdp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'fsdp') mesh over all devices; -1 takes what the other axis leaves."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    if fsdp == -1:
        fsdp = n // (data if data > 0 else 1)
    if data == -1:
        data = n // fsdp
    if data * fsdp != n:
        raise CfirError(f"mesh data={data} x fsdp={fsdp} does not cover the {n} devices")
    # Auto axes: the compiler propagates shardings from the annotated inputs/outputs (jit + NamedSharding).
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh((data, fsdp), MESH_AXES, axis_types=auto, devices=devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def activation_sharding(mesh: Mesh) -> NamedSharding:
    """[batch, seq, dim] activations: the batch over both batch axes, as the batch itself."""
    return NamedSharding(mesh, P(BATCH_AXES, None, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def logical_spec(names: Sequence[str | None], shape: Sequence[int], rules: Sequence[tuple[str, Any]], mesh: Mesh,
                 what: str = "parameter") -> P:
    """The mesh PartitionSpec of an array whose axes carry logical `names` (as `model.axes` declares them).

    `rules` are (logical name, mesh axis or None) pairs in priority order, as MaxText's logical_axis_rules: walking
    the rules, each one places its mesh axis on the array's axis of that name when both are still free (a mesh axis
    shards one dimension at most), so `[("mlp", "fsdp"), ("embed", "fsdp")]` shards an FFN kernel [embed, mlp] on
    'mlp' and an attention kernel [embed, heads] on 'embed'; None replicates. A logical name without any rule, or
    a dimension the mesh axis does not divide, is a CfirError.
    """
    for name in names:
        if name is not None and all(logical != name for logical, _ in rules):
            raise CfirError(f"{what}: no logical_axis_rules entry for axis {name!r}; add ({name!r}, mesh axis or None)")
    spec: list[Any] = [None] * len(names)
    settled = [name is None for name in names]
    used: set[str] = set()
    for logical, axis in rules:
        axes = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
        if any(a not in mesh.shape for a in axes):
            raise CfirError(f"logical_axis_rules: ({logical!r}, {axis!r}) names no axis of the mesh {MESH_AXES}")
        for i, name in enumerate(names):
            if settled[i] or name != logical or used.intersection(axes):
                continue
            size = int(np.prod([mesh.shape[a] for a in axes]))
            if shape[i] % size:
                raise CfirError(f"{what}: axis {name!r} of size {shape[i]} is not divisible by mesh axis {axis!r} of "
                                f"size {size}; map {name!r} to None or choose a mesh that divides it")
            spec[i], settled[i] = axis, True
            used.update(axes)
    return P(*spec)


def tree_shardings(tree: Any, logical: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> Any:
    """NamedShardings for every leaf of a parameter tree (abstract or concrete) from `logical`, the same tree with a
    PartitionSpec of logical axis names per leaf (`nnx.get_partition_spec` of the model's state)."""

    def one(path, leaf, names):
        return NamedSharding(mesh, logical_spec(tuple(names), leaf.shape, rules, mesh, param_path(path)))

    return jax.tree_util.tree_map_with_path(one, tree, logical, is_leaf=lambda x: isinstance(x, P))


def tree_mask(tree: Any, regex: str) -> Any:
    """A bool tree: True where the parameter path fully matches `regex`."""
    return jax.tree_util.tree_map_with_path(lambda p, _: re.fullmatch(regex, param_path(p)) is not None, tree)


def layer_lr_scales(tree: Any, num_layers: int, decay: float) -> Any:
    """Layer-wise lr decay factors: embeddings = layer 0, layers.i = i + 1, the rest = L + 1;
    a parameter of layer j is scaled by decay ** (L + 1 - j). Stacked layer parameters get a [L, 1, ...] array."""

    def one(path, leaf):
        name = param_path(path)
        if "/layers/" in name:
            depth = np.arange(1, num_layers + 1)
            scale = decay ** (num_layers + 1 - depth)
            return scale.reshape((num_layers,) + (1,) * (len(leaf.shape) - 1)).astype(np.float32)
        if "embed" in name:
            return np.float32(decay ** (num_layers + 1))
        return np.float32(1.0)

    return jax.tree_util.tree_map_with_path(one, tree)
