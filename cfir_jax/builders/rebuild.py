"""What a build of the index records, and a rebuild of a built workdir as one version (`cfir_jax.stores.versions`).

A first build writes its stores in place (nothing reads them yet) and index.json at version 1. A rebuild of a built
workdir must not change what readers open store by store: it runs its stages in `W/.change/` instead
(`staged_layout`), where process 0 begins a "build" change and hard-links every store the stages read or write, so
a stage whose store is current finds it there and skips as it would in W. A stage that builds replaces only the
staged link. When the stages are done, the stores built anew are committed together with index.json
(`record`: version + 1, a "build" history entry), through the same `versions.Change.commit` as an add or a
removal; a rebuild killed midway leaves W as it was, and the same command run again resumes from what it staged.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from cfir_jax.builders import descriptor
from cfir_jax.builders.index_encoder import encoder_dir, other_model
from cfir_jax.builders.stage_report import StageReport
from cfir_jax.core import hosts
from cfir_jax.stores import versions
from cfir_jax.stores.atomic_write import discard_dir, link_tree, temp_name, write_json_atomic
from cfir_jax.stores.layout import Layout


def staged_layout(layout: Layout) -> Layout | None:
    """Where this run builds: None for a first build (in W itself); for a rebuild, the layout rooted at W/.change,
    where process 0 begins (or resumes) the "build" change and links the stores in while the others wait."""
    if not versions.current_version(layout):
        return None
    if hosts.is_main():
        change = versions.begin(layout, "build", {})
        for name in descriptor.linked():  # every stage's store, and the models a stage reads
            src, dst = layout.root / name, change.directory / name
            if src.is_dir() and not dst.exists():  # kept when a run of this same change staged it already
                tmp = temp_name(dst)
                link_tree(src, tmp)
                os.replace(tmp, dst)
    hosts.barrier("rebuild_staged")
    return Layout.of(layout.root / versions.CHANGE_DIR)


def _tree(path: Path) -> list[tuple[str, int]]:
    return sorted((p.relative_to(path).as_posix(), p.stat().st_ino) for p in path.rglob("*") if p.is_file())


def _changed(staged: Path, live: Path) -> bool:
    """Whether a staged store differs from the live one: a link of it shares every file (inode) with it."""
    return not live.is_dir() or _tree(staged) != _tree(live)


def index_fields(config, layout: Layout, reports: list[StageReport], sizes: list[int] | None = None) -> dict:
    """What index.json records of a build besides its version: the encoder, the config, every stage's report."""
    sizes = [r.size_bytes for r in reports] if sizes is None else sizes
    return {
        **layout.record_path("encoder", encoder_dir(config, layout)),  # relative inside W; outside, absolute
        # index.encoder naming another workdir: its text-trained model too, which scores the queries (retrieve.stores)
        **({} if (model := other_model(config)) is None else layout.record_path("model", model)),
        "config": json.loads(json.dumps(config.to_dict(), default=str)),
        "stages": [dataclasses.asdict(r) | {"path": layout.portable(r.path), "size_bytes": size}
                   for r, size in zip(reports, sizes)],
    }


def _built(reports: list[StageReport]) -> list[str]:
    return [r.name for r in reports if not (r.reused or r.stale_because)]


def record_index(config, layout: Layout, reports: list[StageReport]) -> None:
    """W/index.json of a build made in place: version 1 after a first build, + 1 when it built anything, with the
    history (`cfir_jax.stores.versions`)."""
    version, history = versions.current_version(layout), versions.history(layout)
    if not version or _built(reports):
        version += 1
        history.append(versions.history_entry(version, "build", {"stages": _built(reports)}))
    write_json_atomic(layout.index_json, {"version": version, "history": history,
                                          **index_fields(config, layout, reports)})


def record(config, layout: Layout, staged: Layout | None, reports: list[StageReport]) -> list[StageReport]:
    """Records the build (process 0; every process returns the reports with their paths in W): in place, or for a
    rebuild made in `staged`, the stores it built committed with index.json as the next version (nothing built:
    the staging removed and index.json rewritten at the same version)."""
    if staged is None:
        if hosts.is_main():
            record_index(config, layout, reports)
        return reports
    sizes = [r.size_bytes for r in reports]
    live = [dataclasses.replace(r, path=layout.root / Path(r.path).relative_to(staged.root))
            if Path(r.path).is_relative_to(staged.root) else r for r in reports]
    if hosts.is_main():
        change = versions.begin(layout, "build", {})  # the change staged_layout began
        for name in descriptor.linked():
            if (staged.root / name).is_dir() and not _changed(staged.root / name, layout.root / name):
                discard_dir(staged.root / name)  # a link of the live store: nothing to commit
        if _built(reports):
            change.commit({"stages": _built(reports)}, index=index_fields(config, layout, live, sizes))
        else:
            change.abandon()
            record_index(config, layout, live)
    return live
