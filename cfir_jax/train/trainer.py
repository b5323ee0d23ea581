"""Training the language expert: sharded symmetric contrastive training with orbax checkpoints.

Only the text tower (`model.TextTower`) goes on the accelerators; the frozen vision tower stays on the host since
its image embeddings come from the cache. Parameters are split by the config's rules into `params` (trained,
optimised, checkpointed) and `frozen` (the token embedding table; restored from the init model each run).

`train` is the one training loop (`loop.run`) over the text task (`tasks.TextTask`): the step is a pure function
`(state, batch) -> (state, metrics)` jitted once with donated state and explicit shardings over a ('data', 'fsdp')
mesh, per-step randomness `fold_in(rng, step)`. The data order is a function of (seed, step) alone, so the data
iterator position that a checkpoint stores is just the step: a run killed at any point and resumed from its last
checkpoint replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import os

import ml_collections

from cfir_jax.train import loop
from cfir_jax.train.data import TrainData
from cfir_jax.train.loop import TrainResult
from cfir_jax.train.tasks import TextTask

__all__ = ["TrainResult", "total_steps", "train"]


def total_steps(config: ml_collections.ConfigDict, data: TrainData) -> int:
    """The run's steps: train.num_steps, else train.num_epochs of the data's global batches."""
    return loop.num_steps(config.train, data.steps_per_epoch(config.train.global_batch))


def train(config: ml_collections.ConfigDict, workdir: str | os.PathLike, data: TrainData,
          devices=None, progress: bool | None = None, desc: str = "train") -> TrainResult:
    """Runs (or resumes) training in `workdir`. Exports the trained model to `workdir/model` when
    `config.train.export_model` says where its vision tower comes from (a model directory, or 'scratch')."""
    return loop.run(config, workdir, TextTask(data, desc), devices, progress)
