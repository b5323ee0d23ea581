"""Atomic writes, the one way this project writes a file or directory that others read.

A file is written at a temporary name beside its final path (`temp_name`: unique per host, process and call),
flushed and fsynced, then renamed over the final path, so a reader sees the old file or the new one, never half of
one. A directory is replaced by exchanging it with the old one in one step (`replace_dir`: Linux's
`renameat2(RENAME_EXCHANGE)`); where the OS or file system has no exchange, the old directory is renamed aside and
the new one renamed in, and for that moment a reader waits (`wait_for_dir`) and a writer restores what a dead
process left aside (`recover_swap`). `sweep_temps` removes the temporaries that dead processes of this host left
behind. The store floor's `contract.atomic_dir` builds on these.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from glob import escape as glob_escape
from pathlib import Path
from typing import IO, Any

import numpy as np

from cfir_jax.core import faults

_HOST = socket.gethostname().replace("-", "_") or "host"


# The names a store has while it is being written, beside W/<name> (the one place they are spelled): the work
# directory a build shares across its processes (`.NAME.building`), the chunks a resumable build has finished
# (`NAME.partial`), and an atomic write's temporary (`NAME.tmp-HOST-PID-RANDOM`, `temp_name`; the old directory a
# fallback swap keeps aside for a moment, `NAME.old.tmp-HOST-PID-RANDOM`).
_WORK, _PARTIAL, _TEMP = ".{}.building", "{}.partial", "{}.tmp"


def work_dir(out_dir: str | os.PathLike) -> Path:
    """The work directory `.NAME.building` beside `out_dir` where a build keeps what it has done so far."""
    out_dir = Path(out_dir)
    return out_dir.with_name(_WORK.format(out_dir.name))


def partial_dir(out_dir: str | os.PathLike) -> Path:
    """Where a chunked build of `out_dir` keeps its finished chunks until the store is complete: `NAME.partial`."""
    out_dir = Path(out_dir)
    return out_dir.with_name(_PARTIAL.format(out_dir.name))


def builds_in_progress(out_dir: str | os.PathLike) -> list[Path]:
    """The work of a build of `out_dir` that is under way or was interrupted (`work_dir`, `partial_dir`)."""
    return [p for p in (work_dir(out_dir), partial_dir(out_dir)) if p.exists()]


def temp_name(path: str | os.PathLike, hidden: bool = False) -> Path:
    """A name beside `path` that no other process (on any host) will pick: NAME.tmp-HOST-PID-RANDOM (with a leading
    dot when `hidden`). A writer never deletes another process's temporary files (`sweep_temps` removes only those
    of dead processes of this host)."""
    path = Path(path)
    stem = f".{path.name}" if hidden else path.name
    return path.with_name(f"{_TEMP.format(stem)}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    """Whether a file name is an atomic write's temporary (`temp_name`'s NAME.tmp-HOST-PID-RANDOM, hidden or not):
    a write under way, or one a killed process never finished."""
    return f"{_TEMP.format('')}-" in name


def sweep_temps(path: str | os.PathLike) -> None:
    """Removes the temporary files and directories of `path` (`temp_name`'s, hidden or not, and the fixed
    `NAME.tmp` / `NAME.tmp-PID` of older versions) left by processes of this host that no longer run; those of live
    processes, or of other hosts, are kept."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    for stem in (path.name, f".{path.name}"):
        for tmp in path.parent.glob(f"{glob_escape(_TEMP.format(stem))}*"):
            owner = tmp.name[len(_TEMP.format(stem)):]
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


def discard_dir(path: Path) -> None:
    """Removes the directory `path` so that it is gone at once, never half there: renamed aside (a hidden temporary
    name beside it, which no reader opens) first, then deleted there. An error deleting it is raised, not ignored; a
    kill meanwhile leaves only the renamed copy, which `sweep_temps(path)` removes once its process is gone."""
    aside = temp_name(path, hidden=True)
    os.replace(path, aside)
    shutil.rmtree(aside)


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
    with atomic_file(path, "w", encoding="utf-8") as f:
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


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_RENAMEAT2_SYSCALL = {"x86_64": 316, "aarch64": 276}  # where libc has no renameat2 wrapper (glibc < 2.28)
_NO_EXCHANGE = (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM)


def _renameat2(wrapper: bool = True) -> object | None:
    """A callable (src: bytes, dst: bytes) -> int (0 or -1, errno set) for renameat2(RENAME_EXCHANGE), or None: libc's
    wrapper where it has one (and `wrapper`), else the system call by its number."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = getattr(libc, "renameat2", None) if wrapper else None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        return lambda a, b: fn(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)
    number = _RENAMEAT2_SYSCALL.get(platform.machine())
    if number is None:
        return None
    return lambda a, b: libc.syscall(ctypes.c_long(number), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(a),
                                     ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(b), ctypes.c_uint(_RENAME_EXCHANGE))


_RENAMEAT2 = _renameat2()


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swaps the two existing paths `a` and `b` in one step (each name always names one of the two); False where
    the OS or the file system cannot (then nothing changed)."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def old_name(final: str | os.PathLike) -> Path:
    """FINAL.old: the stem of the names under which the fallback swap keeps the old `final` for a moment."""
    final = Path(final)
    return final.with_name(f"{final.name}.old")


def _aside(final: Path) -> Path:
    """Where the fallback swap keeps the old `final` for a moment: FINAL.old.tmp-HOST-PID-RANDOM."""
    return temp_name(old_name(final))


def _asides(final: Path, dead: bool) -> list[Path]:
    """The old `final`s that fallback swaps renamed aside: those of dead processes of this host (`dead`), or else
    those of live processes and of other hosts."""
    out = []
    prefix = f"{_TEMP.format(old_name(final).name)}-"
    for old in sorted(final.parent.glob(f"{glob_escape(prefix)}*")):
        owner = old.name[len(prefix):].rsplit("-", 2)
        gone = len(owner) == 3 and owner[0] == _HOST and owner[1].isdigit() and not _alive(int(owner[1]))
        if gone == dead:
            out.append(old)
    return out


def replace_dir(src: str | os.PathLike, final: str | os.PathLike) -> None:
    """Renames the complete directory `src` to `final`, replacing what was there, so that `final` is at every moment
    the old directory or the new one: exchanged in one step where the OS can (`exchange`), then the old one (now at
    `src`) removed. Elsewhere the old `final` is renamed aside, `src` renamed in and the old one removed; for that
    moment readers wait (`wait_for_dir`) and a dead writer's swap is undone by `recover_swap`."""
    src, final = Path(src), Path(final)
    if final.is_dir() and not final.is_symlink() and exchange(src, final):
        remove_path(src)  # the old directory, under the name the new one had
        return
    old = _aside(final)
    if final.exists():
        os.replace(final, old)
    os.replace(src, final)
    remove_path(old) if old.exists() else None


def recover_swap(final: str | os.PathLike) -> bool:
    """Puts back the old `final` that a process of this host, now dead, renamed aside in `replace_dir`'s fallback
    and never replaced (True), or does nothing (False): `final` is then as it was before that swap began."""
    final = Path(final)
    if final.exists():
        return False
    for old in _asides(final, dead=True):
        os.replace(old, final)
        return True
    return False


def wait_for_dir(path: str | os.PathLike, wait_s: float = 10.0) -> bool:
    """Whether the directory `path` is there, waiting while a fallback `replace_dir` has it renamed aside (at most
    `wait_s`); False at once when it is missing with no swap under way."""
    path = Path(path)
    deadline, quiet = time.monotonic() + wait_s, 0
    while True:
        if path.is_dir():
            return True
        swapping = bool(_asides(path, dead=False))
        quiet = 0 if swapping else quiet + 1
        if quiet >= 2 or time.monotonic() > deadline:  # missing twice with no swap between: truly missing
            return path.is_dir()
        time.sleep(0.001)


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
