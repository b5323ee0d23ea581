"""The index command's body (`index.py`, which only parses flags): builds every stage of the workdir's index, or
appends entities to a built one, holding the workdir's writer lock. A synthetic world's encoder is trained on its
captions by `cfir_jax.train.pretrain`, passed to the runner: the index builders themselves never train."""

from __future__ import annotations

import os

import ml_collections

from cfir_jax.core import faults
from cfir_jax.core.hosts import is_main
from cfir_jax.index import runner
from cfir_jax.index.add_entities import add_entities as append_entities
from cfir_jax.index.stage_report import StageReport, report_table
from cfir_jax.stores import lock
from cfir_jax.train.pretrain import pretrain_encoder


def run(config: ml_collections.ConfigDict, workdir: str | os.PathLike, stages: tuple[str, ...] = runner.STAGES,
        add_entities: str = "") -> list[StageReport]:
    """Builds `stages` of the index in `workdir` (each skipped when current) and prints the closing table; with
    `add_entities` (a file of entity texts, one per line), appends them to the built entity index instead."""
    faults.on_sigterm()  # "interrupted during STAGE; rerun to resume", exit 143
    faults.quiet_library_noise()  # a full disk: one line, not every orbax thread's traceback
    with lock.hold(workdir):
        if add_entities:
            added = append_entities(config, workdir, add_entities)
            if is_main():
                print(f"added {added} new entities to {workdir}/entity_index")
            return []
        reports = runner.build_index(config, workdir, stages, pretrain=pretrain_encoder)
        if is_main():  # every process ran every stage; one table
            print(report_table(reports))
        return reports
