"""The whole pipeline on the tiny synthetic world: index.py -> train.py -> retrieve.py, and retrieval semantics."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from cfir_jax.cli import load_config_file
from cfir_jax.retrieval import DocumentInput, Retriever
from conftest import ROOT

CONFIG = "configs/demo.py:tiny"


def _run(*args, check=True, env=None):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


# The first build's output, kept for the tests of what a user sees (progress bars forced on: stderr is no TTY).
FIRST_RUN: dict[str, subprocess.CompletedProcess] = {}


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """A tiny world indexed and trained once for the whole session."""
    w = tmp_path_factory.mktemp("demo")
    FIRST_RUN["index"] = _run("index.py", "--config", CONFIG, "--workdir", str(w), env={"CFIR_PROGRESS": "1"})
    FIRST_RUN["train"] = _run("train.py", "--config", CONFIG, "--workdir", str(w), "-v", env={"CFIR_PROGRESS": "1"})
    return w


@pytest.fixture(scope="session")
def config():
    return load_config_file(str(ROOT / "configs/demo.py") + ":tiny")


def test_index_rerun_skips_every_stage_and_says_so(workdir):
    before = {p: p.stat().st_mtime_ns for p in workdir.rglob("manifest.json")}
    proc = _run("index.py", "--config", CONFIG, "--workdir", str(workdir))
    after = {p: p.stat().st_mtime_ns for p in workdir.rglob("manifest.json")}
    assert before == after, "a complete, current store was rebuilt"
    assert "entity_index" in proc.stdout and "on disk" in proc.stdout  # the closing table
    assert proc.stdout.rstrip().endswith("index: every stage current, nothing to do")
    assert " 0.0 s" not in proc.stdout and proc.stdout.count("reused") >= 6
    assert "nothing to do" not in FIRST_RUN["index"].stdout  # the first build did the work


def test_train_rerun_says_it_was_already_trained(workdir):
    proc = _run("train.py", "--config", CONFIG, "--workdir", str(workdir))
    assert "train: already trained to step 20" in proc.stdout
    final = [line for line in proc.stdout.splitlines() if line.startswith("final: ")]
    assert final and "loss=" in final[0]  # the last logged metrics, not an empty line
    assert "already trained" not in FIRST_RUN["train"].stdout


def test_every_long_stage_shows_a_progress_bar_with_rate(workdir):
    """tqdm bars (forced on by CFIR_PROGRESS=1, since a captured stderr is no terminal) finish at 100% with a rate:
    world generation, spaCy, summaries, caption pretraining and training (with the loss)."""
    index, train = FIRST_RUN["index"].stderr, FIRST_RUN["train"].stderr
    for desc, unit in (("world: images", "img"), ("world: documents", "doc"), ("entities", "doc"),
                       ("summaries", "doc"), ("caption pretraining", "step")):
        assert re.search(rf"{re.escape(desc)}: 100%.*\d+/\d+ \[[\d:]+<[\d:]+, +[\d.]+ ?(s/)?{unit}", index), desc
    assert re.search(r"train: 100%.* 20/20 \[.*step.*loss=", train), train[-2000:]


def test_verbose_training_log_is_not_library_chatter(workdir):
    """-v shows this project's logs; orbax/absl INFO lines (~150 per run before) stay out unless -vv."""
    lines = [line for line in FIRST_RUN["train"].stderr.replace("\r", "\n").splitlines()
             if line.strip() and "train:" not in line]
    assert not [line for line in lines if "orbax" in line.lower() or "checkpoint" in line.lower()], lines[:20]


def test_cfir_equals_brute_force_over_the_candidate_union(workdir, config):
    r = Retriever(config, workdir)
    docs = r.corpus_documents("test")[:3]
    results = r.retrieve_many(docs)
    for doc, res in zip(docs, results):
        rows = [r.entity_index.row(e) for e in doc.entities if r.entity_index.row(e) is not None]
        assert rows, "tiny world documents all have indexed entities"
        union = np.unique(r.entity_index.candidates(np.asarray(rows)).ravel())
        query = r.query_encoder.encode([doc.summary])[0]
        scores = np.asarray(r.embeddings[union], np.float32) @ query
        order = np.argsort(-scores, kind="stable")[: config.retrieval.top_k]
        assert [h.row for h in res.hits] == union[order].tolist()
        np.testing.assert_allclose([h.score for h in res.hits], scores[order], rtol=1e-5, atol=1e-6)
        assert all(h.entities for h in res.hits)  # every hit was brought in by some entity


def test_planted_image_comes_first(workdir, config):
    """A summary embedding equal to one candidate image's embedding must retrieve that image first."""
    r = Retriever(config, workdir)
    doc = r.corpus_documents("test")[0]
    row = r.entity_index.row(doc.entities[0])
    planted = int(r.entity_index.candidates([row])[0, -1])  # its entity's *last* candidate
    target = np.asarray(r.embeddings[planted], np.float32)
    r.query_encoder.encode = lambda texts: np.repeat(target[None] / np.linalg.norm(target), len(texts), 0)
    res = r.retrieve(doc)
    assert res.hits[0].row == planted


def test_unknown_entities_are_searched_or_ignored(workdir, config):
    r = Retriever(config, workdir)
    doc = r.corpus_documents("test")[0]
    unseen = DocumentInput(doc.text, "q", entities=["Zanzibar Quokka Society"], summary=doc.summary)
    res = r.retrieve(unseen)
    assert res.unknown_entities == ["Zanzibar Quokka Society"]
    assert res.hits and all(h.entities == ("Zanzibar Quokka Society",) for h in res.hits)
    emb = r.entity_encoder.encode(["Zanzibar Quokka Society"])[0]
    want = set(np.argsort(-(np.asarray(r.embeddings, np.float32) @ emb))[: r.entity_index.k].tolist())
    assert {h.row for h in res.hits} == want  # exactly its exact top-K, re-ranked by the summary
    config_ignore = config.copy_and_resolve_references()
    config_ignore.retrieval.unknown_entities = "ignore"
    res = Retriever(config_ignore, workdir).retrieve(unseen)
    assert "no usable entity" in res.note


def test_document_without_entities_falls_back_to_full_search(workdir, config):
    r = Retriever(config, workdir)
    res = r.retrieve(DocumentInput("the cat sat on the mat and then it slept all day long.", "q"))
    assert res.entities == [] and "whole cache" in res.note
    query = r.query_encoder.encode([res.summary])[0]
    scores = np.asarray(r.embeddings, np.float32) @ query
    assert [h.row for h in res.hits[:10]] == np.argsort(-scores, kind="stable")[:10].tolist()


def test_query_encoding_never_recompiles(workdir, config):
    r = Retriever(config, workdir)
    for text in ("Short one.", "A much longer document " * 40, "Mid length text about Jeffrey Baker."):
        r.retrieve(text)
    assert r.query_encoder._encode._cache_size() == 1


def test_retrieve_cli_formats_and_run_file(workdir, tmp_path):
    doc = tmp_path / "doc.txt"
    r = Retriever(load_config_file(str(ROOT / "configs/demo.py") + ":tiny"), workdir)
    doc.write_text(r.corpus_documents("test")[0].text)
    proc = _run("retrieve.py", "--index", str(workdir), "--query", str(doc), "--top-k", "3", "--format", "json",
                "--html", str(tmp_path / "out.html"))
    record = json.loads(proc.stdout.splitlines()[0])
    assert len(record["hits"]) == 3 and record["entities"]
    page = (tmp_path / "out.html").read_text()
    assert page.count('<img src="data:image/png;base64,') == 3 and "synthetic.invalid" not in page
    queries = tmp_path / "q.jsonl"
    docs = r.corpus_documents("test")
    queries.write_text("".join(json.dumps({"id": d.doc_id, "text": d.text}) + "\n" for d in docs))
    qrels = tmp_path / "qrels.txt"
    qrels.write_text((workdir / "corpus" / "qrels" / "test.txt").read_text())
    proc = _run("retrieve.py", "--index", str(workdir), "--queries", str(queries), "--output",
                str(tmp_path / "run.trec"), "--qrels", str(qrels))
    from cfir_jax import metrics, trec

    want = metrics.evaluate(trec.read_run(tmp_path / "run.trec"), trec.read_qrels(qrels))
    assert f"{want.aggregate['mrr@10']:.4f}" in proc.stdout


def test_every_format_shows_the_same_default_number_of_hits(workdir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(Retriever(load_config_file(str(ROOT / "configs/demo.py") + ":tiny"), workdir)
                   .corpus_documents("test")[0].text)
    base = ("retrieve.py", "--index", str(workdir), "--query", str(doc), "--format")
    table = _run(*base, "table").stdout
    hits = {
        "table": len(re.findall(r"^\d+ +img\d+ ", table, flags=re.M)),
        "json": len(json.loads(_run(*base, "json").stdout)["hits"]),
        "trec": len(_run(*base, "trec").stdout.strip().splitlines()),
    }
    assert set(hits.values()) == {20}, hits  # retrieve.SHOWN; the tiny config's retrieval.top_k is 100


def test_evaluate_plot_draws_recall_curves(workdir, tmp_path):
    from PIL import Image as PILImage

    out = tmp_path / "curves.png"
    proc = _run("retrieve.py", "--index", str(workdir), "--evaluate", "test", "--plot", str(out))
    assert "cfir" in proc.stdout and f"wrote {out}" in proc.stderr
    with PILImage.open(out) as im:
        assert im.format == "PNG" and im.width > 400 and len(set(im.convert("RGB").getdata())) > 20


@pytest.mark.parametrize("case", ["missing", "empty", "binary", "huge", "whitespace"])
def test_bad_query_files_are_one_line_errors(workdir, tmp_path, case):
    path = tmp_path / "q.txt"
    if case == "empty":
        path.write_text("")
    elif case == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" * 100)
    elif case == "huge":
        path.write_bytes(b"word " * (50 * 2**20 // 5))
    elif case == "whitespace":
        path.write_text("  \n\t ")
    proc = _run("retrieve.py", "--index", str(workdir), "--query", str(path), check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_bad_index_and_flags_are_one_line_errors(workdir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Jeffrey Baker visited the pier.")
    missing = _run("retrieve.py", "--index", str(tmp_path / "nope"), "--query", str(doc), check=False)
    incomplete_dir = tmp_path / "incomplete"
    incomplete_dir.mkdir()
    incomplete = _run("retrieve.py", "--index", str(incomplete_dir), "--query", str(doc), check=False)
    fmt = _run("retrieve.py", "--index", str(workdir), "--query", str(doc), "--format", "xml", check=False)
    zero = _run("retrieve.py", "--index", str(workdir), "--query", str(doc), "--top-k", "0", check=False)
    negative = _run("retrieve.py", "--index", str(workdir), "--query", str(doc), "--top-k", "-5", check=False)
    plot = _run("retrieve.py", "--index", str(workdir), "--query", str(doc), "--plot", "x.png", check=False)
    for proc, words in ((missing, "no index here"), (incomplete, "incomplete index"), (fmt, "unknown format"),
                        (zero, "--top-k must be at least 1"), (negative, "--top-k must be at least 1"),
                        (plot, "add --evaluate")):
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr


def test_index_built_by_another_model_is_refused(workdir, tmp_path, config):
    """Swap in an entity index whose manifest names another encoder: retrieval refuses with one line."""
    import shutil

    other = tmp_path / "w"
    shutil.copytree(workdir, other)
    manifest = json.loads((other / "entity_index" / "manifest.json").read_text())
    manifest["model_fingerprint"] = "text-0000000000000000"
    (other / "entity_index" / "manifest.json").write_text(json.dumps(manifest))
    doc = tmp_path / "doc.txt"
    doc.write_text("Jeffrey Baker visited the pier.")
    proc = _run("retrieve.py", "--index", str(other), "--query", str(doc), check=False)
    assert proc.returncode == 2 and "model_fingerprint" in proc.stderr and proc.stderr.count("\n") == 1
