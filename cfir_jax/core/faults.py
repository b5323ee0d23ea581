"""What the commands say when the machine, not the input, fails: a full disk, a signal, an unreadable file.

The writers of the store floor (`atomic_write.atomic_file`, `contract.atomic_dir`) and the index stages announce what
they write (`writing`, `stage`); `describe` turns an exception caught at the command line into one line naming it:

    no space left on /data (ext4) while writing W/image_cache (stage image_cache); free more than 1.2 GB (what
    it had written when the disk filled) and rerun: finished stages are kept

SIGTERM (`on_sigterm`) raises `Interrupted` in the main thread, which the same boundary prints as
"interrupted during STAGE; rerun to resume" with exit status 143 (128 + SIGTERM, what a shell reports).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from cfir_jax.core.errors import CfirError

EXIT_SIGTERM = 128 + signal.SIGTERM
log = logging.getLogger(__name__)

# What is being written, outermost first: (the store or file, its temporary directory or None).
_writing: list[tuple[Path, Path | None]] = []
_stage: list[str] = []


class Interrupted(BaseException):
    """SIGTERM arrived; raised in the main thread so every `finally` (temporary files, locks) runs. Its message
    names the stage that was running."""


class DiskFull(CfirError):
    """The disk filled while writing a store (one line: `disk_full_message`)."""


@contextlib.contextmanager
def _translating() -> Iterator[None]:
    """Turns an ENOSPC raised inside into `DiskFull`, while the stacks still say what was being written."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        full = disk_full(e)
        if full is None:
            raise
        raise DiskFull(disk_full_message(full)) from None


@contextlib.contextmanager
def writing(target: str | os.PathLike, temp: str | os.PathLike | None = None) -> Iterator[None]:
    """Marks `target` (a store directory being built in `temp`, or a file) as being written: a full disk inside
    raises `DiskFull` naming the outermost store being written."""
    _writing.append((Path(target), Path(temp) if temp is not None else None))
    try:
        with _translating():
            yield
    finally:
        _writing.pop()


@contextlib.contextmanager
def stage(name: str, store: str | os.PathLike | None = None) -> Iterator[None]:
    """Marks the index stage running now (writing `store`), for the messages of a full disk and of SIGTERM."""
    _stage.append(name)
    try:
        if store is None:
            with _translating():
                yield
        else:
            with writing(store):
                yield
    finally:
        _stage.pop()


def current_stage() -> str | None:
    return _stage[-1] if _stage else None


class _DiskFullNoise(logging.Filter):
    """Drops the log records of a library's background threads that fail on a full disk (orbax logs each of its
    threads' failures with a traceback); the command says it once, in one line. Kept at debug level."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += " " + repr(record.exc_info[1])
        if any(marker in text for marker in _DISK_FULL_TEXT):
            log.debug("%s", text)
            return False
        return True


_DISK_FULL_TEXT = ("No space left on device", "os_error_code='28'", "Disk quota exceeded")


def _unraisable(info) -> None:
    """asyncio callbacks of a failed orbax save report "Event loop is closed" as unraisable once the loop is gone;
    with a full disk they are consequences, not news: logged at debug level. Anything else is printed as usual."""
    if isinstance(info.exc_value, RuntimeError) and "Event loop is closed" in str(info.exc_value) or \
            (info.exc_value is not None and disk_full(info.exc_value) is not None):
        log.debug("unraisable after a failure: %r", info.exc_value)
        return
    sys.__unraisablehook__(info)


def quiet_library_noise() -> None:
    """Installed by the commands that write stores: a full disk gives one line, not the tracebacks of every
    background thread of orbax and tensorstore that met it."""
    for name in ("absl", "asyncio"):  # orbax's threads; its tasks' "exception was never retrieved" at collection
        logging.getLogger(name).addFilter(_DiskFullNoise())
    sys.unraisablehook = _unraisable


def on_sigterm() -> None:
    """From now on SIGTERM raises `Interrupted` (in the main thread) instead of killing the process silently."""

    def handler(signum, frame):
        raise Interrupted(interrupted_message())

    signal.signal(signal.SIGTERM, handler)


def interrupted_message() -> str:
    where = current_stage()
    return f"interrupted during {where}; rerun to resume" if where else "interrupted; rerun to resume"


def disk_full(exc: BaseException) -> OSError | None:
    """The ENOSPC (or EDQUOT) error behind `exc`, however deep in its causes and contexts (orbax and asyncio wrap
    it), or None."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if "No space left on device" in str(e):
            return OSError(errno.ENOSPC, "No space left on device")
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return None


def mount_of(path: Path) -> str:
    """The mount point and file system type holding `path` ("/data (ext4)"), from /proc/mounts where readable."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    best, kind = str(path), ""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return best
    best_len = -1
    for point, fs in mounts:
        point = point.replace("\\040", " ")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) > best_len:
            best, kind, best_len = point, fs, len(point)
    return f"{best} ({kind})" if kind else best


def _size(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def disk_full_message(error: OSError) -> str:
    """One line: which device filled, what was being written, how much to free, and that finished stages stay."""
    target = _writing[0][0] if _writing else (Path(error.filename) if error.filename else None)
    temps = [t for _, t in _writing if t is not None]
    temp = temps[-1] if temps else None  # the store directory being built when the disk filled
    written = _size(temp) if temp is not None else 0
    where = mount_of(temp or target or Path.cwd())
    what = f" while writing {target}" if target is not None else ""
    if current_stage():
        what += f" (stage {current_stage()})"
    need = (f"free more than {_human(written)} (what it had written when the disk filled)" if written
            else "free space")
    return f"no space left on {where}{what}; {need} and rerun: finished stages are kept"


def describe(exc: BaseException) -> tuple[str, int] | None:
    """(one line, exit status) for a failure of the machine behind `exc`, or None when it is something else."""
    if isinstance(exc, Interrupted):
        return (str(exc) or interrupted_message()), EXIT_SIGTERM
    full = disk_full(exc)
    if full is not None:
        return disk_full_message(full), 2
    return None
