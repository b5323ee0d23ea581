"""The D-BEiT-3 Full training run: the one training loop (`loop.run`) over the Full task (`tasks.FullTask`), the
Full step over batches from the image pipeline, with the pipeline's position checkpointed by orbax beside the train
state, so an interrupted run resumes to exactly the uninterrupted one.

A 2-process run trains the 1-process model (tests/e2e/test_full_train.py). `cfir_jax.commands.train.run_full` builds
its inputs from a workdir (train.py) and exports the trained model; `index.py --stages image_cache_full` re-encodes
the images with its tower.
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from cfir_jax.train import loop
from cfir_jax.train.loop import TrainResult
from cfir_jax.train.tasks import FullTask


def train_full(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    batches,
    ids: np.ndarray,
    mask: np.ndarray,
    steps_per_epoch: int | None = None,
    devices=None,
    progress: bool | None = None,
) -> TrainResult:
    """Runs (or resumes, from the workdir's latest checkpoint: train state and pipeline position) Full training;
    `batches` and the tokens (`ids`, `mask` [documents, L]) as `tasks.FullTask` takes them. Exports nothing
    (`full_run.run_full` does)."""
    return loop.run(config, workdir, FullTask(batches, ids, mask, steps_per_epoch), devices, progress)
