"""The operations the library runs on a workdir, and what the commands' bodies call: build its index
(`build`), train (`train`), verify its stores (`verify`), change its collection (`add`, `remove`, `compact`), read
its `version`, add entity texts to its entity index (`add_entities`), and read the config a call runs with
(`config_of`).

Each writer holds the workdir's writer lock (`cfir_jax.stores.lock`) for its work, as `index.py` and `train.py` do;
a second writer gets one `CfirError` line naming the holder. Nothing here prints: the builders' progress lines go to
`log` (the index command passes `print`), the changes' to `say`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import ml_collections

from cfir_jax.core import cli
from cfir_jax.core.config_check import check
from cfir_jax.core.errors import CfirError
from cfir_jax.stores import lock, versions
from cfir_jax.stores.integrity import verify_workdir
from cfir_jax.stores.layout import Layout

__all__ = ["Verification", "add", "add_entities", "build", "compact", "config_of", "remove", "train", "verify",
           "version"]

log = logging.getLogger("cfir_jax")
Say = Callable[[str], None]
ConfigLike = str | ml_collections.ConfigDict | None


def config_of(config: ConfigLike, workdir: str | os.PathLike | None, overrides: Mapping[str, Any]
              ) -> ml_collections.ConfigDict:
    """The config a library call runs with: `config` (a ConfigDict, copied; or a config file spec,
    "configs/demo.py:tiny") or, when None, the one `workdir` was built with (as `retrieve.py --index W` reads it),
    then `overrides` ({"retrieval.top_k": 100} or retrieval__top_k=100 as keywords), checked once and locked."""
    if config is None:
        if workdir is None:
            raise CfirError("give a config (a ConfigDict or a file such as configs/demo.py) or a built workdir")
        config = cli.workdir_config(workdir)
    elif isinstance(config, str):
        config = cli.load_config_file(config)
    elif isinstance(config, ml_collections.ConfigDict):
        config = copy.deepcopy(config)
    else:
        raise CfirError(f"config: expected a ConfigDict or a config file path, got {type(config).__name__}")
    config = check(cli.apply_values(config, overrides))
    config.lock()
    return config


def build(config: ConfigLike, workdir: str | os.PathLike, *, stages: Iterable[str] = (), log_line: Say | None = None,
          **overrides: Any) -> list:
    """Builds `stages` of the index in `workdir` (every stage when empty; each skipped when current), as `index.py
    --config CONFIG --workdir W` does; returns one `cfir_jax.builders.stage_report.StageReport` per stage."""
    # why: the builders load JAX, flax and spaCy stage by stage; `import cfir_jax` stays light
    from cfir_jax.builders import runner
    from cfir_jax.training.pretrain import pretrain_encoder

    config = config_of(config, workdir if config is None else None, overrides)
    with lock.hold(workdir):
        return runner.build_index(config, workdir, tuple(stages), log=log_line or log.info,
                                  pretrain=pretrain_encoder)


def train(config: ConfigLike, workdir: str | os.PathLike, **overrides: Any):
    """Trains (or resumes) what the config names in `workdir`, as `train.py --config CONFIG --workdir W` does;
    returns the `cfir_jax.training.loop.TrainResult` (its `metrics`, `already_trained`, `start_step`)."""
    # why: training loads JAX, flax, optax and orbax
    from cfir_jax.training import runs as training

    config = config_of(config, workdir if config is None else None, overrides)
    with lock.hold(workdir):
        return training.run(config, workdir)


def checkpoints_of(config: ml_collections.ConfigDict, workdir: str | os.PathLike) -> str:
    """Where `train` keeps the checkpoints of the run the config names."""
    # why: the training stack (JAX, orbax) loads only where a run is named
    from cfir_jax.training import runs as training

    return training.checkpoints_of(config, workdir)


@dataclasses.dataclass(frozen=True)
class Verification:
    """Every store of a workdir re-read against the checksums recorded when it was built (`index.py --verify`)."""

    intact: tuple[str, ...]  # the stores whose every byte matches
    problems: tuple[str, ...]  # one line per damaged, missing or unexpected file

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(workdir: str | os.PathLike) -> Verification:
    """Re-reads every store of `workdir` against its checksums; a reader (no config, no lock, no JAX)."""
    root = Path(workdir)
    if not root.is_dir():
        raise CfirError(f"{root}: no workdir here (missing directory)")
    intact, problems = verify_workdir(root, Layout.of(root).store_dirs())
    return Verification(tuple(intact), tuple(problems))


def version(workdir: str | os.PathLike) -> int:
    """The version W/index.json records: 1 after the first build, + 1 with every change (0 before any)."""
    return versions.current_version(workdir)


def add(config: ml_collections.ConfigDict, workdir: str | os.PathLike, path: str | os.PathLike,
        say: Say | None = None) -> dict[str, int]:
    """Appends the documents and images of `path` (docs/collection.md) as one new version; returns what changed
    ({"version", "images_added", ...})."""
    # why: a change loads flax and the NER stack
    from cfir_jax.builders import collection_update

    with lock.hold(workdir):
        return collection_update.add(config, workdir, path, say=say or log.info)


def remove(config: ml_collections.ConfigDict, workdir: str | os.PathLike, ids: str | os.PathLike | Iterable[str],
           say: Say | None = None) -> dict[str, int]:
    """Masks the images and documents named by `ids` (a file of ids, one a line; or the ids themselves) as one new
    version: no method returns them again; returns what changed."""
    # why: a change loads flax and the NER stack
    from cfir_jax.builders import collection_update

    with lock.hold(workdir):
        if isinstance(ids, (str, os.PathLike)):
            return collection_update.remove(config, workdir, ids, say=say or log.info)
        with tempfile.TemporaryDirectory(prefix="cfir-remove-") as tmp:
            ids_file = Path(tmp) / "ids.txt"
            ids_file.write_text("".join(f"{i}\n" for i in ids))
            return collection_update.remove(config, workdir, ids_file, say=say or log.info)


def add_entities(config: ml_collections.ConfigDict, workdir: str | os.PathLike, path: str | os.PathLike) -> int:
    """Appends the entity texts of `path` (one a line) to the built entity index without rebuilding it (`index.py
    --add-entities`); returns how many were new (0 on every process but 0, which waits for it)."""
    # why: appending encodes the entities: flax and the index encoder
    from cfir_jax.builders.add_entities import add_entities as append

    with lock.hold(workdir):
        return append(config, workdir, path)


def compact(config: ml_collections.ConfigDict, workdir: str | os.PathLike, say: Say | None = None) -> dict[str, int]:
    """Rewrites the stores without the removed image rows as one new version; returns what changed."""
    # why: a change loads flax and the NER stack
    from cfir_jax.builders import collection_update

    with lock.hold(workdir):
        return collection_update.compact(config, workdir, say=say or log.info)
