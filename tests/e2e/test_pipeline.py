"""The whole pipeline on the tiny synthetic world: index.py -> train.py -> retrieve.py, and retrieval semantics."""

import json
import re

import numpy as np
import pytest
from repo import FIRST_RUN
from repo import run_script as _run

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.pipeline import DocumentInput, Retriever
from cfir_jax.search.topk import exact_topk

CONFIG = "configs/demo.py:tiny"


@pytest.fixture(scope="module")
def retriever(workdir, config):
    """One Retriever over the session's workdir, for the tests that only read from it (opening one loads the model
    and spaCy and compiles its encoders); a test that changes a retriever's parts opens its own."""
    return Retriever(config, workdir)


@pytest.fixture(scope="module")
def evaluated(workdir):
    """`retrieve.py --index W --evaluate test` on the session's workdir, run once for the tests that read its table."""
    return _run("retrieve.py", "--index", str(workdir), "--evaluate", "test")


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


def test_cfir_equals_brute_force_over_the_candidate_union(retriever, config):
    r = retriever
    docs = r.corpus_documents("test")[:3]
    results = r.retrieve_many(docs)
    for doc, res in zip(docs, results):
        rows = [r.entity_index.row(e) for e in doc.entities if r.entity_index.row(e) is not None]
        unknown = [e for e in doc.entities if r.entity_index.row(e) is None]
        assert rows or unknown, "tiny world documents all have entities"
        lists = r.entity_index.candidates(np.asarray(rows)) if rows else []
        if unknown:  # searched at query time: their exact top-K over the cache (the demo index is exact)
            lists += list(exact_topk(r.entity_encoder.encode(unknown), r.embeddings, r.entity_index.k)[1])
        union = np.unique(np.concatenate(lists))
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
    row = next(r.entity_index.row(e) for e in doc.entities if r.entity_index.row(e) is not None)
    planted = int(r.entity_index.candidates([row])[0][-1])  # its entity's *last* candidate
    target = np.asarray(r.embeddings[planted], np.float32)
    r.query_encoder.encode = lambda texts: np.repeat(target[None] / np.linalg.norm(target), len(texts), 0)
    res = r.retrieve(doc)
    assert res.hits[0].row == planted


def test_unknown_entities_are_searched_or_ignored(workdir, config, retriever):
    r = retriever
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


def test_scann_answers_shorter_than_k_never_reach_retrieval(workdir, tmp_path):
    """ScaNN searching 1 of 2 leaves finds ~60 of the 120 images for K=100: lists are short, never padded."""
    import shutil

    w = tmp_path / "W"
    shutil.copytree(workdir, w)
    starved = ["--config.index.entity_index.backend=scann", "--config.index.entity_index.k=100",
               "--config.index.entity_index.num_leaves=2", "--config.index.entity_index.num_leaves_to_search=1",
               "--config.index.entity_index.min_rows_for_tree=1"]
    _run("index.py", "--config", CONFIG, "--workdir", str(w), "--stages", "entity_index", *starved)
    for method in ("cfir", "entity_only"):  # before the fix: SR aborted on id -1, entity_only showed a wrong image
        proc = _run("retrieve.py", "--index", str(w), "--evaluate", "test", "--method", method)
        assert "MRR@10" in proc.stdout
    config = json.loads((w / "index.json").read_text())["config"]
    import ml_collections

    r = Retriever(ml_collections.ConfigDict(config), w, method="entity_only")
    lengths = r.entity_index.lengths
    assert lengths.min() < 100, "the test needs ScaNN to return fewer than K"
    doc = r.corpus_documents("test")[0]
    unseen = DocumentInput(doc.text, "q", entities=["Zanzibar Quokka Society", *doc.entities], summary=doc.summary)
    res = r.retrieve(unseen)
    assert "Zanzibar Quokka Society" in res.unknown_entities
    lists, _, _, _ = r.entities.candidates(unseen.entities, r.stores.live, False)
    for lst in lists:  # a list may be empty (ScaNN's unseeded k-means can leave a leaf empty), never padded
        assert np.all(lst >= 0) and len(np.unique(lst)) == len(lst)
    union = set(np.concatenate(lists).tolist())
    assert res.hits and all(h.row in union and h.entities for h in res.hits)


def test_entity_index_holds_the_train_documents_entities_and_unknown_ones_are_counted(workdir, retriever, evaluated):
    """The paper's protocol: the index is built from the train split's entities; test entities it never saw are
    unknown, and the evaluation says how many."""
    from cfir_jax.stores.entities import EntityStore, entity_key

    r = retriever
    store = EntityStore.open(workdir / "entities")
    train, test = r.corpus.qrels("train"), r.corpus.qrels("test")
    train_keys = {entity_key(e) for i, d in enumerate(store.doc_ids) if d in train for e in store.entities_of(i)}
    assert {entity_key(t) for t in r.entity_index.vocab} == train_keys
    test_entities = [e for i, d in enumerate(store.doc_ids) if d in test for e in store.entities_of(i)]
    unknown = sum(entity_key(e) not in train_keys for e in test_entities)
    assert unknown > 0, "the tiny world has test entities no train document mentions"
    proc = evaluated
    assert f"unknown query entities: {unknown:,} of {len(test_entities):,}" in proc.stdout
    assert "searched over the cache" in proc.stdout
    docs = r.corpus_documents("test")
    doc = next(d for d in docs if any(entity_key(e) not in train_keys for e in d.entities))
    record = r.retrieve(doc)
    assert record.unknown_entities and all(entity_key(e) not in train_keys for e in record.unknown_entities)


def test_stale_compact_copy_is_rebuilt_when_the_cache_changes(workdir, config, tmp_path):
    """Another cache of the same shape (e.g. re-encoded at 384 px) must not be scored with the old int8 codes."""
    import shutil

    from cfir_jax.search.compact import CompactCache

    w = tmp_path / "W"
    shutil.copytree(workdir, w)
    first = Retriever(config, w, method="dense_summary")
    first.sr_scorer()
    old = CompactCache.open(w / "sr_compact", expect_cache=first.cache.content_fingerprint)
    old_codes = np.array(old.codes)
    manifest = json.loads((w / "image_cache" / "manifest.json").read_text())
    emb = np.load(w / "image_cache" / "embeddings.npy")
    rng = np.random.default_rng(1)
    new = rng.standard_normal(emb.shape).astype(np.float32)
    np.save(w / "image_cache" / "embeddings.npy", (new / np.linalg.norm(new, axis=1, keepdims=True)).astype(emb.dtype))
    manifest.update(fingerprint="precomputed:another-model", created="later")
    (w / "image_cache" / "manifest.json").write_text(json.dumps(manifest))
    second = Retriever(config, w, method="dense_summary")
    assert second.cache.content_fingerprint != first.cache.content_fingerprint
    second.sr_scorer()
    rebuilt = CompactCache.open(w / "sr_compact", expect_cache=second.cache.content_fingerprint)
    assert not np.array_equal(np.array(rebuilt.codes), old_codes)
    with pytest.raises(CfirError, match="stale.*cache_fingerprint.*index.py"):  # the entity index is derived too
        Retriever(config, w, method="cfir")


def test_entities_and_summaries_of_other_documents_are_refused_then_rebuilt(workdir, config, tmp_path):
    """Same number of documents, other content: the stores are stale, retrieval refuses them, index.py rebuilds."""
    import shutil

    w = tmp_path / "W"
    shutil.copytree(workdir, w)
    manifest = json.loads((w / "corpus" / "manifest.json").read_text())
    (w / "corpus" / "manifest.json").write_text(json.dumps(manifest | {"documents_sha": "0" * 16}))
    for method, store in (("entity_only", "entities"), ("dense_summary", "summaries")):
        with pytest.raises(CfirError, match=f"{store}: stale, derived from corpus_fingerprint") as e:
            Retriever(config, w, method=method).corpus_documents("test")
        assert "\n" not in str(e.value)
    before = {s: (w / s / "manifest.json").stat().st_mtime_ns for s in ("entities", "summaries")}
    _run("index.py", "--config", CONFIG, "--workdir", str(w), "--stages", "entities,summaries")
    for s in ("entities", "summaries"):
        assert (w / s / "manifest.json").stat().st_mtime_ns != before[s], f"{s} was not rebuilt"
        assert json.loads((w / s / "manifest.json").read_text())["corpus_fingerprint"] == "docs-" + "0" * 16
    Retriever(config, w, method="cfir").corpus_documents("test")  # current again


def test_document_without_entities_falls_back_to_full_search(retriever):
    r = retriever
    res = r.retrieve(DocumentInput("the cat sat on the mat and then it slept on the warm rug.", "q"))
    assert res.entities == [] and "whole cache" in res.note
    query = r.query_encoder.encode([res.summary])[0]
    scores = np.asarray(r.embeddings, np.float32) @ query
    assert [h.row for h in res.hits[:10]] == np.argsort(-scores, kind="stable")[:10].tolist()


def test_text_length_over_the_model_positions_is_refused_at_configuration(workdir, config):
    """The tiny model has 512 text positions, 510 usable: longer texts are refused when the retriever or the trainer
    is configured, in one line naming both numbers and the override, not by a traceback from the first batch."""
    too_long = config.copy_and_resolve_references()
    too_long.retrieval.max_text_len = 600
    with pytest.raises(CfirError, match=r"retrieval\.max_text_len=600 .* 510 .*--config\.retrieval\.max_text_len=510"):
        Retriever(too_long, workdir)
    proc = _run("train.py", "--config", CONFIG, "--workdir", str(workdir), "--config.train.max_text_len=511",
                check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "train.max_text_len=511" in proc.stderr and "--config.train.max_text_len=510" in proc.stderr


def test_compact_copy_is_built_before_the_first_query_and_timings_are_separate(workdir, config, tmp_path):
    """The fast scorer's compact copy exists once the Retriever is constructed (its build is never inside a query's
    timing), and SR is timed apart from the candidate lists and from the per-hit entity bookkeeping."""
    import shutil

    w = tmp_path / "w"
    shutil.copytree(workdir, w, ignore=shutil.ignore_patterns("sr_compact", "train"))
    fast = config.copy_and_resolve_references()
    fast.retrieval.sr = "fast"
    r = Retriever(fast, w)
    manifest = w / "sr_compact" / "manifest.json"
    assert manifest.is_file()
    built = manifest.stat().st_mtime_ns
    res = r.retrieve(r.corpus_documents("test")[0])
    assert manifest.stat().st_mtime_ns == built
    assert {"er", "score", "hits"} <= set(res.times_ms) and "rank" not in res.times_ms
    assert all(res.times_ms[k] >= 0 for k in ("er", "score", "hits"))


def test_exact_sr_equals_brute_force_and_fast_sr_reports_its_agreement(workdir, config):
    """retrieval.sr='exact' is the paper's SR over the whole union; the fast path with a 5-candidate shortlist can
    miss, and the agreement it reports is its measured top-k overlap with exact scoring."""
    cfg = config.copy_and_resolve_references()
    cfg.retrieval.update(top_k=5, sr_shortlist=5, sr="exact")
    exact = Retriever(cfg, workdir)
    docs = exact.corpus_documents("test")[:6]
    cfg.retrieval.sr = "fast"
    fast = Retriever(cfg, workdir, measure_agreement=True)
    for doc, e, f in zip(docs, exact.retrieve_many(docs), fast.retrieve_many(docs)):
        # known entities' lists and unseen ones' searches
        lists, _, _, _ = exact.entities.candidates(doc.entities, exact.stores.live, False)
        union = np.unique(np.concatenate(lists))
        scores = np.asarray(exact.embeddings[union], np.float32) @ exact.query_encoder.encode([doc.summary])[0]
        want = union[np.argsort(-scores, kind="stable")[:5]].tolist()
        assert [h.row for h in e.hits] == want and e.sr_agreement is None
        assert f.sr_agreement == len({h.row for h in f.hits} & set(want)) / 5


def test_evaluate_is_exact_by_default_and_states_fast_agreement(workdir, evaluated):
    exact = evaluated
    assert "SR: exact" in exact.stdout
    fast = _run("retrieve.py", "--index", str(workdir), "--evaluate", "test", "--config.retrieval.eval_sr=fast")
    assert "SR: fast" in fast.stdout and "agreement with exact scoring on these" in fast.stdout


def test_compare_rows_mirror_table3_and_name_their_models(workdir):
    """Table 3's rows, each with MRR@10, R@1000, ms/query, and the model it used; without a document-trained model
    the document row says it used the summary-trained one at the model's full text length."""
    proc = _run("retrieve.py", "--index", str(workdir), "--evaluate", "test", "--compare")
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("row "))
    assert {"MRR@10", "R@1000", "ms/query", "model"} <= set(lines[head].split())
    body = lines[head + 2 : head + 7]
    labels = ("document only", "entities only", "summary only", "entities + document", "full CFIR")
    assert [line[: len(lab)] for line, lab in zip(body, labels)] == list(labels)
    assert body[0].rstrip().endswith("summary-trained, 510 tokens")
    assert body[1].rstrip().endswith("frozen index encoder, 16 tokens")
    assert all(line.rstrip().endswith("summary-trained, 64 tokens") for line in (body[2], body[3], body[4]))


@pytest.mark.parametrize("backend", ["cpu", "device"])
def test_fused_sr_equals_numpy_over_the_retrievers_own_union(workdir, config, backend, retriever):
    """retrieval.fusion: each hit's score is w_img * <q, image> + w_txt * <q, image text> over the very
    union the retriever built, in numpy's order; images without text add nothing; fast SR on the CPU scores through
    a compact copy of the fused rows, made from (and recording) both stores."""
    from cfir_jax.stores.image_text import ImageTextCache

    cfg = config.copy_and_resolve_references()
    cfg.retrieval.update(top_k=15, sr="fast", sr_backend=backend, fusion=dict(w_img=1.0, w_txt=0.75,
                                                                             compare_w_txt=0))
    r = Retriever(cfg, workdir)
    assert r.fused and r.sr_mode == "fast"
    if backend == "cpu":
        source = json.loads((workdir / "sr_compact_fused" / "manifest.json").read_text())["cache_fingerprint"]
        assert source.startswith(r.cache.content_fingerprint + "+text-")
    text = ImageTextCache.open(workdir / "image_text")
    assert 0 < text.has_text.sum() < len(text.has_text)
    docs = r.corpus_documents("test")
    for doc, res in zip(docs, r.retrieve_many(docs)):
        lists, _, _, _ = r.entities.candidates(doc.entities, r.stores.live, False)
        union = np.unique(np.concatenate(lists))
        q = r.query_encoder.encode([doc.summary])[0]
        s = (np.asarray(r.embeddings[union], np.float32) @ q
             + 0.75 * (np.asarray(text.embeddings[union], np.float32) @ q))
        order = np.lexsort((union, -s))[:15]
        assert [h.row for h in res.hits] == union[order].tolist()
        np.testing.assert_allclose([h.score for h in res.hits], s[order], rtol=1e-5, atol=1e-6)
    plain = retriever
    assert not plain.fused and plain.retrieve_many(docs[:3])[0].hits != r.retrieve_many(docs[:3])[0].hits


def test_fusion_without_an_image_text_store_is_refused_in_one_line(workdir, config, tmp_path):
    for store in workdir.iterdir():  # the same index, without W/image_text
        if store.name != "image_text":
            (tmp_path / store.name).symlink_to(store)
    cfg = config.copy_and_resolve_references()
    cfg.retrieval.fusion.w_txt = 0.5
    with pytest.raises(CfirError, match="no image_text store here") as e:
        Retriever(cfg, tmp_path)
    assert "\n" not in str(e.value)
    cfg.retrieval.fusion.w_txt = 0.0
    assert not Retriever(cfg, tmp_path).fused  # fusion off: the paper's SR needs no image text


def test_compare_adds_the_fused_row_after_the_papers_rows(workdir):
    proc = _run("retrieve.py", "--index", str(workdir), "--evaluate", "test", "--compare",
                "--config.retrieval.fusion.compare_w_txt=0.25")
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("row "))
    assert lines[head + 7].startswith("CFIR + image text")
    assert lines[head + 7].rstrip().endswith("fused with image text (w_img=1, w_txt=0.25)")
    assert lines[head + 6].startswith("full CFIR") and "fused" not in lines[head + 6]
    assert lines[head + 8].startswith("CFIR + entity text match")
    assert lines[head + 8].rstrip().endswith("entities matched in image text")
    assert "matched" not in lines[head + 6]


def test_entity_text_match_adds_the_images_that_name_an_entity_to_its_list(workdir, config):
    """retrieval.entity_text_match: a known entity's list is its top-K followed by the images whose own text names
    it (whole words) and that the top-K missed. With the lists cut to K=2, that brings relevant images back into
    the train documents' unions (at the tiny world's K=20 the embedding search already finds nearly all)."""
    from cfir_jax.builders.entity_text_match import words
    from cfir_jax.builders.image_text import image_text
    from cfir_jax.stores.entity_text_match import EntityTextMatch

    cfg = config.copy_and_resolve_references()
    cfg.retrieval.entity_text_match = True
    r, plain = Retriever(cfg, workdir), Retriever(config, workdir)
    for retriever in (r, plain):  # K=2 instead of 20: the embedding search alone now misses relevant images
        index = retriever.entity_index
        index.candidates = lambda rows, full=index.candidates: [c[:2] for c in full(rows)]
        index.scores = lambda rows, full=index.scores: [c[:2] for c in full(rows)]
    store = EntityTextMatch.open(workdir / "entity_text_match")
    assert store.manifest["num_pairs"] > 0
    docs = r.corpus_documents("train")
    qrels = r.corpus.qrels("train")
    found = {"plain": 0, "matched": 0}
    for doc in docs:
        lists, scores, used, _ = r.entities.candidates(doc.entities, r.stores.live)
        base, base_scores, _, _ = plain.entities.candidates(doc.entities, plain.stores.live)
        for got, s, top, ts in zip(lists, scores, base, base_scores):  # the re-ranker's ER evidence stays aligned
            assert len(s) == len(got)
            np.testing.assert_array_equal(s[: len(top)], ts)
            assert (s[len(top) :] == ts.min()).all()
        for entity, got, top in zip(used, lists, base):
            assert got[: len(top)].tolist() == top.tolist()
            row = r.entity_index.row(entity)
            if row is None:  # an unknown entity searched over the cache: no text match (the index never saw it)
                assert len(got) == len(top)
                continue
            extra = set(got[len(top) :].tolist())
            assert extra == set(store.rows_of([row])[0].tolist()) - set(top.tolist())
            for cache_row in list(extra)[:3]:  # each added image's text names the entity
                text = image_text(r.corpus.image(r.corpus.image_ids.index(r.image_ids[cache_row])))
                assert " ".join(words(entity)) in " ".join(words(text))
        relevant = {r.cache.index_of(i) for i in qrels[doc.doc_id]}
        found["plain"] += len(relevant & set(np.concatenate(base or [[]]).astype(int).tolist()))
        found["matched"] += len(relevant & set(np.concatenate(lists or [[]]).astype(int).tolist()))
    assert found["matched"] > found["plain"], found


@pytest.mark.slow
def test_document_baseline_is_trained_beside_the_main_model_and_used_by_the_document_rows(workdir, tmp_path):
    """train.py --config.train.text=document exports W/model_document (the paper's document-only model, documents
    at 64 tokens) and leaves W/model alone; --compare's document rows then use it and say so."""
    import shutil

    w = tmp_path / "w"
    shutil.copytree(workdir, w, ignore=shutil.ignore_patterns("train"))
    main_manifest = (w / "model" / "manifest.json").read_text()
    _run("train.py", "--config", CONFIG, "--workdir", str(w), "--config.train.text=document")
    assert (w / "model" / "manifest.json").read_text() == main_manifest
    manifest = json.loads((w / "model_document" / "manifest.json").read_text())
    assert manifest["train_text"] == "document" and manifest["train_max_text_len"] == 64
    assert (w / "train_document" / "metrics.jsonl").is_file() and not (w / "train").exists()
    proc = _run("retrieve.py", "--index", str(w), "--evaluate", "test", "--compare")
    rows = {line[:19].strip(): line.rstrip() for line in proc.stdout.splitlines()}
    for label in ("document only", "entities + document"):
        assert rows[label].endswith("document-trained, 64 tokens"), rows[label]
    for label in ("summary only", "full CFIR"):
        assert rows[label].endswith("summary-trained, 64 tokens"), rows[label]


def test_query_encoding_never_recompiles(workdir, config):
    from compile_checks import traced_at_most

    # Two traces of the one TextEncoder definition: the entity encoder (16 tokens) and the query encoder (64 tokens);
    # any query after the first would be a third.
    with traced_at_most(2):
        r = Retriever(config, workdir)
        for text in ("Short one.", "A much longer document " * 40, "Mid length text about Jeffrey Baker."):
            r.retrieve(text)


def test_retrieve_cli_formats_and_run_file(workdir, tmp_path, retriever):
    doc = tmp_path / "doc.txt"
    r = retriever
    doc.write_text(r.corpus_documents("test")[0].text)
    proc = _run("retrieve.py", "--index", str(workdir), "--query", str(doc), "--top-k", "3", "--format", "json",
                "--html", str(tmp_path / "out.html"))
    record = json.loads(proc.stdout.splitlines()[0])
    assert len(record["hits"]) == 3 and record["entities"]
    assert record["num_unknown_entities"] == len(record["unknown_entities"])
    page = (tmp_path / "out.html").read_text()
    assert page.count('<img src="data:image/png;base64,') == 3 and "synthetic.invalid" not in page
    queries = tmp_path / "q.jsonl"
    docs = r.corpus_documents("test")
    queries.write_text("".join(json.dumps({"id": d.doc_id, "text": d.text}) + "\n" for d in docs))
    qrels = tmp_path / "qrels.txt"
    qrels.write_text((workdir / "corpus" / "qrels" / "test.txt").read_text())
    proc = _run("retrieve.py", "--index", str(workdir), "--queries", str(queries), "--output",
                str(tmp_path / "run.trec"), "--qrels", str(qrels))
    from cfir_jax.eval import metrics, trec

    want = metrics.evaluate(trec.read_run(tmp_path / "run.trec"), trec.read_qrels(qrels))
    assert f"{want.aggregate['mrr@10']:.4f}" in proc.stdout
    assert "SR: exact" in proc.stdout  # --qrels evaluates, so it scores exactly unless asked otherwise


def test_measures_authors_prints_the_authors_metric_of_the_run(workdir, tmp_path, retriever):
    """--measures authors scores the written run as the authors' code does (metrics.authors_measures), instead of
    trec_eval's table; --measures both prints both; an unknown name is one line."""
    from cfir_jax.eval import metrics, trec

    docs = retriever.corpus_documents("test")
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"id": d.doc_id, "text": d.text}) + "\n" for d in docs))
    qrels = tmp_path / "qrels.txt"
    qrels.write_text((workdir / "corpus" / "qrels" / "test.txt").read_text())
    base = ("retrieve.py", "--index", str(workdir), "--queries", str(queries), "--output", str(tmp_path / "run.trec"),
            "--qrels", str(qrels), "--measures")
    proc = _run(*base, "authors")
    run, judged = trec.read_run(tmp_path / "run.trec"), trec.read_qrels(qrels)
    want = metrics.authors_measures(run, judged)
    assert metrics.authors_table([("cfir", want)]) in proc.stdout and "num_q" not in proc.stdout
    both = _run(*base, "both").stdout
    assert "num_q" in both and metrics.authors_table([("cfir", want)]) in both
    bad = _run(*base, "mine", check=False)
    assert bad.returncode == 2 and "--measures 'mine'" in bad.stderr


def test_every_format_shows_the_same_default_number_of_hits(workdir, tmp_path, retriever):
    doc = tmp_path / "doc.txt"
    doc.write_text(retriever.corpus_documents("test")[0].text)
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


def test_compare_k_prints_table4_from_one_index_and_a_cut_equals_an_index_built_at_that_k(workdir, config, tmp_path):
    """--compare-k: full CFIR at each K from the one (exact, K = 20) index; retrieving with retrieval.k=8 equals
    retrieving from an index built at K = 8 (hits and scores); a K above the built one is refused before retrieval."""
    import shutil

    proc = _run("retrieve.py", "--index", str(workdir), "--evaluate", "test", "--compare-k", "20,4,8")
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("row "))
    body = lines[head + 2 : head + 5]
    cells = [re.split(r"\s{2,}", line) for line in body]
    assert [c[0] for c in cells] == ["full CFIR, K = 4", "full CFIR, K = 8", "full CFIR, K = 20"]
    cands = [float(c[7].replace(",", "")) for c in cells]
    assert cands == sorted(cands) and cands[0] < cands[-1]
    assert "ER: exact top-20 per entity (the paper's)" in proc.stdout
    bad = _run("retrieve.py", "--index", str(workdir), "--evaluate", "test", "--compare-k", "8,21", check=False)
    assert bad.returncode == 2 and "retrieval.k=21" in bad.stderr and "built with K=20" in bad.stderr

    w8 = tmp_path / "W8"
    shutil.copytree(workdir, w8)
    _run("index.py", "--config", CONFIG, "--workdir", str(w8), "--config.index.entity_index.k=8")
    cut = config.copy_and_resolve_references()
    cut.retrieval.k = 8
    docs = Retriever(config, workdir).corpus_documents("test")
    a, b = Retriever(cut, workdir).retrieve_many(docs), Retriever(config, w8).retrieve_many(docs)
    for x, y in zip(a, b):
        assert [h.image_id for h in x.hits] == [h.image_id for h in y.hits]
        np.testing.assert_allclose([h.score for h in x.hits], [h.score for h in y.hits], rtol=1e-6)
        assert x.num_candidates == y.num_candidates
