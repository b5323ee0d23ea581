"""The index command's body (`index.py`, which only parses flags): builds every stage of the workdir's index, appends
entities to a built one (`cfir_jax.index.add_entities`), or changes its collection (add, remove, compact:
`cfir_jax.index.collection_update`), holding the workdir's writer lock. A synthetic world's encoder is trained on its
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


def run(config: ml_collections.ConfigDict, workdir: str | os.PathLike, stages: tuple[str, ...] = (),
        add_entities: str = "", change: dict | None = None) -> list[StageReport]:
    """Builds `stages` of the index in `workdir` (every stage when empty; each skipped when current) and prints the
    closing table; with
    `add_entities` (a file of entity texts, one per line), appends them to the built entity index instead; with
    `change` ({"add": PATH} or {"remove": IDS_FILE} or {"compact": True}), changes the built collection."""
    faults.on_sigterm()  # "interrupted during STAGE; rerun to resume", exit 143
    faults.quiet_library_noise()  # a full disk: one line, not every orbax thread's traceback
    with lock.hold(workdir):
        if change and any(change.values()):
            _change(config, workdir, change)
            return []
        if add_entities:
            added = append_entities(config, workdir, add_entities)
            if is_main():
                print(f"added {added} new entities to {workdir}/entity_index")
            return []
        reports = runner.build_index(config, workdir, stages, pretrain=pretrain_encoder)
        if is_main():  # every process ran every stage; one table
            print(report_table(reports))
        return reports


def _change(config, workdir, change: dict) -> None:
    """One change of the collection, on process 0 (a change is small next to a build: new rows, a mask)."""
    # why: the change's modules load flax and the NER stack, which a plain build loads stage by stage
    from cfir_jax.index import collection_update

    if not is_main():
        return
    if change.get("add"):
        collection_update.add(config, workdir, change["add"])
    elif change.get("remove"):
        collection_update.remove(config, workdir, change["remove"])
    elif change.get("compact"):
        collection_update.compact(config, workdir)
