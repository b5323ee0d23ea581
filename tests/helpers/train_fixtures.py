"""Small training problems for the trainer tests: a tiny config and planted (text, image) pairs."""

from __future__ import annotations

import numpy as np

from cfir_jax.training.data import EvalData, TrainData


def tiny_config(**train):
    from configs.base import get_config

    cfg = get_config("runlocal")
    cfg.model.update(vocab_size=64, max_text_positions=24, embed_dim=32, num_heads=2, ffn_dim=64, num_layers=2)
    cfg.train.update(dict(max_text_len=8, global_batch=8, num_steps=6, warmup_steps=1, lr=3e-3, log_every=1,
                          eval_every=3, checkpoint_every=2, eval_batch=8, async_checkpoints=False,
                          tensorboard=False, seed=0) | train)
    return cfg


def planted_data(num_pairs: int = 64, dim: int = 32, seed: int = 0, with_eval: bool = True) -> TrainData:
    """Text i is a short token sequence identifying image i; images are random unit vectors."""
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(num_pairs, dim)).astype(np.float32)
    images /= np.linalg.norm(images, axis=1, keepdims=True)
    ids = np.ones((num_pairs, 8), np.int32)
    ids[:, 0] = 0
    ids[:, 1:4] = rng.integers(4, 64, size=(num_pairs, 3))
    ids[:, 4] = 2
    mask = ids == 1
    eval_data = None
    if with_eval:
        q = np.arange(0, num_pairs, 4)
        eval_data = EvalData(ids[q], mask[q], [f"d{i}" for i in q], images, [f"i{j}" for j in range(num_pairs)],
                             {f"d{i}": {f"i{i}": 1} for i in q})
    return TrainData(ids, mask, np.arange(num_pairs), np.arange(num_pairs), images, eval_data)


def full_config(**train):
    """configs/base.py:full at test size: 2 layers, 64 dims, 32 px images (patch 16: 4 patches), 64 token ids."""
    from configs.base import get_config

    cfg = get_config("full,runlocal")
    cfg.model.update(vocab_size=64, max_text_positions=24, image_size=32, dropout=0.0, drop_path_rate=0.0)
    cfg.train.update(dict(max_text_len=8, global_batch=8, num_steps=4, warmup_steps=1, lr=1e-3, log_every=1,
                          async_checkpoints=False, tensorboard=False, seed=0) | train)
    return cfg


def full_batch(batch: int = 8, image_size: int = 32, length: int = 8, seed: int = 0, invalid=(5,)) -> dict:
    """A Full step's batch as the image pipeline and the tokenizer give it (numpy): uint8 pixels, token ids with
    BOS/EOS and padding, `valid` False at `invalid` (a corrupt image: zero pixels, as the pipeline fills it)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(batch, image_size, image_size, 3), dtype=np.uint8)
    ids = np.ones((batch, length), np.int32)
    lengths = rng.integers(3, length + 1, size=batch)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(4, 64, size=n)
        ids[i, 0], ids[i, n - 1] = 0, 2
    valid = np.ones(batch, bool)
    valid[list(invalid)] = False
    pixels[~valid] = 0
    return {"pixels": pixels, "ids": ids, "mask": ids == 1, "valid": valid}
