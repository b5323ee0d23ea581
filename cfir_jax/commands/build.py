"""The body of `index.py` (which only parses flags): builds every stage of the workdir's index, appends entities to a
built one (`cfir_jax.builders.add_entities`), or changes its collection (add, remove, compact:
`cfir_jax.builders.collection_update`), holding the workdir's writer lock. The build and the changes are the
library's (`cfir_jax.api.operations`); a synthetic world's encoder is trained on its captions by
`cfir_jax.training.pretrain`, which the library passes to the runner: the builders themselves never train."""

from __future__ import annotations

import os

import ml_collections

from cfir_jax.api import operations as api
from cfir_jax.builders.stage_report import StageReport, report_table
from cfir_jax.core import faults
from cfir_jax.core.hosts import is_main
from cfir_jax.stores import lock


def run(config: ml_collections.ConfigDict, workdir: str | os.PathLike, stages: tuple[str, ...] = (),
        add_entities: str = "", change: dict | None = None) -> list[StageReport]:
    """Builds `stages` of the index in `workdir` (every stage when empty; each skipped when current) and prints the
    closing table; with
    `add_entities` (a file of entity texts, one per line), appends them to the built entity index instead; with
    `change` ({"add": PATH} or {"remove": IDS_FILE} or {"compact": True}), changes the built collection. The work is
    the library's (`cfir_jax.api.operations`), which holds the workdir's writer lock."""
    faults.on_sigterm()  # "interrupted during STAGE; rerun to resume", exit 143
    faults.quiet_library_noise()  # a full disk: one line, not every orbax thread's traceback
    if change and any(change.values()):
        _change(config, workdir, change)
        return []
    if add_entities:
        added = api.add_entities(config, workdir, add_entities)
        if is_main():
            print(f"added {added} new entities to {workdir}/entity_index")
        return []
    reports = api.build(config, workdir, stages=stages, log_line=print)
    if is_main():  # every process ran every stage; one table
        print(report_table(reports))
    return reports


def _change(config, workdir, change: dict) -> None:
    """One change of the collection, on process 0 (a change is small next to a build: new rows, a mask)."""
    if not is_main():
        with lock.hold(workdir):  # the lock's word from process 0, heard in the same order on every process
            return
    if change.get("add"):
        api.add(config, workdir, change["add"], say=print)
    elif change.get("remove"):
        api.remove(config, workdir, change["remove"], say=print)
    elif change.get("compact"):
        api.compact(config, workdir, say=print)
