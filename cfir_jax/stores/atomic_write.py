"""Atomic writes, the one way this project writes a file or directory that others read.

A file is written at a temporary name beside its final path (`temp_name`: unique per host, process and call),
flushed and fsynced, then renamed over the final path, so a reader sees the old file or the new one, never half of
one; a directory is replaced the same way (`replace_dir`). `sweep_temps` removes the temporaries that dead processes
of this host left behind. The store floor's `contract.atomic_dir` builds on these.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
from collections.abc import Iterable, Iterator
from glob import escape as glob_escape
from pathlib import Path
from typing import IO, Any

import numpy as np

from cfir_jax.core import faults

_HOST = socket.gethostname().replace("-", "_") or "host"


def temp_name(path: str | os.PathLike, hidden: bool = False) -> Path:
    """A name beside `path` that no other process (on any host) will pick: NAME.tmp-HOST-PID-RANDOM (with a leading
    dot when `hidden`). A writer never deletes another process's temporary files (`sweep_temps` removes only those
    of dead processes of this host)."""
    path = Path(path)
    stem = f".{path.name}" if hidden else path.name
    return path.with_name(f"{stem}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


def sweep_temps(path: str | os.PathLike) -> None:
    """Removes the temporary files and directories of `path` (`temp_name`'s, hidden or not, and the fixed
    `NAME.tmp` / `NAME.tmp-PID` of older versions) left by processes of this host that no longer run; those of live
    processes, or of other hosts, are kept."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    for stem in (path.name, f".{path.name}"):
        for tmp in path.parent.glob(f"{glob_escape(stem)}.tmp*"):
            owner = tmp.name[len(stem) + len(".tmp"):]
            if owner:
                parts = owner[1:].rsplit("-", 2)
                host, pid = (parts[0], parts[1]) if len(parts) == 3 else (_HOST, parts[0])
                if not owner.startswith("-") or host != _HOST or not pid.isdigit() or _alive(int(pid)):
                    continue
            remove_path(tmp)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_path(path: Path) -> None:
    """Removes the file or directory tree at `path`; nothing there is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO]:
    """Yields a file opened at a temporary name beside `path` that replaces `path` (flushed and fsynced) only if the
    block finishes; on any error the temporary file is removed and `path` is untouched. The one way this project
    writes a file that others read."""
    path = Path(path)
    tmp = temp_name(path, hidden=True)
    try:
        with faults.writing(path), open(tmp, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        remove_path(tmp) if tmp.exists() else None


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Writes `obj` as JSON to `path` through a temporary file and a rename."""
    with atomic_file(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes UTF-8 `text` to `path` through a temporary file and a rename."""
    with atomic_file(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def save_npy_atomic(path: str | os.PathLike, array: np.ndarray) -> None:
    """np.save of `array` to `path` through a temporary file and a rename (a finished shard or chunk)."""
    with atomic_file(path) as f:
        np.save(f, array)


def savez_atomic(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    """np.savez of `arrays` to `path` through a temporary file and a rename."""
    with atomic_file(path) as f:
        np.savez(f, **arrays)


def replace_dir(src: str | os.PathLike, final: str | os.PathLike) -> None:
    """Renames the complete directory `src` to `final`, replacing what was there: the old `final` is moved aside
    under a temporary name first and removed after, so `final` is at every moment either old or new."""
    src, final = Path(src), Path(final)
    old = temp_name(final.with_name(f"{final.name}.old"))
    if final.exists():
        os.replace(final, old)
    os.replace(src, final)
    remove_path(old) if old.exists() else None


def link_tree(src: Path, dst: Path, skip: Iterable[str] = ()) -> None:
    """Hard-links the file or tree `src` as `dst` (same relative paths; a copy where linking fails: another file
    system, or one without hard links), leaving out the top-level names in `skip`. A new version of a store is made
    so from the old one, whose files are never opened for writing."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        return
    skip = set(skip)
    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        if entry.name not in skip:
            link_tree(entry, dst / entry.name)
