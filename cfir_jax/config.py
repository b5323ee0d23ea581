"""Model sizes and the config tree shared by `configs/*.py`.

Every config is an `ml_collections.ConfigDict` with sections `model`, `data`, `index`, `train`, `retrieval`.
`configs/base.py` and `configs/large.py` call `build_config` with their size; a variant string passed after the
colon (`configs/base.py:384`, `configs/large.py:runlocal`) picks the image size or shrinks the run to CPU scale.
"""

from __future__ import annotations

import ml_collections

# REFERENCE §1. Head dim is 64 for both; the text vocabulary has 64010 rows (64002 used, padded).
MODEL_SIZES = {
    "tiny": dict(embed_dim=64, num_layers=2, num_heads=4, ffn_dim=256),
    "base": dict(embed_dim=768, num_layers=12, num_heads=12, ffn_dim=3072),
    "large": dict(embed_dim=1024, num_layers=24, num_heads=16, ffn_dim=4096),
}


def model_config(size: str = "base", image_size: int = 224, **overrides) -> ml_collections.ConfigDict:
    """The `model` section: architecture, precision and compilation switches."""
    cfg = ml_collections.ConfigDict(
        dict(
            **MODEL_SIZES[size],
            vocab_size=64010,
            image_size=image_size,
            patch_size=16,
            in_chans=3,
            max_text_positions=1024,
            layernorm_eps=1e-5,
            # Regularisation, active only when a dropout rng is passed (training).
            dropout=0.0,
            drop_path_rate=0.0,
            # Compute dtype (activations, matmuls); parameters stay in param_dtype.
            dtype="float32",
            param_dtype="float32",
            # jax.lax.scan over the stacked layers: one compiled layer (fast compiles for 24 layers).
            scan_layers=True,
            # Rematerialise each layer in the backward pass (activation memory / compute trade).
            remat=False,
        )
    )
    cfg.update(overrides)
    return cfg


def parse_variant(arg: str | None) -> tuple[int | None, set[str]]:
    """'384,runlocal' -> (384, {'runlocal'})."""
    image_size, flags = None, set()
    for token in (arg or "").split(","):
        token = token.strip()
        if not token:
            continue
        if token.isdigit():
            image_size = int(token)
        else:
            flags.add(token)
    unknown = flags - {"runlocal"}
    if unknown:
        raise ValueError(f"unknown config variant(s) {sorted(unknown)}: use an image size (224, 384) or 'runlocal'")
    return image_size, flags


def build_config(size: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """The full config of a model size; the training/index/retrieval sections are filled by their modules."""
    image_size, flags = parse_variant(arg)
    runlocal = "runlocal" in flags
    cfg = ml_collections.ConfigDict()
    cfg.model = model_config("tiny" if runlocal else size, image_size or 224)
    cfg.size = size
    cfg.runlocal = runlocal
    return cfg
