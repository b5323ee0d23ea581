"""index.py as a library: builds, in order, every store that training and retrieval read.

The stages are the declared stores that have a build (`cfir_jax.builders.descriptor`), in pipeline order; each store's
module declares its stage beside its builder. Today's (each writes one directory of the workdir layout, see
cfir_jax.stores.layout):
  corpus        AToMiC parquet files -> the corpus format (tfds array_record, read with grain); or a synthetic world;
                or your own collection from plain files (index.corpus.source='files', cfir_jax/data/files.py)
  image_cache   every image encoded once by the frozen vision tower (or precomputed embeddings imported)
  image_cache_full  the same images re-encoded by the D-BEiT-3 Full model's trained vision tower (W/model_full, made
                by train.py with a :full config) into W/image_cache_full; built when W/model_full exists
  encoder       synthetic worlds only: the text tower trained on captions, standing in for BEiT-3's itc weights
  entities      spaCy NER over every document
  summaries     BART-large-CNN (or extractive) summary of every document
  entity_index  every entity text encoded by the frozen text tower, its top-K images by ScaNN (or exact search)
  image_text    beyond the paper: each cached image's own text embedded by the frozen text tower (fused SR);
                built when index.image_text.enabled or retrieval.fusion.w_txt != 0, skipped when no image has text
  entity_text_match  beyond the paper: per entity of the entity index, the images whose own text names it; built
                when index.entity_text_match.enabled or retrieval.entity_text_match, skipped when no image has text
  lexical       beyond the paper: BM25 over each cached image's own text (cfir_jax.builders.lexical); built when
                index.lexical.enabled, skipped when no image has text

A stage is skipped when its store is complete and current (each stage module checks its own manifest), resumes
where it stopped when interrupted, and refuses stores built by another model. A closing table gives counts, size on
disk and time per stage.

Several hosts: run the same command on every host of a jax.distributed job (a TPU slice, a SLURM or MPI GPU job, or
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set by hand), as train.py is run; the workdir, the
encoder and the corpus inputs must be on a file system every host sees. Every stage starts with all processes
together (`hosts.barrier`), so all agree whether it is current. The corpus is converted by process 0 alone while
the others wait (a format conversion, not model work); the image cache is split in contiguous shard ranges, the
entities, summaries, entity index and image text in chunks owned round-robin (`hosts.owns`); each process writes
its own shards or chunks into the shared work directory, and process 0 alone assembles and commits the store once
all exist, then every process opens it. spaCy also fans out over `entity_workers.index` worker processes on each
host (every usable core by default). Logs and the closing table come from process 0. When a host dies the others
stop at their next barrier (or by the runtime's heartbeat): restart the whole job; finished shards and chunks are
reused, by whichever process owns them now (another process count included).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import ml_collections

from cfir_jax.builders import descriptor, rebuild
from cfir_jax.builders.descriptor import StageRun, Store
from cfir_jax.builders.index_encoder import text_positions
from cfir_jax.builders.stage_report import StageReport, StageRunner, stale_reports
from cfir_jax.core import hosts
from cfir_jax.core.config import INDEX_TEXT_LENGTHS, check_text_lengths
from cfir_jax.core.errors import CfirError
from cfir_jax.stores.layout import Layout

# The caption pretraining of a synthetic world's encoder (config, layout) -> None: training, so it comes from training/.
Pretrain = Callable[[ml_collections.ConfigDict, Layout], None]


def stages() -> tuple[str, ...]:
    """index.py's stages, in the order it runs them (every declared store with a build)."""
    return descriptor.stages()


def build_index(config: ml_collections.ConfigDict, workdir: str | os.PathLike, stages: tuple[str, ...] = (),
                log: Callable[[str], None] = print, pretrain: Pretrain | None = None) -> list[StageReport]:
    """Runs the stages in order (`stages`: all when empty; each skipped when current); returns the per-stage report.
    `pretrain` trains the synthetic world's encoder on captions (`cfir_jax.training.pretrain.pretrain_encoder`, passed
    by the index command). A rebuild of a built workdir runs in its staging directory and commits what it built as
    one version (`cfir_jax.builders.rebuild`)."""
    every = descriptor.stages()
    stages = tuple(stages) or every
    unknown = set(stages) - set(every)
    if unknown:
        raise CfirError(f"unknown stage(s) {sorted(unknown)}: choose from {', '.join(every)}")
    layout = Layout.of(workdir)
    check_text_lengths(config, INDEX_TEXT_LENGTHS, text_positions(config, layout))
    layout.root.mkdir(parents=True, exist_ok=True)
    staged = rebuild.staged_layout(layout)
    run = StageRun(config, staged or layout, stages, every, pretrain)
    reports = _run_stages(run, log)
    reports = rebuild.record(config, layout, staged, reports)
    hosts.barrier("index_done")
    return reports


def _run_stages(run: StageRun, log: Callable[[str], None]) -> list[StageReport]:
    """Each declared stage in order: built when asked for (and wanted), else opened when later stages read it."""
    runner = StageRunner(log)
    for store in descriptor.stores():
        build = store.build
        if build is None:
            continue
        if store.name in run.stages and (build.wanted is None or build.wanted(run)):
            fn = (lambda b=build: b.run(run)) if build.every_host else (lambda s=store: _on_main(run, s))
        elif build.unselected is not None:
            fn = lambda b=build: b.unselected(run)  # noqa: E731
        else:
            continue
        path = build.path(run) if build.path is not None else store.path(run.layout.root)
        run.opened[store.name] = result = runner.run(store.name, fn, build.describe, path)
        if build.check is not None:
            build.check(run, result)
    return runner.reports + stale_reports(run.layout, runner.reports, run.all_stages)


def _on_main(run: StageRun, store: Store):
    """A stage built by process 0 alone while the others wait, then opened by every process."""
    if hosts.is_main():
        store.build.run(run)
    hosts.barrier(f"{store.name}_built")
    return store.build.open(run)
