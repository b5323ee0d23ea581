"""Versions and the commit of a change (cfir_jax.stores.versions): the staged stores replace the served ones
together, a crash at any point leaves a servable version (the old one before the journal, the new one after
`recover`), and readers open one version whole."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from repo import ROOT

from cfir_jax.core.errors import CfirError
from cfir_jax.stores import lock, versions
from cfir_jax.stores.layout import Layout

INDEX = {"config": {"seed": 7}, "encoder": "encoder", "stages": [{"name": "corpus"}], "version": 3,
         "history": [{"version": 3, "op": "build"}]}


def _store(path: Path, label: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "data.txt").write_text(label)
    (path / "manifest.json").write_text(json.dumps({"kind": path.name, "label": label}))


def _workdir(tmp_path: Path) -> Path:
    w = tmp_path / "W"
    for name in ("image_cache", "entity_index", "sr_compact"):
        _store(w / name, "old")
    (w / "index.json").write_text(json.dumps(INDEX))
    return w


def _label(w: Path, store: str) -> str | None:
    path = w / store / "data.txt"
    return path.read_text() if path.is_file() else None


def _change(w: Path, key: str = "a") -> versions.Change:
    change = versions.begin(w, "add", {"path": key})
    for name in ("image_cache", "entity_index"):
        if change.staged(name) is None:
            with change.stage(name) as tmp:
                _store(tmp, "new")
    change.drop("sr_compact")
    return change


def _assert_new(w: Path, version: int = 4) -> None:
    info = json.loads((w / "index.json").read_text())
    assert (_label(w, "image_cache"), _label(w, "entity_index")) == ("new", "new")
    assert not (w / "sr_compact").exists() and not (w / ".change").exists()
    assert info["version"] == version and info["history"][-1]["version"] == version
    assert {k: info[k] for k in INDEX if k not in ("version", "history")} == \
        {k: INDEX[k] for k in INDEX if k not in ("version", "history")}
    left = sorted(p.name for p in w.iterdir() if p.name not in (".commit.lock", ".writer.lock"))
    assert left == ["entity_index", "image_cache", "index.json"]  # nothing set aside is left behind


def _assert_old(w: Path) -> None:
    assert (_label(w, "image_cache"), _label(w, "entity_index"), _label(w, "sr_compact")) == ("old", "old", "old")
    assert json.loads((w / "index.json").read_text()) == INDEX


def test_a_commit_replaces_the_staged_stores_together_and_records_the_version(tmp_path):
    w = _workdir(tmp_path)
    change = _change(w)
    _assert_old(w)  # staging touches nothing the readers open
    assert change.commit({"images": 2}) == 4
    _assert_new(w)
    entry = json.loads((w / "index.json").read_text())["history"][-1]
    assert (entry["op"], entry["changes"]) == ("add", {"images": 2}) and entry["at"].endswith("Z")
    assert (w / "image_cache" / "checksums.json").is_file()
    assert versions.current_version(w) == 4 and versions.current_version(tmp_path / "none") == 0


def test_an_error_while_staging_leaves_the_old_stores_and_the_rerun_reuses_what_was_staged(tmp_path):
    w = _workdir(tmp_path)
    change = versions.begin(w, "add", {"path": "a"})
    with change.stage("image_cache") as tmp:
        _store(tmp, "new")
    with pytest.raises(RuntimeError), change.stage("entity_index") as tmp:
        _store(tmp, "half")
        raise RuntimeError("killed")
    _assert_old(w)
    again = versions.begin(w, "add", {"path": "a"})
    assert again.staged("image_cache") is not None and again.staged("entity_index") is None
    with again.stage("entity_index") as tmp:
        _store(tmp, "new")
    again.drop("sr_compact")
    assert again.commit({}) == 4
    _assert_new(w)


def test_a_staged_change_of_another_key_or_version_is_discarded(tmp_path, caplog):
    w = _workdir(tmp_path)
    _change(w, "a")
    other = versions.begin(w, "add", {"path": "b"})
    assert other.staged("image_cache") is None and "discarding the staged change" in caplog.text
    _change(w, "b")
    info = json.loads((w / "index.json").read_text())
    (w / "index.json").write_text(json.dumps({**info, "version": 9}))  # a rebuild moved the workdir on
    assert versions.begin(w, "add", {"path": "b"}).staged("image_cache") is None


def test_an_unknown_store_name_is_refused():
    change = versions.Change(Layout.of("/nonexistent"), "add", {}, 0)
    with pytest.raises(ValueError, match="not a store"):
        change.staged("../etc")


def test_a_reader_holds_a_commit_off_until_it_has_opened_its_stores(tmp_path):
    w = _workdir(tmp_path)
    change = _change(w)
    done = threading.Event()
    with versions.reading(w) as version:
        assert version == 3
        with versions.reading(w) as inner:  # nested in one thread: no second lock
            assert inner == 3
        worker = threading.Thread(target=lambda: (change.commit({}), done.set()))
        worker.start()
        time.sleep(0.5)
        assert not done.is_set()
        _assert_old(w)
    worker.join(10)
    assert done.is_set()
    _assert_new(w)


def test_a_commit_waiting_too_long_for_readers_changes_nothing(tmp_path, monkeypatch):
    w = _workdir(tmp_path)
    change = _change(w)
    monkeypatch.setattr(versions, "COMMIT_WAIT_S", 0.3)
    with versions.reading(w), pytest.raises(CfirError, match="readers opening the index") as info:
        change.commit({})
    assert "\n" not in str(info.value) and "nothing was changed" in str(info.value)
    _assert_old(w)
    assert versions.begin(w, "add", {"path": "a"}).staged("image_cache") is not None


def test_a_commit_cut_off_after_its_journal_is_refused_to_readers_and_finished_by_the_next_writer(tmp_path,
                                                                                                  monkeypatch):
    w = _workdir(tmp_path)
    change = _change(w)

    def cut(point):
        if point == "replaced:entity_index":
            raise RuntimeError("cut off")

    monkeypatch.setattr(versions, "_at", cut)
    with pytest.raises(RuntimeError):
        change.commit({})
    with pytest.raises(CfirError, match="cut off before it finished") as info, versions.reading(w):
        pass
    assert "\n" not in str(info.value) and "index.py" in str(info.value)
    monkeypatch.setattr(versions, "_at", lambda point: None)
    with lock.hold(w, "test"):  # every writer finishes it when it takes the workdir
        pass
    _assert_new(w)
    with versions.reading(w) as version:
        assert version == 4
    assert not versions.recover(w)


# Runs a change in a process that SIGKILLs itself at the step named by $KILL_AT ("mid_replace": inside the rename of
# the image cache over the served one, after the old one was moved aside).
CRASHER = """
import os, signal, sys
from pathlib import Path
from cfir_jax.stores import atomic_write, versions

w, at = Path(sys.argv[1]), sys.argv[2]

def kill(point):
    if point == at:
        os.kill(os.getpid(), signal.SIGKILL)

def replace_dir(src, final):
    if at == "mid_replace" and Path(final).name == "image_cache":
        os.replace(final, atomic_write.temp_name(Path(final).with_name("image_cache.old")))
        os.kill(os.getpid(), signal.SIGKILL)
    atomic_write.replace_dir(src, final)

versions._at = kill
versions.replace_dir = replace_dir
change = versions.begin(w, "add", {"path": "a"})
for name in ("image_cache", "entity_index"):
    with change.stage(name) as tmp:
        tmp.joinpath("data.txt").write_text("new")
        tmp.joinpath("manifest.json").write_text("{}")
change.drop("sr_compact")
change.commit({"images": 2})
"""
BEFORE = ("staged:image_cache", "staged:entity_index", "locked")
AFTER = ("journal", "mid_replace", "replaced:image_cache", "replaced:entity_index", "index", "done")


@pytest.mark.parametrize("at", BEFORE + AFTER)
def test_a_writer_killed_at_any_step_leaves_a_servable_version(tmp_path, at):
    w = _workdir(tmp_path)
    proc = subprocess.run([sys.executable, "-c", CRASHER, str(w), at], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    if at in BEFORE:
        _assert_old(w)
        with versions.reading(w) as version:
            assert version == 3
        change = versions.begin(w, "add", {"path": "a"})  # the rerun of the same change
        assert change.staged("image_cache") is not None
        _change(w).commit({"images": 2})
    elif at == "done":  # whole already: readers open the new version; the next writer tidies up
        with versions.reading(w) as version:
            assert version == 4
        assert [p.name for p in (w / ".change").iterdir()] == ["change.json"]
        assert versions.begin(w, "add", {"path": "a"}).base_version == 4  # not resumed: that change is committed
        shutil.rmtree(w / ".change")
    else:
        with pytest.raises(CfirError, match="cut off"), versions.reading(w):
            pass
        assert versions.recover(w)
    _assert_new(w)
