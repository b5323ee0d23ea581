"""Versions of a workdir that readers can follow, and the commit that makes a change's new stores current together.

A change (`index.py --add / --remove / --compact / --add-entities`, a rebuild of a built workdir) rewrites several
stores at once. It stages the new version of each in `W/.change/<store>` (`begin`, `Change.stage`: nothing under
`W/<store>` is touched, so a crash while staging leaves the served version as it was, and a rerun of the same change
resumes from what it staged), then commits (`Change.commit`):

1. takes `W/.commit.lock` exclusively: readers hold it shared while they open their stores (`reading`), so none opens
   half of the old version and half of the new one;
2. writes the journal `W/.change/COMMIT.json` (the stores to move, those to drop, and the new index.json): the commit
   point. Before it, nothing of the workdir changed; after it, the change happens even if the process dies;
3. swaps each staged store with `W/<store>` (`atomic_write.replace_dir`), drops the stores the change made invalid,
   writes index.json with `"version"` + 1 and a `"history"` entry, removes the journal and the staging directory.

A commit cut off after its journal is finished by `recover` (idempotent: each step is done when still undone), which
every writer runs when it takes the workdir (`lock.hold`) and `begin` runs first. A reader meeting a journal with no
writer committing refuses in one line naming the fix, so the service keeps serving the version it has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from cfir_jax.core.errors import CfirError
from cfir_jax.stores.atomic_write import remove_path, replace_dir, sweep_temps, temp_name, write_json_atomic
from cfir_jax.stores.contract import atomic_dir
from cfir_jax.stores.layout import Layout, is_store_name

log = logging.getLogger(__name__)

CHANGE_DIR = ".change"  # W/.change: the stores a change staged, its change.json and, once committing, the journal
CHANGE_JSON = "change.json"  # {"op", "key", "base_version"}: which change the staged stores belong to
JOURNAL = "COMMIT.json"  # {"version", "stores", "inodes", "drop", "index"}: written at the commit point
COMMIT_LOCK = ".commit.lock"  # exclusive while a commit renames, shared while a reader opens
COMMIT_WAIT_S = 600.0  # how long a commit waits for readers still opening before it gives up (nothing changed)
READ_WAIT_S = 120.0  # how long a reader waits for a commit (renames only: well under a second when alive)
NOTICE_S = 10.0  # a wait this long is said in one log line

_reading = threading.local()  # the workdirs this thread is reading: `reading` nests without taking the lock again


def _layout(layout: Layout | str | os.PathLike) -> Layout:
    return layout if isinstance(layout, Layout) else Layout.of(layout)


def _read_index(layout: Layout) -> dict:
    try:
        info = json.loads(layout.index_json.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CfirError(f"{layout.index_json}: unreadable ({e.__class__.__name__}); run index.py again") from None
    if not isinstance(info, dict):
        raise CfirError(f"{layout.index_json}: not a JSON object; run index.py again")
    return info


def current_version(layout: Layout | str | os.PathLike) -> int:
    """The version index.json records (0 when it records none, or there is no index.json yet)."""
    return int(_read_index(_layout(layout)).get("version") or 0)


def history(layout: Layout | str | os.PathLike) -> list[dict]:
    """The history index.json records: one entry per version ([] when none)."""
    return list(_read_index(_layout(layout)).get("history") or [])


def history_entry(version: int, op: str, changes: dict) -> dict:
    """{"version", "op" ("build", "add", "remove", "compact", "add_entities"), "at" (UTC), "changes" (what changed,
    counts)}."""
    return {"version": version, "op": op, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "changes": changes}


def _at(point: str) -> None:
    """A named step of staging and committing (what the crash tests kill the process at); nothing happens here."""


# ------------------------------------------------------------------------------------------------ the commit lock
def _open_lock(layout: Layout, create: bool) -> int | None:
    """A descriptor of W/.commit.lock, or None when a reader finds none and cannot make one (a read-only workdir:
    no writer can commit there either)."""
    path = layout.root / COMMIT_LOCK
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if create:
            raise CfirError(f"{path}: cannot open the commit lock ({e.strerror})") from None
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _wait_for(fd: int, path: Path, mode: int, wait_s: float, waiting_for: str) -> bool:
    """Takes the flock `mode` on `fd`, polling; one log line after NOTICE_S, a one-line CfirError after `wait_s`.
    False when the file system has no locks (then nothing else can lock either)."""
    t0, noticed, pause = time.monotonic(), False, 0.01
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
        waited = time.monotonic() - t0
        if waited >= wait_s:
            raise CfirError(f"{path}: {waiting_for} held it for {wait_s:.0f} s; nothing was changed: rerun once "
                            "they are done")
        if waited >= NOTICE_S and not noticed:
            log.warning("%s: waiting for %s (%.0f s so far)", path, waiting_for, waited)
            noticed = True
        time.sleep(pause)
        pause = min(0.2, pause * 2)


@contextlib.contextmanager
def _locked(layout: Layout, exclusive: bool, wait_s: float) -> Iterator[None]:
    fd = _open_lock(layout, create=exclusive)
    if fd is None:
        yield
        return
    try:
        if exclusive:
            _wait_for(fd, layout.root / COMMIT_LOCK, fcntl.LOCK_EX, wait_s,
                      "readers opening the index (the service loading it, retrieve.py)")
        else:
            _wait_for(fd, layout.root / COMMIT_LOCK, fcntl.LOCK_SH, wait_s, "a commit (index.py)")
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def reading(layout: Layout | str | os.PathLike) -> Iterator[int]:
    """Holds W/.commit.lock shared while a reader opens its stores, so they are all of one version; yields it.
    A commit cut off after its journal (none running now) is refused in one line naming the fix. Nests: an inner
    `reading` of the same workdir in the same thread takes nothing more."""
    layout = _layout(layout)
    held = _reading.__dict__.setdefault("roots", set())
    if layout.root in held or not layout.root.is_dir():
        yield current_version(layout)
        return
    with _locked(layout, exclusive=False, wait_s=READ_WAIT_S):
        journal = layout.root / CHANGE_DIR / JOURNAL
        if journal.is_file():
            raise CfirError(f"{journal}: a commit of a change was cut off before it finished; run index.py on "
                            f"{layout.root} (any index.py command finishes it first), then open it again")
        held.add(layout.root)
        try:
            yield current_version(layout)
        finally:
            held.discard(layout.root)


# --------------------------------------------------------------------------------------------- staging, commit
@dataclasses.dataclass
class Change:
    """One change being staged in W/.change (made by `begin`): its new stores, then `commit`."""

    layout: Layout
    op: str
    key: dict
    base_version: int
    dropped: list[str] = dataclasses.field(default_factory=list)

    @property
    def directory(self) -> Path:
        return self.layout.root / CHANGE_DIR

    def staged(self, store: str) -> Path | None:
        """W/.change/<store> when an earlier run of this same change staged it completely (resume), else None."""
        path = self.directory / _store_name(store)
        return path if path.is_dir() else None

    @contextlib.contextmanager
    def stage(self, store: str) -> Iterator[Path]:
        """Yields an empty temporary directory that becomes W/.change/<store> (with its checksums) when the block
        finishes; on an error nothing is staged. W/<store> itself is untouched until `commit`."""
        # Files hard-linked from W/<store> keep the checksums recorded there (a grown corpus is not read again).
        with atomic_dir(self.directory / _store_name(store), linked_from=self.layout.root / store) as tmp:
            yield tmp
        _at(f"staged:{store}")

    def drop(self, store: str) -> None:
        """Removes W/<store> at the commit (a derived store the change made invalid, rebuilt later)."""
        store = _store_name(store)
        if store not in self.dropped:
            self.dropped.append(store)

    def abandon(self) -> None:
        """Removes what this change staged (its input was refused: there is nothing worth resuming)."""
        _remove_dir(self.directory)

    def commit(self, changes: dict, index: dict | None = None) -> int:
        """Makes the staged stores current together and records the version in index.json (`"version"` + 1 and a
        `"history"` entry {"version", "op", "at", "changes"}; its other keys kept, or replaced by `index`: what a
        rebuild records). Returns the new version."""
        stores = sorted(p.name for p in self.directory.iterdir() if p.is_dir() and is_store_name(p.name))
        clash = sorted(set(stores) & set(self.dropped))
        if clash:
            raise ValueError(f"stores both staged and dropped: {clash}")
        with _locked(self.layout, exclusive=True, wait_s=COMMIT_WAIT_S):
            _at("locked")
            info = _read_index(self.layout)
            have = int(info.get("version") or 0)
            if have != self.base_version:
                raise CfirError(f"{self.layout.index_json}: now at version {have} but this change was staged on "
                                f"version {self.base_version}; rerun the command to stage it again")
            version = have + 1
            index = {**(info if index is None else index), "version": version,
                     "history": [*(info.get("history") or []), history_entry(version, self.op, changes)]}
            # Each staged store's inode: after an exchange the staged name holds the old store, which a rerun of
            # the roll-forward must not swap back in.
            inodes = {store: (self.directory / store).stat().st_ino for store in stores}
            write_json_atomic(self.directory / JOURNAL, {"version": version, "stores": stores, "inodes": inodes,
                                                         "drop": self.dropped, "index": index})
            _at("journal")
            _roll_forward(self.layout)
        log.info("%s: committed version %d (%s: %s)", self.layout.root, version, self.op, changes)
        return version


def _store_name(store: str) -> str:
    if not is_store_name(store):
        raise ValueError(f"{store!r} is not a store name of the workdir layout (lower case, digits, underscores)")
    return store


def _canonical(obj) -> object:
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def begin(layout: Layout | str | os.PathLike, op: str, key: dict) -> Change:
    """Starts (or resumes) a change of the workdir; the caller holds the writer lock. Rolls forward a commit that
    was cut off (`recover`) first; a staging directory of another change, or staged on another version, is
    discarded (one log line)."""
    layout = _layout(layout)
    recover(layout)
    base = current_version(layout)
    want = {"op": op, "key": _canonical(key), "base_version": base}
    directory = layout.root / CHANGE_DIR
    sweep_temps(directory)
    if directory.exists():
        try:
            have = json.loads((directory / CHANGE_JSON).read_text())
        except (OSError, ValueError):
            have = None
        if have == want:
            staged = sorted(p.name for p in directory.iterdir() if p.is_dir() and is_store_name(p.name))
            log.info("%s: resuming the %s change staged earlier (%s staged)", layout.root, op,
                     ", ".join(staged) or "nothing")
            return Change(layout, op, want["key"], base)
        log.warning("%s: discarding the staged change %s (this run is %s on version %d)", directory,
                    have or "of unknown kind", {"op": op, "key": want["key"]}, base)
        _remove_dir(directory)
    directory.mkdir(parents=True)
    write_json_atomic(directory / CHANGE_JSON, want)
    return Change(layout, op, want["key"], base)


def _remove_dir(path: Path) -> None:
    """Renames `path` aside, then removes it: it is gone at once, never half there."""
    if path.exists():
        aside = temp_name(path)
        os.replace(path, aside)
        remove_path(aside)


def _roll_forward(layout: Layout) -> None:
    """Does what the journal says is still undone: each staged store renamed over W/<store>, the dropped stores
    removed, index.json written, then the journal and the staging directory removed. Idempotent."""
    directory = layout.root / CHANGE_DIR
    journal = json.loads((directory / JOURNAL).read_text())
    inodes = journal.get("inodes") or {}
    for store in journal["stores"]:
        staged = directory / store
        # Else moved already by the run this one finishes (what is left there is the old store, exchanged out).
        if staged.is_dir() and inodes.get(store, staged.stat().st_ino) == staged.stat().st_ino:
            replace_dir(staged, layout.root / store)
        _at(f"replaced:{store}")
    for store in journal["drop"]:
        _remove_dir(layout.root / store)
    write_json_atomic(layout.index_json, journal["index"])
    _at("index")
    (directory / JOURNAL).unlink()  # the commit is whole: readers open the new version from here on
    _at("done")
    _remove_dir(directory)
    for store in [*journal["stores"], *journal["drop"]]:  # what a process killed inside replace_dir left aside
        sweep_temps(layout.root / store)
        sweep_temps(layout.root / f"{store}.old")


def recover(layout: Layout | str | os.PathLike) -> bool:
    """Finishes a commit cut off after its journal (True), or does nothing (False). Writers call it when they take
    the workdir (`lock.hold`), before anything else reads or writes its stores."""
    layout = _layout(layout)
    if not (layout.root / CHANGE_DIR / JOURNAL).is_file():
        return False
    with _locked(layout, exclusive=True, wait_s=COMMIT_WAIT_S):
        if not (layout.root / CHANGE_DIR / JOURNAL).is_file():  # another process finished it meanwhile
            return False
        _roll_forward(layout)
    log.warning("%s: finished a commit that was cut off (now version %d)", layout.root, current_version(layout))
    return True
