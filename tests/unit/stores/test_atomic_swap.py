"""A store directory replaced while readers open it (`atomic_write.replace_dir`): exchanged in one step where the OS
can, renamed aside and in elsewhere; a reader never finds it missing, and a swap cut off by a dead writer is undone
or finished."""

import os
import signal
import subprocess
import sys
import threading

import pytest
from repo import ROOT

from cfir_jax.core.errors import StoreError
from cfir_jax.stores import atomic_write, versions
from cfir_jax.stores.contract import atomic_dir, read_manifest, write_manifest
from cfir_jax.stores.layout import Layout

SWAPS = 1000


def _swap_under_a_reader(tmp_path) -> tuple[list[str], int]:
    """SWAPS replacements of tmp_path/store while a thread reads its manifest in a loop; (what the reader failed
    with, how many manifests it read)."""
    final = tmp_path / "store"
    final.mkdir()
    write_manifest(final, "thing", 1, n=0)
    failures, reads, done = [], [0], threading.Event()

    def reader():
        last = 0
        while not done.is_set():
            try:
                n = read_manifest(final, "thing", 1)["n"]
            except StoreError as e:
                failures.append(str(e))
                continue
            if n < last:
                failures.append(f"went back from {last} to {n}")
            last, reads[0] = n, reads[0] + 1

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the reader runs between the writer's system calls
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for n in range(1, SWAPS + 1):
            new = tmp_path / f"new-{n}"
            new.mkdir()
            write_manifest(new, "thing", 1, n=n)
            atomic_write.replace_dir(new, final)
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert read_manifest(final, "thing", 1)["n"] == SWAPS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # no old directory left behind
    return failures, reads[0]


def test_a_reader_never_finds_the_store_missing_through_1000_exchanges(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x").write_text("a")
    assert atomic_write.exchange(a, b), "renameat2(RENAME_EXCHANGE) is expected on Linux"
    assert (b / "x").read_text() == "a" and not (a / "x").exists()
    syscall = atomic_write._renameat2(wrapper=False)  # the system call by number, where libc has no wrapper
    assert syscall(os.fsencode(a), os.fsencode(b)) == 0 and (a / "x").read_text() == "a"
    a.joinpath("x").unlink(), a.rmdir(), b.rmdir()
    exchanges = []
    real = atomic_write.exchange
    monkeypatch.setattr(atomic_write, "exchange", lambda x, y: exchanges.append(1) or real(x, y))
    failures, reads = _swap_under_a_reader(tmp_path)
    assert failures == [] and reads > 0
    assert len(exchanges) == SWAPS


def test_a_reader_never_finds_the_store_missing_through_1000_fallback_swaps(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic_write, "exchange", lambda a, b: False)  # an OS or file system without the exchange
    failures, reads = _swap_under_a_reader(tmp_path)
    assert failures == [] and reads > 0


KILLED_MID_SWAP = """
import os, signal, sys
from pathlib import Path
from cfir_jax.stores import atomic_write
final = Path(sys.argv[1])
os.replace(final, atomic_write.temp_name(final.with_name(final.name + ".old")))
os.kill(os.getpid(), signal.SIGKILL)
"""


def _kill_mid_swap(final) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_SWAP, str(final)], cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL


def test_a_fallback_swap_cut_off_is_undone_by_the_next_writer_and_refused_by_readers_meanwhile(tmp_path):
    final = tmp_path / "store"
    final.mkdir()
    write_manifest(final, "thing", 1, n=1)
    _kill_mid_swap(final)
    assert not final.exists()
    with pytest.raises(StoreError, match="missing directory"):  # at once: its writer is dead, nothing to wait for
        read_manifest(final, "thing", 1)
    with pytest.raises(RuntimeError), atomic_dir(final):  # the next writer, even one that fails, puts it back
        raise RuntimeError("build failed")
    assert read_manifest(final, "thing", 1)["n"] == 1
    with atomic_dir(final) as tmp:
        write_manifest(tmp, "thing", 1, n=2)
    assert read_manifest(final, "thing", 1)["n"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_a_commit_cut_off_after_an_exchange_is_finished_not_swapped_back(tmp_path, monkeypatch):
    w = tmp_path / "w"
    (w / "image_cache").mkdir(parents=True)
    (w / "image_cache" / "data.txt").write_text("old")
    (w / "index.json").write_text('{"version": 1}')
    change = versions.begin(w, "add", {"path": "a"})
    with change.stage("image_cache") as tmp:
        (tmp / "data.txt").write_text("new")

    def exchange_then_die(src, final):
        assert atomic_write.exchange(src, final)  # the old store now sits at the staged name
        raise RuntimeError("killed before the old store was removed")

    monkeypatch.setattr(versions, "replace_dir", exchange_then_die)
    with pytest.raises(RuntimeError):
        change.commit({})
    monkeypatch.setattr(versions, "replace_dir", atomic_write.replace_dir)
    assert versions.recover(w)
    assert (w / "image_cache" / "data.txt").read_text() == "new"
    assert versions.current_version(Layout.of(w)) == 2 and not (w / ".change").exists()
