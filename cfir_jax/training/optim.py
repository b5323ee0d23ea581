"""The optimiser: AdamW with warmup + cosine, weight-decay mask, layer-wise lr decay, and which parameters train."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.experimental.multihost_utils
import ml_collections
import optax

from cfir_jax.core.config import TRAINABLE_SETS
from cfir_jax.core.errors import CfirError
from cfir_jax.training import partition


def warmup_steps(cfg: ml_collections.ConfigDict, steps_per_epoch: int | None) -> int:
    """The warmup length in steps: `warmup_steps` when > 0, else `warmup_epochs` epochs of `steps_per_epoch`."""
    if cfg.warmup_steps > 0:
        return int(cfg.warmup_steps)
    if not cfg.warmup_epochs:
        return 0
    if steps_per_epoch is None:
        raise ValueError("train.warmup_epochs needs the number of steps per epoch (pass steps_per_epoch)")
    return int(round(cfg.warmup_epochs * steps_per_epoch))


def make_schedule(cfg: ml_collections.ConfigDict, total_steps: int, steps_per_epoch: int | None = None
                  ) -> optax.Schedule:
    """Linear warmup from 0 to lr, then cosine to min_lr (the reference's schedule)."""
    warmup = min(warmup_steps(cfg, steps_per_epoch), max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(total_steps, warmup + 1), cfg.min_lr)


def make_optimizer(cfg: ml_collections.ConfigDict, params: Any, num_layers: int, total_steps: int,
                   steps_per_epoch: int | None = None):
    """AdamW with the weight-decay mask and layer-wise lr decay of the config; returns (optimizer, schedule)."""
    schedule = make_schedule(cfg, total_steps, steps_per_epoch)
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    decay_mask = jax.tree.map(lambda no_decay: not no_decay, partition.tree_mask(params, cfg.no_weight_decay))
    parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
    if cfg.layer_decay != 1.0:
        scales = partition.layer_lr_scales(params, num_layers, cfg.layer_decay)
        parts.append(optax.stateless(lambda updates, _: jax.tree.map(lambda u, s: u * s, updates, scales)))
    parts.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*parts), schedule


def trainable_rules(trainable) -> list:
    """`train.trainable` as a rule list: a name of config.TRAINABLE_SETS, or the rules themselves."""
    if isinstance(trainable, str):
        if trainable not in TRAINABLE_SETS:
            raise CfirError(f"train.trainable={trainable!r}: use one of {', '.join(TRAINABLE_SETS)} or a rule list")
        return TRAINABLE_SETS[trainable]
    return list(trainable)


def trainable_filter(trainable) -> Callable:
    """An nnx filter: True for parameters whose first matching rule is 'train' (`trainable` as trainable_rules)."""
    rules = trainable_rules(trainable)

    def pred(path, _value) -> bool:
        rule = partition.first_match("/".join(str(p) for p in path), rules, "trainable")
        if rule not in ("train", "frozen"):
            raise CfirError(f"trainable rule must be 'train' or 'frozen', got {rule!r}")
        return rule == "train"

    return pred
