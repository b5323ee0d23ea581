"""Training a workdir: the text tower on (summary, image) pairs of its index (`run_text`: W/train -> W/model, or the
document baseline in W/train_document -> W/model_document) or D-BEiT-3 Full from pixels (`run_full`: W/train_full ->
W/model_full). The caller holds the workdir's writer lock (`cfir_jax.api.operations.train`, the train command).

D-BEiT-3 Full from a workdir: the Full task's data (`cfir_jax.training.data.load_full_data`: the train pairs of
W/corpus, the documents' tokens and the image pipeline), the one training loop over the Full task (`tasks.FullTask`)
in its own run directory W/train_full, and the trained model exported whole (both towers) to W/model_full.

The run starts from `train.init_model` (a model directory of the same size, e.g. converted BEiT-3 weights) or,
when that is empty, from the seed; unlike the text trainer it never takes the index's encoder by itself, since on
AToMiC that is the frozen tower this baseline is compared against (and on the demo world a model of other pixels).
The exported manifest says `trained="full"`, `train_images="pixels"`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import ml_collections

from cfir_jax.stores.atomic_write import replace_dir
from cfir_jax.stores.layout import Layout
from cfir_jax.training import loop
from cfir_jax.training.data import load_full_data, load_train_data
from cfir_jax.training.loop import TrainResult
from cfir_jax.training.tasks import FullTask, TextTask

log = logging.getLogger(__name__)


def run(config: ml_collections.ConfigDict, workdir) -> TrainResult:
    """Trains (or resumes) what the config names: D-BEiT-3 Full with `train.images="pixels"`, else the text tower."""
    return run_full(config, workdir) if config.train.images == "pixels" else run_text(config, workdir)[0]


def checkpoints_of(config: ml_collections.ConfigDict, workdir) -> str:
    """Where `run` keeps the checkpoints of the run the config names (what an "already trained" line points to)."""
    layout = Layout.of(workdir)
    run_dir = layout.train_full if config.train.images == "pixels" else _dirs(config, layout)[0]
    return f"{run_dir}/checkpoints"


def _dirs(config: ml_collections.ConfigDict, layout: Layout) -> tuple[Path, Path]:
    """(run directory, exported model) of the text tower's run: the document baseline (train.text=document, the
    paper's "document only") runs and exports beside the main model, so training it never replaces CFIR's
    summary-trained model."""
    if config.train.text == "document":
        return layout.train_document, layout.model_document
    return layout.train, layout.model


def run_text(config: ml_collections.ConfigDict, workdir: str) -> tuple[TrainResult, Path]:
    """Trains the language expert on the index's (summary, image) pairs in W/train and exports W/model (the document
    baseline, train.text=document, in W/train_document -> W/model_document); returns the result and the run dir."""
    layout = Layout.of(workdir)
    run_dir, model_dir = _dirs(config, layout)
    if not config.train.init_model and layout.index_json.is_file():
        # Start from the encoder the index was built with, and export with its (frozen) vision tower.
        encoder = layout.recorded_path(json.loads(layout.index_json.read_text()), "encoder")
        if encoder:
            config.train.init_model = str(encoder)
            config.train.export_model = config.train.export_model or str(encoder)
    data = load_train_data(config, layout.root)
    result = loop.run(config, run_dir, TextTask(data))
    if config.train.export_model and (run_dir / "model").is_dir():
        replace_dir(run_dir / "model", model_dir)
    return result, run_dir


def run_full(config: ml_collections.ConfigDict, workdir, progress: bool | None = None) -> TrainResult:
    """Trains (or resumes) the Full model on W/corpus in W/train_full and exports it to W/model_full."""
    layout = Layout.of(workdir)
    data = load_full_data(config, layout.root)
    # The task exports the whole model to W/train_full/model when W/model_full is missing or this run trained.
    task = FullTask(data.batches, data.ids, data.mask, data.batches.steps_per_epoch, publish_to=layout.model_full)
    try:
        result = loop.run(config, layout.train_full, task, progress=progress)
    finally:
        data.batches.close()
    if task.exported and jax.process_index() == 0:
        replace_dir(layout.train_full / "model", layout.model_full)
        if layout.full_cache_stale():
            log.warning("%s holds the previous Full model's image embeddings; re-encode them with: python "
                        "index.py --config CONFIG --workdir %s --stages image_cache_full",
                        layout.image_cache_full, layout.root)
    return result
