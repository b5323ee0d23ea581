"""One writer per workdir: index.py and train.py hold an exclusive lock on `W/.writer.lock` for their whole run.

The lock is an OS lock (`fcntl.flock`) on a file in the workdir, so it is released when the process ends, however
it ends (a crash or SIGKILL included): no stale lock to remove by hand. The file records the holder (pid, host,
command, start time) so a second writer is refused in one line that names it, with exit status 2. Readers
(retrieve.py, the service) never take it: every store is published by an atomic rename, so a reader sees a whole
old store or a whole new one (and a change's stores, committed together, are opened under the shared commit lock of
`cfir_jax.stores.versions`). Taking the writer lock first finishes a commit a killed writer left half done.

Under jax.distributed, process 0 alone holds it (the processes of one job are one writer). Shared file systems:
the lock works across hosts where the file system implements flock between clients (NFSv4 and Lustre with
`flock` mount option do; Linux NFS maps flock to POSIX byte-range locks); on a file system without locks between
clients (gcsfuse, some FUSE mounts) two jobs on two hosts are not kept apart: run one writer job at a time there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from cfir_jax.core import hosts
from cfir_jax.core.errors import CfirError
from cfir_jax.stores import versions

LOCK_FILE = ".writer.lock"


class WorkdirBusy(CfirError):
    """Another writer holds the workdir."""


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        return (f"pid {info['pid']} on host {info['host']} ({info['command']}, since {info['since']})")
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its name"


@contextlib.contextmanager
def hold(workdir: str | os.PathLike, command: str | None = None) -> Iterator[None]:
    """Holds the workdir's writer lock for the block; `WorkdirBusy` (one line naming the holder) when another
    process has it. Taking it finishes a change's commit that was cut off (`versions.recover`). In a
    jax.distributed job process 0 takes it and tells the others, which then stop with the same line rather than
    wait at their first barrier."""
    if not hosts.is_main():
        refused = hosts.from_main("writer_lock")
        if refused:
            raise WorkdirBusy(refused)
        yield
        return
    try:
        fd = _acquire(Path(workdir), command)
    except CfirError as e:
        hosts.from_main("writer_lock", str(e))
        raise
    try:
        versions.recover(workdir)  # a commit cut off after its journal is finished before anything reads the stores
    except Exception as e:
        hosts.from_main("writer_lock", f"{workdir}: {e}")  # the other processes stop too, rather than wait
        os.close(fd)
        raise
    hosts.from_main("writer_lock", "")
    try:
        yield
    finally:
        os.ftruncate(fd, 0)
        os.close(fd)  # releases the lock


def _acquire(workdir: Path, command: str | None) -> int:
    """Locks `workdir/.writer.lock` and writes this process's name into it; the open descriptor holds the lock."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise CfirError(f"{path}: cannot lock the workdir ({e.strerror}); its file system may not support "
                            "locks (see README, Reliability)") from None
        # The holder writes its name right after locking; give it a moment so the message can name it.
        for _ in range(20):
            if path.stat().st_size:
                break
            time.sleep(0.05)
        raise WorkdirBusy(f"{workdir}: another writer is running ({_holder(path)}); wait for it to finish or "
                          "stop it, then rerun") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return fd
