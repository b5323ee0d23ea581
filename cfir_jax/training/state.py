"""Training state: the trained tower's abstract shapes and shardings on the mesh, initialisation, restore, export.

The tower is `text` (CFIR: the `TextTower` alone, images from the cache) or `dual` (D-BEiT-3 Full: the whole
`DBeit3`, images encoded from pixels in the step); either is split by the config's trainable rules into `params`
(trained) and `frozen`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.experimental.multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from cfir_jax.core.config_check import TOWERS
from cfir_jax.core.errors import CfirError
from cfir_jax.model import beit3 as model_lib
from cfir_jax.model import checkpoint
from cfir_jax.stores.layout import Layout
from cfir_jax.training import partition
from cfir_jax.training.optim import make_optimizer, trainable_filter


@dataclasses.dataclass
class Setup:
    """Everything derived once from the config: the mesh, the tower's graph, shardings, optimizer, schedule."""

    mesh: jax.sharding.Mesh
    tower: str  # 'text' or 'dual' (TOWERS)
    graphdef: Any
    abstract_params: Any
    abstract_frozen: Any
    param_shardings: Any
    frozen_shardings: Any
    state_shardings: Any
    abstract_state: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule


def tower_kind(config: ml_collections.ConfigDict) -> str:
    """'text' (train.images='cache', CFIR) or 'dual' (train.images='pixels', D-BEiT-3 Full)."""
    return TOWERS[config.train.images]  # a key of TOWERS (cfir_jax.core.config_check)


def _tower(model_cfg, seed: int = 0, kind: str = "text") -> model_lib.TextTower | model_lib.DBeit3:
    model = model_lib.create_model(model_cfg, seed)
    return model.text_tower() if kind == "text" else model


def make_setup(config: ml_collections.ConfigDict, total_steps: int, devices=None,
               steps_per_epoch: int | None = None, tower: str | None = None) -> Setup:
    """`steps_per_epoch` turns `train.warmup_epochs` into steps (needed unless `train.warmup_steps` > 0); `tower`
    ('text' or 'dual') defaults to the config's (`tower_kind`)."""
    tower = tower or tower_kind(config)
    if tower not in TOWERS.values():
        raise CfirError(f"tower {tower!r}: use one of {', '.join(TOWERS.values())}")
    mesh = partition.make_mesh(config.mesh.data, config.mesh.fsdp, devices)
    pred = trainable_filter(config.train.trainable)
    abstract_tower = nnx.eval_shape(lambda: _tower(config.model, kind=tower))
    graphdef, abs_params, abs_frozen = nnx.split(abstract_tower, pred, ...)
    # The logical axis names the model declares on each Variable, as PartitionSpecs of names.
    names_params, names_frozen = (nnx.to_pure_dict(nnx.get_partition_spec(s)) for s in (abs_params, abs_frozen))
    abs_params, abs_frozen = nnx.to_pure_dict(abs_params), nnx.to_pure_dict(abs_frozen)
    rules = config.mesh.logical_axis_rules
    param_sh = partition.tree_shardings(abs_params, names_params, mesh, rules)
    frozen_sh = partition.tree_shardings(abs_frozen, names_frozen, mesh, rules)
    tx, schedule = make_optimizer(config.train, abs_params, config.model.num_layers, total_steps, steps_per_epoch)
    abs_opt = jax.eval_shape(tx.init, abs_params)
    # Every parameter-shaped tree in the optimizer state (Adam's moments) takes the parameters' shardings; the
    # rest (step counts) is replicated.
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, abs_opt, param_sh,
                                   transform_non_params=lambda _: partition.replicated(mesh))
    rep = partition.replicated(mesh)
    state_sh = {"step": rep, "rng": rep, "params": param_sh, "opt_state": opt_sh}
    abstract_state = {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
        "params": abs_params,
        "opt_state": abs_opt,
    }
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abstract_state, state_sh)
    return Setup(mesh, tower, graphdef, abs_params, abs_frozen, param_sh, frozen_sh, state_sh, abstract_state, tx,
                 schedule)


def init_state(config, setup: Setup, init_model: str | None) -> tuple[dict, dict]:
    """(state, frozen) created directly with their shardings: from the init model directory when given (partial
    orbax restore of the text tower only), else from the seed."""
    pred = trainable_filter(config.train.trainable)
    rep = partition.replicated(setup.mesh)
    if init_model:
        params, frozen = restore_tower(init_model, setup, config.model)
    else:

        def make():
            tower = _tower(config.model, config.train.seed, setup.tower)
            _, p, f = nnx.split(tower, pred, ...)
            return nnx.to_pure_dict(p), nnx.to_pure_dict(f)

        params, frozen = jax.jit(make, out_shardings=(setup.param_shardings, setup.frozen_shardings))()
    opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings["opt_state"])(params)
    rng = jax.device_put(np.asarray(jax.random.key_data(jax.random.key(config.train.seed)), np.uint32), rep)
    state = {"step": jax.device_put(np.int32(0), rep), "rng": rng, "params": params, "opt_state": opt_state}
    return state, frozen


def restore_tower(model_dir: str, setup: Setup, model_config) -> tuple[dict, dict]:
    """Restores only the setup's tower's parameters from a model directory (the text tower, or the whole model),
    straight into their shardings."""

    stored = checkpoint.read_model_manifest(model_dir)["model_config"]  # one-line error if missing/incomplete
    for key in ("embed_dim", "num_layers", "num_heads", "ffn_dim", "vocab_size", "max_text_positions"):
        if stored.get(key) != model_config[key]:
            raise CfirError(f"{model_dir}: init model has {key}={stored.get(key)} but the config has "
                            f"{model_config[key]}: it is a model of another size")
    if setup.tower == "dual":  # the vision tower is restored too: its patch grid (position table) must be the config's
        for key in ("image_size", "patch_size"):
            if stored.get(key) != model_config[key]:
                raise CfirError(f"{model_dir}: init model has {key}={stored.get(key)} but the config has "
                                f"{model_config[key]}; convert the BEiT-3 checkpoint at the config's size (python -m "
                                f"cfir_jax.model.convert --checkpoint PTH --config CONFIG --out DIR resizes the "
                                f"vision position table) or set --config.model.{key}={stored.get(key)}")
    target = _nest(_flat(setup.abstract_params) | _flat(setup.abstract_frozen))
    shardings = _nest(_flat(setup.param_shardings) | _flat(setup.frozen_shardings))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
    with ocp.PyTreeCheckpointer() as ckptr:
        restored = ckptr.restore(Path(model_dir).absolute() / "params", args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    flat = _flat(restored)
    params = _nest({k: flat[k] for k in _flat(setup.abstract_params)})
    frozen = _nest({k: flat[k] for k in _flat(setup.abstract_frozen)})
    return params, frozen


def _flat(tree) -> dict[str, Any]:
    return {model_lib.param_path(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def export_model(config, setup: Setup | None, params, frozen, out_dir: Path, vision_from: str, **manifest) -> None:
    """Writes the full model (vision tower from `vision_from`, trained text tower; a Full run's params and frozen
    cover both towers) as a model directory; `manifest`: extra manifest fields."""
    gather = (functools.partial(jax.experimental.multihost_utils.process_allgather, tiled=True)
              if jax.process_count() > 1 else jax.device_get)
    text = _flat(gather(params)) | _flat(gather(frozen))
    if vision_from == "scratch":
        model = model_lib.create_model(config.model, config.train.seed)
    else:
        model = checkpoint.load_model(vision_from)
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    flat = _flat(pure)
    for name, value in text.items():
        flat[name] = np.asarray(value)
    nnx.replace_by_pure_dict(state, _nest(flat))
    nnx.update(model, state)
    if jax.process_index() == 0:
        trained_from = vision_from if vision_from == "scratch" else Layout(out_dir.parent.parent.absolute()
                                                                           ).portable(vision_from)
        checkpoint.save_model(model, out_dir, trained_from=trained_from, train_text=config.train.text,
                              train_max_text_len=config.train.max_text_len, **manifest)
