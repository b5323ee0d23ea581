"""On-disk stores shared by every stage: atomic directories and manifests.

Every stage of the pipeline (image cache, entities, summaries, entity index, trained model) writes one directory.
A directory is built under a temporary name and renamed into place only when complete, so a reader never sees a
half-written store. Its `manifest.json` records the format version, the model fingerprint, dims, dtype, counts and
the time; the next stage calls `check_manifest` to refuse a store built by another model or with other dims.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from cfir_jax.core import faults
from cfir_jax.core.errors import StoreError
from cfir_jax.stores.atomic_write import (
    old_name,
    recover_swap,
    remove_path,
    replace_dir,
    sweep_temps,
    temp_name,
    wait_for_dir,
    write_json_atomic,
)
from cfir_jax.stores.integrity import MANIFEST, write_checksums

log = logging.getLogger(__name__)



@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, linked_from: str | os.PathLike | None = None) -> Iterator[Path]:
    """Yields a temporary directory that replaces `final` only if the block finishes without error.

    Before the rename, the checksums of every file are recorded (`integrity.CHECKSUMS`: what `index.py --verify`
    checks; files hard-linked from the store `linked_from` keep the checksums recorded there). On an exception the
    temporary directory is removed; the old `final`, if any, is untouched. The temporary name is unique to this
    process, so two processes never write into one directory.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    recover_swap(final)  # a dead writer's swap cut off between its two renames: the old store put back
    sweep_temps(final)
    sweep_temps(old_name(final))
    tmp = temp_name(final)
    tmp.mkdir()
    try:
        with faults.writing(final, tmp):
            yield tmp
            write_checksums(tmp, linked_from)
            replace_dir(tmp, final)
    finally:
        remove_path(tmp) if tmp.exists() else None


def write_manifest(directory: str | os.PathLike, kind: str, version: int, **fields: Any) -> dict:
    """Writes the manifest of a store; `kind` names the store ("image_cache", ...), `version` its format."""
    manifest = {"kind": kind, "format_version": version, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}
    write_json_atomic(Path(directory) / MANIFEST, manifest)
    return manifest


def read_manifest(directory: str | os.PathLike, kind: str, version: int | None = None) -> dict:
    """Reads the manifest of a complete store, or raises a one-line StoreError saying what is wrong."""
    directory = Path(directory)
    path = directory / MANIFEST
    for _ in range(100):  # the directory swapped for a new version meanwhile (replace_dir's fallback): read again
        if not wait_for_dir(directory):
            raise StoreError(f"{directory}: no {kind} store here (missing directory); build it with index.py")
        opened = None
        try:
            opened = directory.stat().st_ino  # which directory the read below finds, unless a swap comes between
            manifest = json.loads(path.read_text())
            break
        except FileNotFoundError:
            if _same_directory(directory, opened) and not path.exists():  # no swap between: truly incomplete
                raise StoreError(f"{directory}: incomplete {kind} store (no {MANIFEST}); rebuild it with index.py"
                                 ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreError(f"{path}: unreadable manifest ({e.__class__.__name__}); rebuild the store") from None
    else:
        raise StoreError(f"{directory}: replaced again and again while being read; open it again")
    if manifest.get("kind") != kind:
        raise StoreError(f"{path}: expected a {kind} store, found {manifest.get('kind')!r}")
    if version is not None and manifest.get("format_version") != version:
        raise StoreError(
            f"{path}: {kind} format version {manifest.get('format_version')} but this code reads {version}; rebuild it"
        )
    return manifest


def _same_directory(directory: Path, inode: int | None) -> bool:
    """Whether `directory` is still the directory whose inode was `inode` (False where it was swapped or is gone)."""
    try:
        return inode is not None and directory.stat().st_ino == inode
    except FileNotFoundError:
        return False


def manifest_digest(manifest: dict) -> str:
    """A short sha256 of a manifest: it changes whenever its store is rebuilt (the manifest records the build time),
    so a store derived from another records it and is rebuilt or refused when the source changes."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_derived(manifest: dict, where: str | os.PathLike, **sources: Any) -> None:
    """Refuses (one line) a derived store whose recorded source fingerprints differ from the current ones."""
    for key, want in sources.items():
        have = manifest.get(key)
        if have != want:
            raise StoreError(f"{where}: stale, derived from {key}={have!r} but that is now {want!r}; "
                             "run index.py to rebuild it")


def check_manifest(manifest: dict, where: str | os.PathLike, stage: str | None = None, **expected: Any) -> None:
    """Raises a one-line StoreError naming the first field of `manifest` that differs from `expected` (an expected
    None is not checked). `stage`: the index.py stage of a store made from others, which such a difference makes
    stale (the message says so, and names the stage that rebuilds it)."""
    for key, want in expected.items():
        have = manifest.get(key)
        if want is None or have == want:
            continue
        if stage is not None:
            raise StoreError(f"{where}: stale, built for {key}={have!r} but that is now {want!r}; rebuild it with "
                             f"index.py --stages {stage}")
        raise StoreError(f"{where}: store was built with {key}={have!r} but this run uses {key}={want!r}; "
                         "rebuild the store or use the matching model/config")




























def read_lines(path: Path, expected: int, store_dir: Path) -> list[str]:
    """Reads a line-per-item file and checks its length against the manifest."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; the store {store_dir} is incomplete, rebuild it") from None
    except UnicodeDecodeError:
        raise StoreError(f"{path}: not UTF-8 text; the store {store_dir} is corrupt, rebuild it") from None
    lines = text.split("\n")[:-1] if text else []
    if len(lines) != expected:
        raise StoreError(f"{path}: {len(lines)} lines but the manifest says {expected}; rebuild the store")
    return lines


class Store:
    """The base of every store's reader. `open` reads the manifest of a complete store of the reader's `KIND` and
    `VERSION` (a one-line StoreError when the directory is missing, incomplete or of another format), holds it against
    what the caller expects (`check`: by default, each expected manifest field that is not None must match; a store
    made from others names its `STAGE`, and a difference makes it stale), and loads the store (`load`, the reader's
    own)."""

    KIND: ClassVar[str]
    VERSION: ClassVar[int]
    STAGE: ClassVar[str | None] = None

    @classmethod
    def open(cls, path: str | os.PathLike, **expect: Any):
        path = Path(path)
        manifest = read_manifest(path, cls.KIND, cls.VERSION)
        cls.check(manifest, path, **expect)
        return cls.load(path, manifest)

    @classmethod
    def check(cls, manifest: dict, directory: Path, **expect: Any) -> None:
        check_manifest(manifest, directory, cls.STAGE, **expect)

    @classmethod
    def load(cls, directory: Path, manifest: dict):
        raise NotImplementedError
