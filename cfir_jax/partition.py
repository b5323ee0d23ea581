"""The device mesh and the per-parameter rules: trainable or frozen, weight decay, layer-wise lr, sharding.

Rules are (regex over the '/'-joined parameter path, value) pairs; the first regex that fully matches wins, as
big_vision freezes a tower with `('img/.*', None)`. CFIR's "train only the language expert" is the one rule
`('B/.*|language_head/.*|logit_scale', 'train')` followed by `('.*', 'frozen')`.

Mesh axes: `data` (pure data parallelism) and `fsdp` (the batch is split over it too, and parameters whose rule
says 'fsdp' are sharded over it on their largest divisible dimension). Both axes carry the batch.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cfir_jax.errors import CfirError
from cfir_jax.model import param_path

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


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_spec(shape: tuple[int, ...], rule: str, fsdp_size: int) -> P:
    """'replicate' -> P(); 'fsdp' -> shard the largest dimension divisible by the fsdp axis size."""
    if rule == "replicate" or fsdp_size == 1 or not shape:
        return P()
    if rule != "fsdp":
        raise CfirError(f"unknown sharding rule {rule!r}: use 'replicate' or 'fsdp'")
    order = sorted(range(len(shape)), key=lambda i: -shape[i])
    for i in order:
        if shape[i] % fsdp_size == 0:
            spec = [None] * len(shape)
            spec[i] = "fsdp"
            return P(*spec)
    return P()


def tree_shardings(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, str]]) -> Any:
    """NamedShardings for every leaf of a parameter tree (abstract or concrete) by the sharding rules."""
    fsdp_size = mesh.shape["fsdp"]

    def one(path, leaf):
        return NamedSharding(mesh, param_spec(tuple(leaf.shape), first_match(param_path(path), rules, "sharding"),
                                              fsdp_size))

    return jax.tree_util.tree_map_with_path(one, tree)


def tree_mask(tree: Any, regex: str) -> Any:
    """A bool tree: True where the parameter path fully matches `regex`."""
    return jax.tree_util.tree_map_with_path(lambda p, _: re.fullmatch(regex, param_path(p)) is not None, tree)


def layer_lr_scales(tree: Any, num_layers: int, decay: float) -> Any:
    """Layer-wise lr decay factors (REFERENCE §2): embeddings = layer 0, layers.i = i + 1, the rest = L + 1;
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
