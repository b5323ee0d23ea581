"""index.json's version after a build (cfir_jax.builders.rebuild.record_index): 1 after a first build, + 1 when a
rebuild built anything, kept when every stage was reused; the history of changes is kept."""

import json

from cfir_jax.builders import descriptor
from cfir_jax.builders.rebuild import record_index as _record_index
from cfir_jax.builders.stage_report import StageReport
from cfir_jax.stores.layout import Layout


def _reports(layout: Layout, reused: bool) -> list[StageReport]:
    return [StageReport("corpus", "3 docs", 0.1, layout.corpus, reused=True),
            StageReport("image_cache", "5 x 64", 0.2, layout.image_cache, reused=reused),
            StageReport("entity_index", "-", 0.0, layout.entity_index, stale_because="image_cache rebuilt")]


def test_builds_number_the_versions_and_keep_the_history(tmp_path, config):
    layout = Layout.of(tmp_path)
    _record_index(config, layout, _reports(layout, reused=False))
    first = json.loads(layout.index_json.read_text())
    assert first["version"] == 1 and [h["op"] for h in first["history"]] == ["build"]
    assert first["history"][0]["changes"] == {"stages": ["image_cache"]} and "stages" in first and "config" in first
    _record_index(config, layout, _reports(layout, reused=True))  # nothing built: the same version
    assert json.loads(layout.index_json.read_text())["history"] == first["history"]
    info = json.loads(layout.index_json.read_text())
    layout.index_json.write_text(json.dumps({**info, "version": 4, "history": [*info["history"], {"version": 4}]}))
    _record_index(config, layout, _reports(layout, reused=False))
    again = json.loads(layout.index_json.read_text())
    assert again["version"] == 5 and [h["version"] for h in again["history"]] == [1, 4, 5]


def _store(path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "data.txt").write_text(text)
    (path / "manifest.json").write_text(json.dumps({"text": text}))


def test_a_rebuild_is_staged_beside_the_served_stores_and_committed_as_one_version(tmp_path, config):
    from cfir_jax.builders import rebuild
    from cfir_jax.stores import versions
    from cfir_jax.stores.contract import atomic_dir

    layout = Layout.of(tmp_path / "w")
    _store(layout.corpus, "corpus v1")
    _store(layout.image_cache, "cache v1")
    rebuild.record_index(config, layout, _reports(layout, reused=False))
    corpus_inode = (layout.corpus / "data.txt").stat().st_ino
    staged = rebuild.staged_layout(layout)
    assert staged.root == layout.root / ".change" and (staged.corpus / "data.txt").stat().st_ino == corpus_inode
    with atomic_dir(staged.image_cache) as tmp:  # a stage rebuilding its store writes the staged one
        _store(tmp, "cache v2")
    assert (layout.image_cache / "data.txt").read_text() == "cache v1"  # readers still open version 1
    with versions.reading(layout) as version:
        assert version == 1
    reports = [StageReport("corpus", "3 docs", 0.1, staged.corpus, reused=True),
               StageReport("image_cache", "5 x 64", 0.2, staged.image_cache)]
    reports = rebuild.record(config, layout, staged, reports)
    assert (layout.image_cache / "data.txt").read_text() == "cache v2" and not (layout.root / ".change").exists()
    assert (layout.corpus / "data.txt").stat().st_ino == corpus_inode  # untouched, not swapped for its own link
    info = json.loads(layout.index_json.read_text())
    assert info["version"] == 2 and info["history"][-1]["op"] == "build"
    assert info["history"][-1]["changes"] == {"stages": ["image_cache"]}
    assert [s["path"] for s in info["stages"]] == ["corpus", "image_cache"] and "config" in info
    assert [r.path for r in reports] == [layout.corpus, layout.image_cache]
    staged = rebuild.staged_layout(layout)  # a rebuild that finds every store current
    rebuild.record(config, layout, staged, [StageReport("corpus", "3 docs", 0.1, staged.corpus, reused=True)])
    assert json.loads(layout.index_json.read_text())["version"] == 2 and not (layout.root / ".change").exists()


def test_a_rebuild_links_every_stage_the_runner_builds():
    """A store a stage writes but a rebuild does not link into W/.change is built anew on every rerun."""
    assert set(descriptor.stages()) <= set(descriptor.linked())


class _Killed(BaseException):
    """A kill arriving mid-removal (SIGKILL, as a Python exception: nothing after it runs)."""


def _rebuild_staged(tmp_path, config):
    """A built workdir (corpus and image cache at version 1), a rebuild staged in W/.change with the image cache
    rebuilt there: (layout, staged layout, reports, the live corpus's files)."""
    from cfir_jax.builders import rebuild
    from cfir_jax.stores.contract import atomic_dir

    layout = Layout.of(tmp_path / "w")
    _store(layout.corpus, "corpus v1")
    _store(layout.image_cache, "cache v1")
    rebuild.record_index(config, layout, _reports(layout, reused=False))
    staged = rebuild.staged_layout(layout)
    with atomic_dir(staged.image_cache) as tmp:
        _store(tmp, "cache v2")
    reports = [StageReport("corpus", "3 docs", 0.1, staged.corpus, reused=True),
               StageReport("image_cache", "5 x 64", 0.2, staged.image_cache)]
    return layout, staged, reports, {p.name: p.stat().st_ino for p in layout.corpus.iterdir()}


def _fail_on(monkeypatch, name: str, error: BaseException) -> None:
    """os.unlink removes every file but `name`, for which it raises `error` (after removing it for a kill)."""
    import os

    real = os.unlink

    def unlink(path, *args, **kwargs):
        if os.fsdecode(path).endswith(name):
            if isinstance(error, _Killed):
                real(path, *args, **kwargs)
            raise error
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)


def test_an_error_removing_a_staged_link_is_raised_and_never_commits_a_partial_store(tmp_path, config, monkeypatch):
    """An unchanged store's link in W/.change is renamed aside before it is deleted: an error deleting it (an NFS
    silly-rename: EBUSY) is raised, and the live store stays whole; the rerun commits the rebuild."""
    import errno

    import pytest

    from cfir_jax.builders import rebuild

    layout, staged, reports, corpus = _rebuild_staged(tmp_path, config)
    with monkeypatch.context() as m:
        _fail_on(m, "data.txt", OSError(errno.EBUSY, "Device or resource busy"))
        with pytest.raises(OSError, match="busy"):
            rebuild.record(config, layout, staged, reports)
    assert {p.name: p.stat().st_ino for p in layout.corpus.iterdir()} == corpus  # whole, never swapped
    assert (layout.image_cache / "data.txt").read_text() == "cache v1"
    staged = rebuild.staged_layout(layout)  # the rerun: the link is made again, the rebuild committed
    rebuild.record(config, layout, staged, reports)
    assert {p.name: p.stat().st_ino for p in layout.corpus.iterdir()} == corpus
    assert (layout.image_cache / "data.txt").read_text() == "cache v2"
    assert json.loads(layout.index_json.read_text())["version"] == 2


def test_a_kill_while_removing_a_staged_link_leaves_nothing_partial_for_the_rerun(tmp_path, config, monkeypatch):
    """A kill in the middle of deleting an unchanged store's link: the rerun finds no partial copy under the store's
    name in W/.change (it was renamed aside first), links the store again and commits the whole of it."""
    import pytest

    from cfir_jax.builders import rebuild

    layout, staged, reports, corpus = _rebuild_staged(tmp_path, config)
    with monkeypatch.context() as m:
        _fail_on(m, "data.txt", _Killed())
        with pytest.raises(_Killed):
            rebuild.record(config, layout, staged, reports)
    assert not staged.corpus.exists() or {p.name for p in staged.corpus.iterdir()} == set(corpus)
    staged = rebuild.staged_layout(layout)
    rebuild.record(config, layout, staged, reports)
    assert {p.name: p.stat().st_ino for p in layout.corpus.iterdir()} == corpus  # whole: both files, the same inodes
    assert (layout.image_cache / "data.txt").read_text() == "cache v2"
