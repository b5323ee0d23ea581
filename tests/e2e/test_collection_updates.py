"""A collection kept current through the commands: `index.py --add` equals a from-scratch build over the union (exact
backend), a SIGKILLed add resumes to the same stores, `--remove` takes images out of every answer, `--compact`
rewrites the stores without them, and each change is a version recorded in index.json."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import command_server
import numpy as np
import pytest
from repo import ROOT, run_script
from workdirs import index_collection

CONFIG = "configs/collection.py"
EXACT = "--config.index.entity_index.backend=exact"


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> dict[str, Path]:
    """The tiny world's example collection as make.py cuts it: a base of 3 documents with their images, the next
    day's batch (more/: the 4th document and its images, the way a user hands them over), and the union of both
    written in one go, base rows first."""
    out = tmp_path_factory.mktemp("split")
    source = out / "source"
    run_script("examples/collection/make.py", "--size", "tiny", "--documents", "3", "--out", str(source))
    paths = {"base": source, "addition": source / "more", "union": out / "union"}
    union = paths["union"]
    (union / "qrels").mkdir(parents=True)
    for name in ("documents.jsonl", "images.jsonl", "qrels/test.qrels"):
        lines = []
        for part in (paths["base"], paths["addition"]):
            for line in (part / name).read_text().splitlines():
                if name == "images.jsonl":  # paths relative to each part's file: absolute in the union
                    row = json.loads(line)
                    row["path"] = str((part / row["path"]).absolute())
                    line = json.dumps(row)
                lines.append(line)
        (union / name).write_text("".join(f"{line}\n" for line in lines))
    return paths


def _count(path: Path) -> int:
    return len(path.read_text().splitlines())


def _build(w: Path, model_workdir: Path, collection: Path) -> None:
    index_collection(w, CONFIG, model_workdir, collection, EXACT)


def _arrays(w: Path) -> dict[str, np.ndarray | list]:
    out = {}
    for store, name in [("entity_index", "offsets.npy"), ("entity_index", "candidates.npy"),
                        ("entity_index", "scores.npy"), ("image_cache", "embeddings.npy"),
                        ("entities", "offsets.npy"), ("entities", "entity_ids.npy")]:
        path = w / store / name
        if path.is_file():
            out[f"{store}/{name}"] = np.load(path)
    out["entity_index/vocab"] = json.loads((w / "entity_index" / "vocab.json").read_text())
    out["image_cache/ids"] = (w / "image_cache" / "ids.txt").read_text().split()
    out["corpus/doc_ids"] = (w / "corpus" / "doc_ids.txt").read_text().split()
    return out


def _assert_same_stores(a: Path, b: Path) -> None:
    left, right = _arrays(a), _arrays(b)
    assert left.keys() == right.keys()
    for key in left:
        if isinstance(left[key], np.ndarray):
            assert left[key].dtype == right[key].dtype and np.array_equal(left[key], right[key]), key
        else:
            assert left[key] == right[key], key


def _hits(w: Path, query: Path, *extra: str) -> list[str]:
    proc = run_script("retrieve.py", "--index", str(w), "--query", str(query), "--format", "json", "--top-k", "10",
                      *extra)
    return [h["image_id"] for h in json.loads(proc.stdout.strip().splitlines()[-1])["hits"]]


@pytest.fixture(scope="module")
def added(workdir, split, tmp_path_factory) -> Path:
    """The base built, then the addition added with `index.py --add`."""
    w = tmp_path_factory.mktemp("added") / "w"
    _build(w, workdir, split["base"])
    proc = run_script("index.py", "--workdir", str(w), "--add", str(split["addition"]))
    assert "version 2" in proc.stdout, proc.stdout
    return w


def test_an_add_equals_a_from_scratch_build_over_the_union_with_the_exact_backend(workdir, split, added, tmp_path):
    scratch = tmp_path / "scratch"
    _build(scratch, workdir, split["union"])
    _assert_same_stores(added, scratch)
    info = json.loads((added / "index.json").read_text())
    assert info["version"] == 2
    assert [h["op"] for h in info["history"]] == ["build", "add"]
    assert info["history"][-1]["changes"]["images_added"] == _count(split["addition"] / "images.jsonl") > 0
    assert info["history"][-1]["changes"]["documents_added"] == 1
    # A plain index.py run afterwards finds every store current: nothing is rebuilt.
    proc = run_script("index.py", "--workdir", str(added), "--config", CONFIG, f"--config.index.encoder={workdir}",
                      f"--config.index.corpus.documents={split['base'] / 'documents.jsonl'}",
                      f"--config.index.corpus.images={split['base'] / 'images.jsonl'}",
                      f"--config.index.corpus.qrels={split['base'] / 'qrels'}", EXACT, "--stages",
                      "image_cache,entities,summaries,entity_index")
    assert "index: every stage current, nothing to do" in proc.stdout, proc.stdout


def test_an_added_document_finds_its_added_images(split, added, tmp_path):
    first = json.loads((split["addition"] / "documents.jsonl").read_text().splitlines()[0])
    relevant = {line.split()[2] for line in (split["addition"] / "qrels" / "test.qrels").read_text().splitlines()
                if line.split()[0] == first["id"]}
    query = tmp_path / "query.txt"
    query.write_text(first["text"])
    assert relevant and relevant & set(_hits(added, query)), relevant


def _kill_when(proc: subprocess.Popen, path: Path, timeout: float = 300) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, "the add finished before it could be killed"
        assert time.time() - t0 < timeout
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_an_add_killed_mid_way_resumes_to_the_same_stores(workdir, split, added, tmp_path):
    """Killed once the corpus and the image cache are staged (the kill points of the commit itself are
    tests/unit/stores/test_versions.py's)."""
    w = tmp_path / "w"
    _build(w, workdir, split["base"])
    before = _arrays(w)
    proc = command_server.popen(["index.py", "--workdir", w, "--add", split["addition"]], dict(os.environ), ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _kill_when(proc, w / ".change" / "image_cache")
    # Killed with a change staged: the old version is whole and still answers.
    after_kill = _arrays(w)
    for key in before:
        assert np.array_equal(before[key], after_kill[key]) if isinstance(before[key], np.ndarray) \
            else before[key] == after_kill[key], key
    assert json.loads((w / "index.json").read_text())["version"] == 1
    again = run_script("index.py", "--workdir", str(w), "--add", str(split["addition"]))
    assert "corpus: staged by an earlier run, reused" in again.stdout, again.stdout
    assert "image_cache: staged by an earlier run, reused" in again.stdout, again.stdout
    _assert_same_stores(w, added)


def test_removed_images_are_never_returned_and_compact_drops_their_rows(split, added, tmp_path):
    w = tmp_path / "w"
    subprocess.run(["cp", "-a", str(added), str(w)], check=True)
    query = tmp_path / "query.txt"
    query.write_text(json.loads((split["addition"] / "documents.jsonl").read_text().splitlines()[0])["text"])
    methods = ("cfir", "entity_only", "dense_summary")  # every method and backend: tests/e2e/test_removed.py
    before = {m: _hits(w, query, "--method", m) for m in methods}
    gone = sorted({hits[0] for hits in before.values()})
    ids = tmp_path / "ids.txt"
    ids.write_text("".join(f"{i}\n" for i in gone))
    proc = run_script("index.py", "--workdir", str(w), "--remove", str(ids))
    assert "version 3" in proc.stdout, proc.stdout
    live = _count(split["union"] / "images.jsonl") - len(gone)
    after = {m: _hits(w, query, "--method", m) for m in methods}
    for m, hits in after.items():
        assert not set(hits) & set(gone), (m, hits, gone)
    # The exact whole-cache search: still a full top 10 of the live images, in the order it had.
    survivors = [h for h in before["dense_summary"] if h not in gone]
    assert len(after["dense_summary"]) == min(10, live)
    assert after["dense_summary"][: len(survivors)] == survivors
    k = json.loads((w / "entity_index" / "manifest.json").read_text())["k"]
    lengths = np.diff(np.load(w / "entity_index" / "offsets.npy"))
    assert (lengths == min(k, live)).all(), lengths  # every list refilled to K from the next best

    proc = run_script("index.py", "--workdir", str(w), "--compact")
    assert "version 4" in proc.stdout, proc.stdout
    ids_left = (w / "image_cache" / "ids.txt").read_text().split()
    assert len(ids_left) == live and not set(ids_left) & set(gone)
    for m in ("cfir", "dense_summary"):
        assert not set(_hits(w, query, "--method", m)) & set(gone), m
    info = json.loads((w / "index.json").read_text())
    assert [h["op"] for h in info["history"]] == ["build", "add", "remove", "compact"]


def test_a_malformed_added_row_is_one_line_naming_its_file_and_line(added, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "documents.jsonl").write_text('{"id": "new1", "text": "A fine text."}\n{"id": "new2"}\n')
    proc = run_script("index.py", "--workdir", str(added), "--add", str(bad), check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and f"{bad / 'documents.jsonl'}:2" in lines[0], proc.stderr
    duplicate = tmp_path / "dup.jsonl"
    first = (added / "image_cache" / "ids.txt").read_text().split()[0]
    duplicate.write_text(json.dumps({"id": first, "path": "x.png"}) + "\n")
    proc = run_script("index.py", "--workdir", str(added), "--add", str(duplicate), check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and f"{duplicate}:1" in lines[0] and first in lines[0]
    assert json.loads((added / "index.json").read_text())["version"] == 2  # nothing changed
