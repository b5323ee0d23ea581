"""Model directories: the parameters of a DBeit3 as an orbax checkpoint, its config, and its fingerprints.

Layout of a model directory (written by `python -m cfir_jax.model.convert` and by training's export):
    DIR/manifest.json      kind "model": model config, parameter count, fingerprints
    DIR/params/            orbax StandardCheckpointer tree of every nnx.Param

Fingerprints identify the weights that a store depends on: the image cache depends only on the vision tower
(`vision`), the entity index on the text tower that encoded the entities (`text`). Since training never touches the
vision tower, a trained model keeps the vision fingerprint of its initial checkpoint and can use the same cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from cfir_jax.core.config import model_config
from cfir_jax.core.errors import StoreError, abandoned_restore, first_line
from cfir_jax.model import beit3 as model_lib
from cfir_jax.model import params_files, program_cache
from cfir_jax.stores.contract import atomic_dir, read_manifest, write_manifest

FORMAT_VERSION = 1
# Parameters each fingerprint covers (regex over the '/'-joined parameter path).
TOWERS = {
    "vision": r"(vision_embed|A|vision_head)/.*",
    "text": r"(text_embed|B|language_head)/.*",
}


def fingerprint(model: model_lib.DBeit3, tower: str) -> str:
    """A short hash of the config and the values of one tower's parameters (stable across dtypes of storage)."""
    h = hashlib.sha256()
    cfg = model.config
    for key in ("embed_dim", "num_layers", "num_heads", "ffn_dim", "vocab_size", "patch_size", "image_size"):
        h.update(f"{key}={cfg[key]};".encode())
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for path, leaf in sorted(leaves, key=lambda kv: model_lib.param_path(kv[0])):
        name = model_lib.param_path(path)
        if re.fullmatch(TOWERS[tower], name):
            h.update(name.encode())
            h.update(np.asarray(jax.device_get(leaf), np.float32).tobytes())
    return f"{tower}-{h.hexdigest()[:16]}"


def _this_process_only():
    """Orbax options for a model directory that this process writes or reads alone: in a jax.distributed run, the
    trainer's export happens on process 0 only and each process of an index build loads its own copy, so orbax must
    not wait for the other processes (it would, forever, on its default barrier over all of them)."""
    # why: orbax loads only when a model is saved or restored
    import orbax.checkpoint as ocp

    process = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=process, active_processes={process})


def save_model(model: model_lib.DBeit3, directory: str | os.PathLike, **extra: Any) -> dict:
    """Writes `model` to a model directory atomically; returns the manifest."""
    # why: orbax loads only when a model is saved or restored
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    state = nnx.state(model, nnx.Param)
    with atomic_dir(directory) as tmp:
        with ocp.StandardCheckpointer(multiprocessing_options=_this_process_only()) as ckptr:
            # As host numpy arrays: orbax refuses to write a device array that lives on one process of several.
            ckptr.save(tmp / "params", jax.tree.map(np.asarray, nnx.to_pure_dict(state)))
        manifest = write_manifest(
            tmp,
            "model",
            FORMAT_VERSION,
            model_config=model.config.to_dict(),
            num_params=model_lib.count_params(model),
            vision_fingerprint=fingerprint(model, "vision"),
            text_fingerprint=fingerprint(model, "text"),
            **extra,
        )
    return manifest


def read_model_manifest(directory: str | os.PathLike) -> dict:
    return read_manifest(directory, "model", FORMAT_VERSION)


def load_model(directory: str | os.PathLike, config: ml_collections.ConfigDict | None = None) -> model_lib.DBeit3:
    """Restores a model directory. `config` (a `model` section) overrides precision/compile switches; its sizes
    must match the stored ones."""
    directory = Path(directory).absolute()
    manifest = read_model_manifest(directory)
    # A model saved before a switch existed (scan_layers, remat, ...) takes today's default for it.
    stored = ml_collections.ConfigDict({**model_config().to_dict(), **manifest["model_config"]})
    if config is not None:
        for key in ("embed_dim", "num_layers", "num_heads", "ffn_dim", "vocab_size", "image_size", "patch_size"):
            if key in config and config[key] != stored[key]:
                raise StoreError(
                    f"{directory}: model was saved with {key}={stored[key]} but the config asks for {config[key]}; "
                    "use the config of the saved model size"
                )
        merged = stored.copy_and_resolve_references()
        merged.update({k: v for k, v in config.items() if k in ("dtype", "scan_layers", "remat", "remat_policy",
                                                                  "dropout", "drop_path_rate")})
        stored = merged
    graphdef, abstract_state = _abstract(stored)
    # Onto this process's first device: the saved shardings name the saving process's devices, which another process
    # of a jax.distributed run does not have (each process of an index build holds its own copy of the model).
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                          nnx.to_pure_dict(abstract_state))
    nnx.replace_by_pure_dict(abstract_state, _restore(directory, target))
    return nnx.merge(graphdef, abstract_state)


def _restore(directory: Path, target: Any) -> Any:
    """The parameters of `directory` as `target`'s pytree: read straight from their files (`params_files.read`), or
    by orbax where that reader does not find exactly the target's arrays; one StoreError when neither can."""
    restored = params_files.read(directory / "params", target)
    if restored is not None:
        return restored
    # why: orbax loads only when a model is saved, or restored where the direct read gives way
    import orbax.checkpoint as ocp

    try:
        with ocp.StandardCheckpointer(multiprocessing_options=_this_process_only()) as ckptr:
            return ckptr.restore(directory / "params", target)
    except Exception as e:  # orbax and tensorstore wrap the OS error: name the file and what the OS (or reader) said
        abandoned_restore()
        raise StoreError(f"{directory}: cannot read the model's parameters: {_read_error(e, directory / 'params')}; "
                         f"check its files (index.py --verify --workdir W for a workdir's models)") from None


def _abstract(config: ml_collections.ConfigDict) -> tuple[Any, Any]:
    """The graph and a fresh abstract state (`jax.ShapeDtypeStruct` leaves, its own copy: a restore fills it in) of
    a model of `config`, made once per process (`program_cache.memo`: a query opens two models of one config, the
    trained one and the index encoder) and kept on disk (`program_cache.kept`: a later process skips the trace of
    the model's initialisers, a fifth of a second on a CPU)."""
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    graphdef, state = program_cache.memo("abstract-model", key, lambda: program_cache.kept(
        "abstract-model", [key, program_cache.code_digest("cfir_jax.model")],
        lambda: nnx.split(model_lib.abstract_model(config))))
    return graphdef, jax.tree.map(lambda leaf: leaf, state)


def model_summary(manifest: dict) -> str:
    cfg = manifest["model_config"]
    return (f"{cfg['embed_dim']}d x {cfg['num_layers']} layers, {manifest['num_params']:,} params, "
            f"{manifest['vision_fingerprint']}, {manifest['text_fingerprint']}")


def dump_config(config: ml_collections.ConfigDict, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str))


def _read_error(exc: BaseException, where: Path) -> str:
    """"PATH: what went wrong" from the OSError behind `exc` (its causes and contexts), else the first line of the
    innermost error's text (tensorstore reports damage in text), cut to 300 characters."""
    seen, chain = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        if isinstance(exc, OSError):
            return f"{exc.filename or where}: {exc.strerror or exc}"
        exc = exc.__cause__ or exc.__context__
    return first_line(chain[-1], 300)
