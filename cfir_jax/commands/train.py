"""The train command's body (`train.py`, which only parses flags): `run` trains the text tower on (summary, image)
pairs of the index (the default) or D-BEiT-3 Full (`train.images="pixels"`) through `cfir_jax.api.operations.train`,
which holds the workdir's writer lock and does the work (`cfir_jax.training.runs`), and prints the final metrics."""

from __future__ import annotations

import ml_collections

from cfir_jax.api import operations as api
from cfir_jax.training.loop import TrainResult


def run(config: ml_collections.ConfigDict, workdir: str) -> TrainResult:
    """Trains (or resumes) what the config names in `workdir` and prints the final metrics."""
    result = api.train(config, workdir)
    if result.already_trained:
        print(f"train: already trained to step {result.start_step} ({api.checkpoints_of(config, workdir)}); "
              "nothing to do")
    print("final: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items())))
    return result
