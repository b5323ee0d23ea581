"""The train command's body (`train.py`, which only parses flags): `run` trains the text tower on (summary, image)
pairs of the index (`run_text`, the default) or D-BEiT-3 Full (`run_full`, `train.images="pixels"`), holding the
workdir's writer lock, and prints the final metrics.

D-BEiT-3 Full from a workdir: the train pairs of W/corpus, each pair's
document text tokenised (`train.document_fields`, as the text path's document baseline), the image pipeline
(`PairBatches`, this process's slice of every global batch), the one training loop over the Full task
(`tasks.FullTask`) in its own run directory W/train_full, and the trained model exported whole (both towers) to
W/model_full.

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
import numpy as np

from cfir_jax.core.config import TRAIN_TEXT_LENGTHS, check_text_lengths
from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus, document_text
from cfir_jax.data.image_pipeline import PairBatches, train_pairs
from cfir_jax.model.tokenizer import resolve_tokenizer
from cfir_jax.stores import lock
from cfir_jax.stores.atomic_write import replace_dir
from cfir_jax.stores.layout import Layout
from cfir_jax.train import loop, trainer
from cfir_jax.train.data import load_train_data
from cfir_jax.train.loop import TrainResult
from cfir_jax.train.tasks import FullTask

RUN_DIR, MODEL_DIR = "train_full", "model_full"
log = logging.getLogger(__name__)


def run(config: ml_collections.ConfigDict, workdir: str) -> TrainResult:
    """Trains (or resumes) what the config names in `workdir`, one writer per workdir (process 0 of a job holds the
    lock), and prints the final metrics."""
    with lock.hold(workdir):
        if config.train.get("images", "cache") == "pixels":
            result, checkpoints = run_full(config, workdir), f"{workdir}/{RUN_DIR}/checkpoints"
        else:
            result, run_dir = run_text(config, workdir)
            checkpoints = f"{run_dir}/checkpoints"
        if result.already_trained:
            print(f"train: already trained to step {result.start_step} ({checkpoints}); nothing to do")
        print("final: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items())))
    return result


def run_text(config: ml_collections.ConfigDict, workdir: str) -> tuple[TrainResult, Path]:
    """Trains the language expert on the index's (summary, image) pairs in W/train and exports W/model (the document
    baseline, train.text=document, in W/train_document -> W/model_document); returns the result and the run dir."""
    layout = Layout.of(workdir)
    # The document baseline (train.text=document, the paper's "document only") runs and exports beside the main
    # model, so training it never replaces CFIR's summary-trained model.
    run_dir, model_dir = (layout.train_document, layout.model_document) if config.train.text == "document" else \
        (layout.train, layout.model)
    if not config.train.init_model and layout.index_json.is_file():
        # Start from the encoder the index was built with, and export with its (frozen) vision tower.
        encoder = layout.recorded_path(json.loads(layout.index_json.read_text()), "encoder")
        if encoder:
            config.train.init_model = str(encoder)
            config.train.export_model = config.train.export_model or str(encoder)
    data = load_train_data(config, layout.root)
    result = trainer.train(config, run_dir, data)
    if config.train.export_model and (run_dir / "model").is_dir():
        replace_dir(run_dir / "model", model_dir)
    return result, run_dir


def document_tokens(config: ml_collections.ConfigDict, corpus: Corpus) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32, padding mask bool) [documents, train.max_text_len] of every document's `train.document_fields`
    text, in corpus row order (the pipeline's doc_rows index them)."""
    tcfg = config.train
    if tcfg.text != "document":
        raise CfirError(f"train.images='pixels' (D-BEiT-3 Full) trains on document text: train.text={tcfg.text!r} "
                        "must be 'document'")
    check_text_lengths(config, TRAIN_TEXT_LENGTHS, config.model.max_text_positions)
    tokenizer = resolve_tokenizer(config, corpus)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise CfirError(f"tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is {config.model.vocab_size}")
    fields = tcfg.get("document_fields")
    texts = [document_text(corpus.document(i), fields) for i in range(corpus.num_documents)]
    return tokenizer(texts, tcfg.max_text_len)


def run_full(config: ml_collections.ConfigDict, workdir, progress: bool | None = None) -> TrainResult:
    """Trains (or resumes) the Full model on W/corpus in W/train_full and exports it to W/model_full."""
    layout = Layout.of(workdir)
    if not layout.corpus.is_dir():
        raise CfirError(f"{layout.corpus}: no corpus; build it first with index.py --config CONFIG --workdir "
                        f"{layout.root}")
    corpus = Corpus.open(layout.corpus)
    ids, mask = document_tokens(config, corpus)
    tcfg = config.train
    batches = PairBatches(corpus, train_pairs(corpus), global_batch=tcfg.global_batch,
                          image_size=config.model.image_size, seed=tcfg.seed, process_index=jax.process_index(),
                          process_count=jax.process_count(), workers=int(tcfg.get("image_workers", 0)),
                          randaug=bool(tcfg.get("randaug", True)))
    # The task exports the whole model to W/train_full/model when W/model_full is missing or this run trained.
    task = FullTask(batches, ids, mask, batches.steps_per_epoch, publish_to=layout.root / MODEL_DIR)
    try:
        result = loop.run(config, layout.root / RUN_DIR, task, progress=progress)
    finally:
        batches.close()
    if task.exported and jax.process_index() == 0:
        replace_dir(layout.root / RUN_DIR / "model", layout.root / MODEL_DIR)
        if layout.full_cache_stale():
            log.warning("%s holds the previous Full model's image embeddings; re-encode them with: python "
                        "index.py --config CONFIG --workdir %s --stages image_cache_full",
                        layout.image_cache_full, layout.root)
    return result
