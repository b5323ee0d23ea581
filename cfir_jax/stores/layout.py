"""The workdir layout: one directory W holds every store and every training run, written by index.py and train.py,
read by retrieve.py; its index.json records what index.py built (the encoder used, the stages, the version).

Each directory W/<name> is declared once, as a `Directory`, by the room whose code makes it, in that room's module
`directories` (`cfir_jax/builders/directories.py`: the stores index.py builds; `cfir_jax/training/directories.py`:
the training runs and the models they export; `cfir_jax/rerank/directories.py`; `cfir_jax/retrieve/directories.py`:
the copies the Retriever derives). `DIRECTORIES` finds them by that module's name (`cfir_jax.core.registry`), so this
floor reads what higher rooms declare without naming them. Everything that lists directories derives the list from
the declarations: `Layout`'s attributes (an undeclared name is an error, not a path), `Layout.store_dirs` (what
`--verify` and the service check: no training run), the service's completeness check and fingerprint, and the one
order of the pipeline (`ordered`: each directory after the ones it is made from, ties broken by name).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from cfir_jax.core.errors import CfirError
from cfir_jax.core.registry import Registry

# What a directory of the workdir is. STORE: a store with its manifest and checksums (`--verify` re-reads it, the
# service needs it complete; the models train.py exports are stores). RUN: a training run (checkpoints, logs, its
# config; no manifest): nothing reads it but the run that resumes it. DERIVED: a store the Retriever makes from
# others when it opens the index (missing or stale, it is made again), so the index's fingerprint leaves it out.
STORE, RUN, DERIVED = "store", "run", "derived"
KINDS = (STORE, RUN, DERIVED)


@dataclasses.dataclass(frozen=True)
class Directory:
    """One directory of the workdir, W/<name>, declared once by the room whose code makes it. `made_from`: the
    directories it is derived from (the one dependency graph: the pipeline's order, a rebuild's stale rows, the
    change loop's order). `linked`: a rebuild links it into its staging directory although no stage builds it (a
    model a stage reads). `config`: its config section. `refresh`: the command that refreshes it when another command
    makes it (W stands for the workdir). `about`: what it holds, in a line."""

    name: str
    kind: str = STORE
    made_from: tuple[str, ...] = ()
    linked: bool = False
    config: str = ""
    refresh: str = ""
    about: str = ""

    def __post_init__(self):
        if not is_store_name(self.name):
            raise ValueError(f"{self.name!r} cannot name a directory of the workdir (lower case, digits, underscores)")
        if self.kind not in KINDS:
            raise ValueError(f"directory {self.name!r}: kind {self.kind!r} is not one of {KINDS}")


# Every directory of the workdir, found in the module `directories` of the rooms that make them.
DIRECTORIES: Registry[Directory] = Registry("directory of the workdir", "*/directories")


def declare(directory: Directory) -> Directory:
    """Declares a directory of the workdir (at its `directories` module's import)."""
    return DIRECTORIES.register(directory)


def ordered() -> list[Directory]:
    """Every declared directory, each after the directories it is made from, ties broken by name (the one order of
    the pipeline: index.py's stages and the change loop run in it); a circle of `made_from` is refused."""
    declared = {d.name: d for d in DIRECTORIES.values()}
    waiting = {name: {s for s in d.made_from if s in declared} for name, d in declared.items()}
    out: list[Directory] = []
    while waiting:
        ready = sorted(name for name, sources in waiting.items() if not sources)
        if not ready:
            raise ValueError(f"the directories {sorted(waiting)} are made from each other in a circle")
        out.append(declared[ready[0]])
        del waiting[ready[0]]
        for sources in waiting.values():
            sources.discard(ready[0])
    return out


def of_kind(*kinds: str) -> tuple[str, ...]:
    """The names of the declared directories of these kinds, in pipeline order."""
    return tuple(d.name for d in ordered() if d.kind in kinds)


@dataclasses.dataclass(frozen=True)
class Layout:
    root: Path

    @classmethod
    def of(cls, workdir: str | os.PathLike) -> Layout:
        return cls(Path(workdir).absolute())

    def __getattr__(self, name: str) -> Path:
        """W/<name> for a declared directory; any other name is an error (`layout.image_cahe` is a typo, not a path)."""
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in DIRECTORIES:
            raise AttributeError(f"{name!r} is no directory of the workdir: declare it (cfir_jax/stores/layout.py, "
                                 f"`Directory`) or use one of {', '.join(d.name for d in ordered())}")
        return self.root / name

    def store_dirs(self) -> tuple[str, ...]:
        """The declared stores of W that are there (every directory but the training runs), sorted: what
        `--verify` and the service's verifier check, whichever room declared them."""
        if not self.root.is_dir():
            return ()
        return tuple(sorted(name for name in of_kind(STORE, DERIVED) if (self.root / name).is_dir()))

    @property
    def index_json(self) -> Path:
        return self.root / "index.json"

    def full_cache_stale(self) -> str:
        """Why W/image_cache_full no longer stands for W/model_full ('' while it does, or when either is missing):
        train.py re-exported the Full model, so the cache holds the previous vision tower's embeddings."""
        try:
            cache = json.loads((self.image_cache_full / "manifest.json").read_text())["fingerprint"]
            model = json.loads((self.model_full / "manifest.json").read_text())["vision_fingerprint"]
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        return "" if cache == model else "model_full retrained"

    def portable(self, path: str | os.PathLike) -> str:
        """How a workdir records a path: relative to the workdir when inside it (so a copied or moved workdir
        points at its own stores), else absolute."""
        path = Path(path).absolute()
        return path.relative_to(self.root).as_posix() if path.is_relative_to(self.root) else str(path)

    def record_path(self, key: str, path: str | os.PathLike | None) -> dict:
        """{key: the portable path} for index.json, and for a model directory outside the workdir also
        {key_fingerprint: its fingerprints}, which `recorded_path` checks before anything loads it."""
        if path is None:
            return {key: ""}
        entry = {key: self.portable(path)}
        if Path(entry[key]).is_absolute():
            entry[f"{key}_fingerprint"] = _model_fingerprints(Path(path))
        return entry

    def recorded_path(self, info: dict, key: str, config_key: str | None = None) -> Path | None:
        """The path index.json records under `key`, resolved against this workdir; an outside model directory
        that is missing or is not the one recorded is refused in one line (what was expected where, and the config
        key that chose it: `index.<config_key or key>`)."""
        value = info.get(key) or ""
        if not value:
            return None
        path = Path(value)
        if not path.is_absolute():
            return self.root / path
        old_root = _recorded_root(info)  # index.json of older versions: absolute paths into the old workdir
        if old_root is not None and path.is_relative_to(old_root) and old_root != self.root:
            return self.root / path.relative_to(old_root)
        want = info.get(f"{key}_fingerprint")
        if want:
            have = _model_fingerprints(path)
            if have is None:
                raise CfirError(f"{self.index_json}: the {key} at {path} (fingerprint {want['text_fingerprint']}) "
                                f"is missing: put it back there, or rebuild the index with another "
                                f"--config.index.{config_key or key}")
            if have != want:
                raise CfirError(f"{self.index_json}: expected the {key} at {path} to have fingerprints {want} but "
                                f"it has {have}: restore the model the index was built with, or rebuild the index")
        return path


def _model_fingerprints(path: Path) -> dict | None:
    """The fingerprints of a model directory's towers (its manifest), or None when there is no model there."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        return {k: manifest[k] for k in ("vision_fingerprint", "text_fingerprint")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _recorded_root(info: dict) -> Path | None:
    """The workdir an older index.json was written in (its stages' absolute paths say), or None."""
    for stage in info.get("stages", []):
        path = Path(str(stage.get("path", "")))
        if stage.get("name") == "corpus" and path.is_absolute():
            return path.parent
    return None


# A directory's name: W/<name> (lower case, digits, underscores). Temporary and work directories beside the stores
# carry a dot or a leading one (`cfir_jax.stores.atomic_write`), and `work` is a change's own scratch directory
# (cfir_jax.stores.versions).
_STORE_NAME = re.compile(r"[a-z][a-z0-9_]*")
NOT_STORES = ("work",)


def is_store_name(name: str) -> bool:
    """Whether `name` can name a directory of the layout (the staging of a change reads its directories by it)."""
    return bool(_STORE_NAME.fullmatch(name)) and name not in NOT_STORES
