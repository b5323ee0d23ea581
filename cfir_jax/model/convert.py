"""Conversion of the official BEiT-3 PyTorch checkpoints into a DBeit3.

    python -m cfir_jax.model.convert --checkpoint beit3_base_itc_patch16_224.pth --config configs/base.py --out DIR

Accepts a path or a state dict; weights under 'model', 'module' or at the top level; keys with or without the
`beit3.` prefix. Every key and shape is validated before anything is written, and the vision position table is
resized bicubically (exactly as `torch.nn.functional.interpolate(mode='bicubic', align_corners=False)`, as the
reference does) when the checkpoint was trained at another image size. Torch is needed only to read `.pth` files.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from cfir_jax.core.cli import cli_main, load_config_file
from cfir_jax.core.errors import CfirError
from cfir_jax.model import beit3 as model_lib
from cfir_jax.model import checkpoint

# Per-expert parameter names inside a torchscale encoder layer -> our Block attribute.
_LAYER_KEYS = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.out_proj": "out_proj",
    "self_attn.inner_attn_ln": "inner_attn_ln",
    "self_attn_layer_norm": "self_attn_layer_norm",
    "ffn.{e}.fc1": "fc1",
    "ffn.{e}.ffn_layernorm": "ffn_layernorm",
    "ffn.{e}.fc2": "fc2",
    "final_layer_norm": "final_layer_norm",
}
_HEADS = ("vision_head.weight", "language_head.weight", "logit_scale")
NUM_EXTRA_POSITIONS = 3  # cls token + the two unused fairseq rows


class CheckpointError(CfirError):
    """A checkpoint that does not fit the configured model."""


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().float().numpy()
    return np.asarray(value, dtype=np.float32)


def read_state_dict(path_or_state_dict: str | os.PathLike | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Loads a checkpoint file (torch.load with weights_only=True) or takes a dict; returns numpy arrays keyed
    without the 'beit3.' prefix."""
    if isinstance(path_or_state_dict, Mapping):
        raw = path_or_state_dict
    else:
        path = Path(path_or_state_dict)
        if not path.is_file():
            raise CheckpointError(f"{path}: checkpoint file not found")
        try:
            # why: torch loads only to read an official PyTorch checkpoint
            import torch

        except ImportError:
            raise CheckpointError("reading .pth checkpoints needs torch: pip install 'cfir-jax[torch]'") from None
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many types for corrupt or non-checkpoint files
            raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({e.__class__.__name__})") from None
    for key in ("model", "module"):
        if isinstance(raw, Mapping) and key in raw and isinstance(raw[key], Mapping):
            raw = raw[key]
            break
    if not isinstance(raw, Mapping) or not raw:
        raise CheckpointError("checkpoint holds no state dict (expected a dict of tensors, maybe under 'model')")
    out = {}
    for key, value in raw.items():
        key = key[len("beit3."):] if key.startswith("beit3.") else key
        out[key] = _to_numpy(value)
    return out


def bicubic_resize(grid: np.ndarray, size: int) -> np.ndarray:
    """[h, w, C] -> [size, size, C] with PyTorch's bicubic (A = -0.75, align_corners=False, clamped borders).

    Hand-written because jax.image.resize's cubic is Keys' A = -0.5 (and antialiases when shrinking): it would not
    reproduce the reference's resized position tables."""

    def weights(in_size: int, out_size: int) -> np.ndarray:
        a = -0.75
        scale = in_size / out_size
        w = np.zeros((out_size, in_size), np.float64)
        for i in range(out_size):
            src = (i + 0.5) * scale - 0.5
            i0 = int(np.floor(src))
            t = src - i0
            coeffs = [
                ((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
                ((a + 2) * t - (a + 3)) * t * t + 1,
                ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1,
                ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a,
            ]
            for j, c in enumerate(coeffs):
                w[i, min(max(i0 - 1 + j, 0), in_size - 1)] += c
        return w

    h, w_, _ = grid.shape
    out = np.einsum("ih,hwc->iwc", weights(h, size), grid.astype(np.float64))
    out = np.einsum("jw,iwc->ijc", weights(w_, size), out)
    return out.astype(np.float32)


def interpolate_vision_positions(table: np.ndarray, num_patches: int) -> np.ndarray:
    """Resizes the vision position table [3 + n*n, D] to [3 + num_patches, D] (the first 3 rows are kept)."""
    extra, grid = table[:NUM_EXTRA_POSITIONS], table[NUM_EXTRA_POSITIONS:]
    old, new = int(round(grid.shape[0] ** 0.5)), int(round(num_patches**0.5))
    if old * old != grid.shape[0] or new * new != num_patches:
        raise CheckpointError(f"vision position table of {table.shape[0]} rows is not 3 + a square grid")
    if old == new:
        return table
    grid = bicubic_resize(grid.reshape(old, old, -1), new).reshape(new * new, -1)
    return np.concatenate([extra, grid], axis=0)


def _embeddings(take, config: Any) -> dict[str, Any]:
    """The token embedding table and the patch embedding (with the CLS and mask tokens)."""
    d, p = config.embed_dim, config.patch_size
    return {
        "text_embed": {"embedding": take("text_embed.weight", (config.vocab_size, d))},
        "vision_embed": {
            "cls_token": take("vision_embed.cls_token", (1, 1, d)),
            "mask_token": take("vision_embed.mask_token", (1, 1, d)),
            "proj": {
                # OIHW -> HWIO
                "kernel": take("vision_embed.proj.weight", (d, config.in_chans, p, p)).transpose(2, 3, 1, 0),
                "bias": take("vision_embed.proj.bias", (d,)),
            },
        },
    }


def _tower(expert: str, rows: int, take, config: Any) -> dict[str, Any]:
    """One expert's tower (A: vision, B: language): its position table, final LayerNorm and stacked layers [n, ...];
    take(key, shape) reads and checks a checkpoint tensor."""
    d, f, n = config.embed_dim, config.ffn_dim, config.num_layers
    tower: dict[str, Any] = {
        "embed_positions": take(f"encoder.embed_positions.{expert}.weight", (rows, d)),
        "layer_norm": {
            "scale": take(f"encoder.layer_norm.{expert}.weight", (d,)),
            "bias": take(f"encoder.layer_norm.{expert}.bias", (d,)),
        },
        "layers": {},
    }
    for torch_name, ours in _LAYER_KEYS.items():
        prefix = torch_name.format(e=expert)
        if "{e}" not in torch_name:
            prefix = f"{torch_name}.{expert}"
        is_norm = "norm" in ours or ours == "inner_attn_ln"
        fan_in = f if ours == "fc2" else d
        fan_out = f if ours in ("fc1", "ffn_layernorm") else d
        weights, biases = [], []
        for i in range(n):
            key = f"encoder.layers.{i}.{prefix}"
            if is_norm:
                weights.append(take(f"{key}.weight", (fan_out,)))
            else:
                weights.append(take(f"{key}.weight", (fan_out, fan_in)).T)  # [out, in] -> [in, out]
            biases.append(take(f"{key}.bias", (fan_out,)))
        tower["layers"][ours] = {"scale" if is_norm else "kernel": np.stack(weights), "bias": np.stack(biases)}
    return tower


def torch_to_params(state: Mapping[str, np.ndarray], config: Any, allow_missing_heads: bool = False) -> dict:
    """Maps torch keys to a nested dict of our parameter paths (as `nnx.to_pure_dict` lays them out), validating
    every key and shape against `config`."""
    d, n = config.embed_dim, config.num_layers
    p = config.patch_size
    num_patches = (config.image_size // p) ** 2
    state = dict(state)
    used: set[str] = set()

    def take(key: str, shape: tuple[int, ...]) -> np.ndarray:
        if key not in state:
            raise CheckpointError(f"checkpoint has no key {key!r} (expected shape {shape})")
        value = state[key]
        used.add(key)
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(
                f"checkpoint key {key!r} has shape {tuple(value.shape)} but the model expects {tuple(shape)}: "
                "the checkpoint is for another model size or config"
            )
        return value

    layer_ids = {int(m.group(1)) for k in state if (m := re.match(r"encoder\.layers\.(\d+)\.", k))}
    if layer_ids and max(layer_ids) + 1 != n:
        raise CheckpointError(
            f"checkpoint has {max(layer_ids) + 1} encoder layers but the config has {n}: use the config of its size"
        )

    params: dict[str, Any] = _embeddings(take, config)
    pos_a = state.get("encoder.embed_positions.A.weight")
    if pos_a is not None and pos_a.ndim == 2 and pos_a.shape[1] == d:
        state["encoder.embed_positions.A.weight"] = interpolate_vision_positions(pos_a, num_patches)
    for expert, rows in (("A", num_patches + NUM_EXTRA_POSITIONS), ("B", config.max_text_positions)):
        params[expert] = _tower(expert, rows, take, config)

    missing_heads = [k for k in _HEADS if k not in state]
    if missing_heads and not allow_missing_heads:
        raise CheckpointError(
            f"checkpoint has no retrieval heads ({', '.join(missing_heads)}): it is a pretraining checkpoint; "
            "use an itc/retrieval checkpoint or pass --init-missing-heads"
        )
    for key, ours in (("vision_head.weight", "vision_head"), ("language_head.weight", "language_head")):
        if key in state:
            params[ours] = {"kernel": take(key, (d, d)).T}
    if "logit_scale" in state:
        params["logit_scale"] = take("logit_scale", ()).reshape(())

    unexpected = sorted(set(state) - used)
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} key(s) the model does not use, first {unexpected[0]!r}: "
            "is it a BEiT-3 checkpoint of this size?"
        )
    return params


def load_torch_checkpoint(
    path_or_state_dict: str | os.PathLike | Mapping[str, Any], model_config: Any, allow_missing_heads: bool = False
) -> model_lib.DBeit3:
    """Builds a DBeit3 for `model_config` holding the weights of an official BEiT-3 PyTorch checkpoint."""
    params = torch_to_params(read_state_dict(path_or_state_dict), model_config, allow_missing_heads)
    model = model_lib.create_model(model_config)
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    _merge_into(pure, params)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model


def _merge_into(target: dict, source: dict) -> None:
    for key, value in source.items():
        if isinstance(value, dict):
            _merge_into(target[key], value)
        else:
            target[key] = np.asarray(value, dtype=np.asarray(target[key]).dtype)


@cli_main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="official BEiT-3 .pth file")
    parser.add_argument("--config", required=True, help="config file, e.g. configs/base.py or configs/large.py:384")
    parser.add_argument("--out", required=True, help="model directory to write (orbax)")
    parser.add_argument("--init-missing-heads", action="store_true",
                        help="accept a pretraining checkpoint without retrieval heads (heads randomly initialised)")
    args = parser.parse_args(argv)
    config = load_config_file(args.config)
    model = load_torch_checkpoint(args.checkpoint, config.model, allow_missing_heads=args.init_missing_heads)
    manifest = checkpoint.save_model(model, args.out, source=str(Path(args.checkpoint).name))
    print(f"wrote {args.out}: {checkpoint.model_summary(manifest)}")


if __name__ == "__main__":
    main()
