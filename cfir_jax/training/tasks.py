"""The two training tasks the one loop (`loop.run`) runs: the text task (CFIR's language expert on cached image
embeddings, and the synthetic world's caption pretraining) and the Full task (D-BEiT-3 Full: both towers from
pixels). Each brings its step, its batches, the data state its checkpoints keep, and its export.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from cfir_jax.core import hosts
from cfir_jax.training import batch as batch_lib
from cfir_jax.training import full_step, step
from cfir_jax.training.data import TrainData
from cfir_jax.training.loop import TrainResult
from cfir_jax.training.state import Setup, export_model
from cfir_jax.training.validate import evaluate


@dataclasses.dataclass
class TextTask:
    """The text tower on (text, cached image embedding) pairs. The data order is a function of (seed, step) alone,
    so the data state a checkpoint keeps is the step (and the seed, for the record). Exports W/RUN/model when
    `train.export_model` says where its vision tower comes from (a model directory, or 'scratch')."""

    data: TrainData
    desc: str = "train"
    tower = "text"
    rate = "examples_s"
    _encoder: Callable | None = dataclasses.field(default=None, repr=False)

    def steps_per_epoch(self, config: ml_collections.ConfigDict) -> int:
        return self.data.steps_per_epoch(config.train.global_batch)

    def timing_epoch(self, config: ml_collections.ConfigDict) -> int:
        return self.steps_per_epoch(config)

    def schema(self, config: ml_collections.ConfigDict) -> batch_lib.Schema:
        return step.batch_schema(config)

    def make_step(self, config: ml_collections.ConfigDict, setup: Setup) -> Callable:
        return step.make_train_step(config, setup)

    def batch(self, index: int, config: ml_collections.ConfigDict, mesh) -> dict:
        return step.global_batch_arrays(self.data, index, config, mesh)

    def data_state(self, config: ml_collections.ConfigDict) -> dict:
        return {"seed": config.train.seed}

    def restore_data(self, data: dict) -> None:
        pass  # the step is the whole position

    def log_values(self, config: ml_collections.ConfigDict, setup: Setup, done: int, steps: int, state: dict,
                   frozen: dict) -> dict[str, float]:
        """Validation (R@k, MRR@10) every train.eval_every steps and at the end, when the data has a validation set."""
        tcfg = config.train
        if self.data.eval is None or (done % tcfg.eval_every and done != steps):
            return {}
        if self._encoder is None:
            self._encoder = step.make_encoder(config, setup)
        return evaluate(self._encoder, state["params"], frozen, self.data.eval, tcfg.eval_batch, setup.mesh)

    def export(self, config: ml_collections.ConfigDict, setup: Setup, result: TrainResult, workdir: Path) -> None:
        if config.train.export_model:
            export_model(config, setup, result.params, frozen=result.frozen, out_dir=workdir / "model",
                         vision_from=config.train.export_model)


@dataclasses.dataclass
class FullTask:
    """Both towers from the image pipeline's pixels and the documents' tokens.

    `batches` is the image pipeline's iterator (`cfir_jax.data.image_pipeline.PairBatches`, or anything with its
    interface): `next(batches)` gives this process's rows {"pixels" uint8 [b, S, S, 3], "doc_rows" int32 [b],
    "image_rows" int32 [b], "valid" bool [b]}, `get_state()` a JSON-able position, `set_state(d)` restores it,
    `skipped` counts unreadable images. The documents' tokens (`ids`, `mask` [documents, L]) are indexed by
    "doc_rows". The order is the pipeline's own (grain's shuffling, augmentation draws), so its state is the
    checkpoint's data item: orbax writes it from process 0 and PairBatches resumes any process from it.

    `publish_to` (W/model_full) turns the export on: the whole model goes to W/RUN/model when `publish_to` is missing
    or this run trained (process 0 decides for all, since every process gathers the parameters), and `exported`
    says so; the caller publishes it.
    """

    batches: Any
    ids: np.ndarray
    mask: np.ndarray
    epoch_steps: int | None = None  # global batches per epoch (the pipeline's steps_per_epoch)
    publish_to: Path | None = None
    desc: str = "train full"
    tower = "dual"
    rate = "images_s"
    exported: bool = False

    def steps_per_epoch(self, config: ml_collections.ConfigDict) -> int | None:
        return self.epoch_steps

    def timing_epoch(self, config: ml_collections.ConfigDict) -> int:
        return self.epoch_steps or int(getattr(self.batches, "steps_per_epoch", 1) or 1)

    def schema(self, config: ml_collections.ConfigDict) -> batch_lib.Schema:
        return dict(full_step.FULL_BATCH)

    def make_step(self, config: ml_collections.ConfigDict, setup: Setup) -> Callable:
        return full_step.make_full_step(config, setup)

    def batch(self, index: int, config: ml_collections.ConfigDict, mesh) -> dict:
        return full_step.global_full_batch(next(self.batches), self.ids, self.mask, mesh)

    def data_state(self, config: ml_collections.ConfigDict) -> dict:
        return {"pipeline": self.batches.get_state(), "skipped": int(self.batches.skipped)}

    def restore_data(self, data: dict) -> None:
        self.batches.set_state(data["pipeline"])

    def log_values(self, config: ml_collections.ConfigDict, setup: Setup, done: int, steps: int, state: dict,
                   frozen: dict) -> dict[str, float]:
        return {"skipped_images": self.batches.skipped}

    def export(self, config: ml_collections.ConfigDict, setup: Setup, result: TrainResult, workdir: Path) -> None:
        if self.publish_to is None:
            return
        stale = not self.publish_to.is_dir() or not result.already_trained
        if hosts.from_main("export-model-full", "1" if stale else "") != "1":
            return
        export_full(config, result, workdir / "model")
        self.exported = True


def export_full(config: ml_collections.ConfigDict, result: TrainResult, out_dir: Path) -> None:
    """The whole trained DBeit3 (every parameter is in params or frozen) as a model directory, in the model-store
    format of the text trainer's export, its manifest saying it is a Full model."""
    init = config.train.init_model or "scratch"
    export_model(config, None, result.params, result.frozen, out_dir, init,
                 trained="full", train_images="pixels", train_document_fields=list(config.train.document_fields))
