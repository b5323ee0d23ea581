"""Small training problems for the trainer tests: a tiny config and planted (text, image) pairs."""

from __future__ import annotations

import numpy as np

from cfir_jax.train.data import EvalData, TrainData


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
