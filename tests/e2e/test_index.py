"""index.py end to end, through subprocesses: an AToMiC build with a tiny encoder, interrupted builds that resume to
the same stores, refusals of stores built by another model, bad inputs, and --add-entities."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import command_server
import numpy as np
import pytest
from atomic_fixtures import write_atomic_fixture
from repo import ROOT, run_script

# A tiny BEiT-3 (random weights) standing in for the converted base checkpoint: BEiT-3's vocabulary size, 32-d
# embeddings; the tokenizer is the synthetic world's (same id conventions as beit3.spm, which these tests don't need).
# 66 positions: 64 usable, the default text length of retrieval and training (see the text-length test).
TINY_MODEL = dict(embed_dim=32, num_layers=2, num_heads=2, ffn_dim=64, image_size=32, vocab_size=64010,
                  max_text_positions=66, dropout=0.0)
K = 3
SHARD_SIZE = 2  # 7 corpus images -> 4 shards, so a build can be interrupted between shards

CONFIG_FILE = '''
from configs.base import experiment


def get_config(arg=None):
    cfg = experiment("base", "runlocal")
    cfg.model.update({model!r})
    cfg.tokenizer = {spm!r}
    cfg.index.encoder = {encoder!r}
    cfg.index.corpus.update(texts={texts!r}, images={images!r}, qrels={qrels!r})
    cfg.index.image_cache.update(batch_size=4, shard_size={shard_size})
    cfg.index.summaries.update(summarizer="extractive", extractive_tokens=32)
    cfg.index.entity_index.update(k={k}, backend="scann", encode_batch=8)
    return cfg
'''

# Runs index.py in this process after wrapping the image cache's shard writer: each written shard is printed, and
# the process SIGKILLs itself right after shard $KILL_AFTER_SHARD is on disk (a crash at an exact point mid-stage,
# with no race against a poller).
SHARD_KILLER = '''
import os, runpy, signal, sys
import cfir_jax.builders.image_encoding as ic

kill_after = int(os.environ.get("KILL_AFTER_SHARD", "-1"))
write_shard = ic._write_shard


def wrapped(work, shard, *args, **kwargs):
    write_shard(work, shard, *args, **kwargs)
    print(f"wrote shard {shard}", flush=True)
    if shard == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)


ic._write_shard = wrapped
sys.argv = ["index.py", *sys.argv[1:]]
runpy.run_path("index.py", run_name="__main__")
'''


def _run(*args, check=True, env=None, code=None):
    """index.py ARGS (or `python -c CODE ARGS`) in the repository root; asserts success unless check=False."""
    if not code:
        return run_script("index.py", *map(str, args), check=check, env=env)
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _assert_one_line_error(proc, *words):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr


def _save_model(directory: Path, seed: int = 0, **overrides) -> None:
    from cfir_jax.core.config import model_config
    from cfir_jax.model import checkpoint
    from cfir_jax.model.beit3 import create_model

    checkpoint.save_model(create_model(model_config("tiny", **{**TINY_MODEL, **overrides}), seed=seed), directory)


def write_inputs(root: Path, spm: Path):
    """The AToMiC fixture (root/data), a tiny encoder (root/model) and the config file using both; (fixture, config)."""
    fx = write_atomic_fixture(root / "data")
    _save_model(root / "model")
    config = root / "config.py"
    config.write_text(CONFIG_FILE.format(model=TINY_MODEL, spm=str(spm), encoder=str(root / "model"),
                                         texts=str(fx.texts_dir), images=str(fx.images_dir), qrels=str(fx.qrels_dir),
                                         shard_size=SHARD_SIZE, k=K))
    return fx, config


@pytest.fixture(scope="module")
def atomic(tmp_path_factory, synthetic_spm):
    """The AToMiC fixture, a tiny encoder, a config file, and one complete uninterrupted build (W)."""
    root = tmp_path_factory.mktemp("atomic")
    fx, config = write_inputs(root, synthetic_spm)
    proc = _run("--config", config, "--workdir", root / "W")
    return dict(root=root, fx=fx, config=config, work=root / "W", stdout=proc.stdout, spm=synthetic_spm)


def _expected_corpus(fx):
    """Documents: judged texts that exist; images: images judged in any split that exist (the base setting)."""
    docs = sorted({t for pairs in fx.qrels.values() for t, _ in pairs} & set(fx.texts))
    images = sorted({i for pairs in fx.qrels.values() for _, i in pairs} & set(fx.images))
    return docs, images


def _decodable(data) -> bool:
    import io

    from PIL import Image as PILImage

    try:
        PILImage.open(io.BytesIO(data)).load()
        return True
    except Exception:  # any reason PIL refuses the bytes: the cache must skip that image
        return False


# ------------------------------------------------------------------------------------------------ AToMiC build


def test_atomic_corpus_has_the_judged_documents_and_images(atomic):
    from cfir_jax.data.corpus import Corpus

    docs, images = _expected_corpus(atomic["fx"])
    corpus = Corpus.open(atomic["work"] / "corpus")
    assert sorted(corpus.doc_ids) == docs
    assert sorted(corpus.image_ids) == images
    assert f"{len(docs):,} documents, {len(images):,} images" in atomic["stdout"]


def test_small_setting_takes_the_documents_and_images_of_the_chosen_split(atomic, tmp_path):
    from cfir_jax.builders.corpus_update import write_corpus
    from cfir_jax.core.cli import load_config_file
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.stores.layout import Layout

    fx = atomic["fx"]
    config = load_config_file(str(atomic["config"]))
    config.index.corpus.update(setting="small", splits="test")
    write_corpus(config, Layout.of(tmp_path / "W"))
    corpus = Corpus.open(tmp_path / "W" / "corpus")
    assert sorted(corpus.doc_ids) == sorted({t for t, _ in fx.qrels["test"]} & set(fx.texts))
    small = sorted({i for _, i in fx.qrels["test"]} & set(fx.images))
    assert sorted(corpus.image_ids) == small and len(small) < len(_expected_corpus(fx)[1])  # base has more
    assert corpus.splits == ("test",) and corpus.manifest["setting"] == "small"


def test_atomic_cache_skips_corrupt_images_and_lists_them(atomic):
    from cfir_jax.stores.image_cache import ImageCache

    fx = atomic["fx"]
    _, images = _expected_corpus(fx)
    bad = {i for i in images if not fx.images[i]["image"]["bytes"] or not _decodable(fx.images[i]["image"]["bytes"])}
    assert bad, "the fixture must contain images the cache has to skip"
    cache = ImageCache.open(atomic["work"] / "image_cache", expect_dim=TINY_MODEL["embed_dim"])
    assert cache.ids == [i for i in images if i not in bad]  # corpus order, skipped ones left out
    assert {s.image_id for s in cache.skipped()} == bad
    emb = np.asarray(cache.embeddings, np.float32)
    assert emb.shape == (len(images) - len(bad), TINY_MODEL["embed_dim"])
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=2e-3)
    assert len(np.unique(emb.round(3), axis=0)) == len(emb)  # differently coloured images, different embeddings
    assert f"{len(bad)} skipped" in atomic["stdout"]


def test_atomic_entities_are_spacy_ner_of_each_document(atomic):
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.nlp.entities import EntityExtractor, load_spacy
    from cfir_jax.stores.entities import EntityStore

    corpus = Corpus.open(atomic["work"] / "corpus")
    store = EntityStore.open(atomic["work"] / "entities")
    assert store.doc_ids == list(corpus.doc_ids)
    extractor = EntityExtractor(load_spacy(None), "all", 64)
    want = list(extractor.extract(corpus.document(i).text for i in range(corpus.num_documents)))
    assert [store.entities_of(i) for i in range(store.num_docs)] == want
    assert sum(map(len, want)) > 0
    assert sorted(store.vocab) == sorted({e for ents in want for e in ents})


def test_atomic_every_document_has_a_summary(atomic):
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.nlp.summarizer import ExtractiveSummarizer
    from cfir_jax.stores.summaries import SummaryStore

    corpus = Corpus.open(atomic["work"] / "corpus")
    store = SummaryStore.open(atomic["work"] / "summaries")
    assert store.num_docs == corpus.num_documents
    texts = [corpus.document(i).text for i in range(corpus.num_documents)]
    assert [store.summary(i) for i in range(store.num_docs)] == ExtractiveSummarizer(max_tokens=32).summarize(texts)
    assert all(store.summary(i).strip() for i in range(store.num_docs))


def test_atomic_entity_index_covers_the_vocabulary_with_exact_top_k(atomic):
    from cfir_jax.model import checkpoint
    from cfir_jax.model.text_encoder import TextEncoder
    from cfir_jax.model.tokenizer import Beit3Tokenizer
    from cfir_jax.search.topk import exact_topk
    from cfir_jax.stores.entities import EntityStore
    from cfir_jax.stores.entity_index import EntityIndex
    from cfir_jax.stores.image_cache import ImageCache

    work = atomic["work"]
    store = EntityStore.open(work / "entities")
    train = {t for t, _ in atomic["fx"].qrels["train"]}
    # The paper's protocol (the default): the entities of the train documents only, in store order.
    in_train = {j for i, d in enumerate(store.doc_ids) if d in train for j in store.entity_ids_of(i).tolist()}
    vocab = [store.vocab[j] for j in sorted(in_train)]
    assert vocab and len(vocab) < len(store.vocab), "the fixture's other splits mention entities train does not"
    model = checkpoint.load_model(atomic["root"] / "model")
    index = EntityIndex.open(work / "entity_index", expect_fingerprint=checkpoint.fingerprint(model, "text"))
    assert index.vocab == vocab and index.manifest["backend"] == "scann" and index.manifest["documents"] == "train"
    cache = ImageCache.open(work / "image_cache")
    assert index.k == min(K, cache.num_images) and index.manifest["n_images"] == cache.num_images
    # Few images: ScaNN reorders all of them exactly, so its candidates are the exact top-K.
    emb = TextEncoder(model, Beit3Tokenizer(atomic["spm"]), 16).encode(vocab)
    _, exact = exact_topk(emb, cache.embeddings, index.k)
    for got, want in zip(index.candidates(np.arange(len(vocab))), exact):
        assert set(got.tolist()) == set(want.tolist())
    assert index.manifest["recall_at_k"] == 1.0


def test_atomic_build_prints_the_closing_table(atomic):
    lines = atomic["stdout"].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    assert lines[header].split() == ["stage", "contents", "on", "disk", "time"]
    rows = [line.split()[0] for line in lines[header + 2 :]]
    # the stages' one order: each after what it is made from, ties broken by name
    assert rows == ["corpus", "entities", "image_cache", "duplicates", "image_fields", "encoder", "entity_index",
                    "summaries"]
    times = {line.split()[0]: line.rstrip() for line in lines[header + 2 :]}
    assert times.pop("encoder").endswith("reused")  # the converted model named by the config: nothing to build
    assert all(line.endswith(" s") for line in times.values())
    assert "nothing to do" not in atomic["stdout"]


def test_rerun_rebuilds_nothing(atomic):
    before = {p: p.stat().st_mtime_ns for p in atomic["work"].rglob("manifest.json")}
    proc = _run("--config", atomic["config"], "--workdir", atomic["work"])
    assert proc.stdout.rstrip().endswith("index: every stage current, nothing to do")
    assert {p: p.stat().st_mtime_ns for p in atomic["work"].rglob("manifest.json")} == before


# ------------------------------------------------------------------------------------------- interrupted builds


def _assert_same_stores(a: Path, b: Path) -> None:
    for rel in ("image_cache/embeddings.npy", "entity_index/candidates.npy", "entity_index/scores.npy"):
        np.testing.assert_array_equal(np.load(a / rel), np.load(b / rel), err_msg=rel)
    for rel in ("image_cache/ids.txt", "image_cache/skipped.tsv", "entities/vocab.txt", "entity_index/vocab.json",
                "summaries/summaries.jsonl", "summaries/doc_ids.txt"):
        assert (a / rel).read_text() == (b / rel).read_text(), rel
    np.testing.assert_array_equal(np.load(a / "entities/entity_ids.npy"), np.load(b / "entities/entity_ids.npy"))


def test_build_killed_mid_image_cache_resumes_to_the_same_stores(atomic, tmp_path):
    work = tmp_path / "W"
    args = ("--config", atomic["config"], "--workdir", work)
    killed = _run(*args, code=SHARD_KILLER, check=False, env={"KILL_AFTER_SHARD": "1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    building = work / ".image_cache.building"
    assert sorted(p.name for p in building.glob("shard-*.json")) == ["shard-00000.json", "shard-00001.json"]
    assert not (work / "image_cache").exists()

    resumed = _run(*args, code=SHARD_KILLER, env={"KILL_AFTER_SHARD": "-1"})
    assert "wrote shard 0" not in resumed.stdout and "wrote shard 1" not in resumed.stdout  # finished shards kept
    assert "wrote shard 2" in resumed.stdout and "wrote shard 3" in resumed.stdout
    assert not building.exists()
    _assert_same_stores(atomic["work"], work)


@pytest.mark.slow
def test_synthetic_build_killed_during_pretraining_resumes_to_the_same_encoder(tmp_path):
    """SIGKILL once the caption pretraining has written a checkpoint; the rerun resumes it and every store, the
    encoder's parameters included, equals an uninterrupted build's."""
    from cfir_jax.model import checkpoint
    from cfir_jax.model.beit3 import param_path

    flags = ["--config", "configs/demo.py:tiny", "--config.index.pretrain.checkpoint_every=4",
             "--config.index.pretrain.num_steps=16"]
    _run(*flags, "--workdir", tmp_path / "ref")
    work = tmp_path / "W"
    proc = command_server.popen(["index.py", *flags, "--workdir", work], dict(os.environ), ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = work / "pretrain" / "checkpoints" / "4"
    deadline = time.time() + 600
    while not first.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert first.is_dir() and not (work / "encoder").exists(), "the kill must land inside the pretrain stage"
    _run(*flags, "--workdir", work)

    ref_model, model = checkpoint.load_model(tmp_path / "ref" / "encoder"), checkpoint.load_model(work / "encoder")
    import jax
    from flax import nnx

    flat = lambda m: {param_path(p): np.asarray(v) for p, v in  # noqa: E731
                      jax.tree_util.tree_flatten_with_path(nnx.state(m, nnx.Param))[0]}
    ref_params, params = flat(ref_model), flat(model)
    assert ref_params.keys() == params.keys()
    for name in ref_params:
        np.testing.assert_array_equal(params[name], ref_params[name], err_msg=name)
    for rel in ("image_cache/embeddings.npy", "entity_index/candidates.npy"):
        np.testing.assert_array_equal(np.load(work / rel), np.load(tmp_path / "ref" / rel), err_msg=rel)
    for rel in ("entities/vocab.txt", "summaries/summaries.jsonl", "entity_index/vocab.json"):
        assert (work / rel).read_text() == (tmp_path / "ref" / rel).read_text(), rel


# ----------------------------------------------------------------------------------------------------- refusals


def test_entity_index_over_a_cache_of_another_model_is_refused(atomic, tmp_path):
    _save_model(tmp_path / "other", seed=1)  # same sizes, other weights
    proc = _run("--config", atomic["config"], "--workdir", atomic["work"], "--stages", "entity_index",
                f"--config.index.encoder={tmp_path / 'other'}", check=False)
    _assert_one_line_error(proc, "image_cache", "fingerprint")


def test_entity_index_over_a_cache_of_another_dim_is_refused(atomic, tmp_path):
    _save_model(tmp_path / "wide", embed_dim=48, num_heads=3)
    proc = _run("--config", atomic["config"], "--workdir", atomic["work"], "--stages", "entity_index",
                f"--config.index.encoder={tmp_path / 'wide'}", "--config.model.embed_dim=48",
                "--config.model.num_heads=3", check=False)
    _assert_one_line_error(proc, "dim 32", "48")


def test_add_entities_to_an_index_of_another_model_is_refused(atomic, tmp_path):
    work = tmp_path / "W"
    shutil.copytree(atomic["work"], work)
    manifest_path = work / "entity_index" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model_fingerprint"] = "text-0000000000000000"
    manifest_path.write_text(json.dumps(manifest))
    (tmp_path / "new.txt").write_text("Quokka Island\n")
    proc = _run("--config", atomic["config"], "--workdir", work, "--add-entities", tmp_path / "new.txt", check=False)
    _assert_one_line_error(proc, "model_fingerprint")


def test_text_length_over_the_model_positions_is_refused_at_configuration(atomic, tmp_path):
    """A model with 64 text positions can encode 62 tokens: the default retrieval.max_text_len=64 is refused before
    any stage runs, naming both numbers and the override."""
    _save_model(tmp_path / "short", max_text_positions=64)
    proc = _run("--config", atomic["config"], "--workdir", tmp_path / "W",
                f"--config.index.encoder={tmp_path / 'short'}", "--config.model.max_text_positions=64", check=False)
    _assert_one_line_error(proc, "retrieval.max_text_len=64", "62", "--config.retrieval.max_text_len=62")
    assert not (tmp_path / "W" / "corpus").exists()


def test_missing_atomic_directory_is_a_one_line_error(atomic, tmp_path):
    proc = _run("--config", atomic["config"], "--workdir", tmp_path / "W",
                f"--config.index.corpus.texts={tmp_path / 'no-such-dir'}", check=False)
    _assert_one_line_error(proc, "no-such-dir")


def test_unknown_config_field_is_a_one_line_error(atomic, tmp_path):
    proc = _run("--config", atomic["config"], "--workdir", tmp_path / "W", "--config.index.entity_index.kk=5",
                check=False)
    _assert_one_line_error(proc, "entity_index.kk", "unknown config field")


def test_unknown_stage_is_a_one_line_error(atomic, tmp_path):
    proc = _run("--config", atomic["config"], "--workdir", tmp_path / "W", "--stages", "corpus,imagecache",
                check=False)
    _assert_one_line_error(proc, "imagecache", "image_cache")


# ------------------------------------------------------------------------------------------------ add entities


def test_add_entities_appends_exact_candidates(atomic, tmp_path):
    from cfir_jax.model import checkpoint
    from cfir_jax.model.text_encoder import TextEncoder
    from cfir_jax.model.tokenizer import Beit3Tokenizer
    from cfir_jax.search.topk import exact_topk
    from cfir_jax.stores.entity_index import EntityIndex
    from cfir_jax.stores.image_cache import ImageCache

    work = tmp_path / "W"
    shutil.copytree(atomic["work"], work)
    _run("--config", atomic["config"], "--workdir", work, "--stages", "entity_index",
         "--config.index.entity_index.backend=exact")
    old = EntityIndex.open(work / "entity_index")
    assert old.manifest["backend"] == "exact"
    old_vocab, old_cand = list(old.vocab), old.candidates(np.arange(len(old.vocab)))
    new = ["Quokka Island", "Zanzibar Lighthouse Society"]
    (tmp_path / "new.txt").write_text(f"{new[0]}\n\n{old_vocab[0]}\n{new[1]}\n")  # one already indexed, a blank line
    proc = _run("--config", atomic["config"], "--workdir", work, "--add-entities", tmp_path / "new.txt")
    assert "added 2 new entities" in proc.stdout

    index = EntityIndex.open(work / "entity_index")
    assert index.vocab == old_vocab + sorted(new)
    np.testing.assert_array_equal(np.stack(index.candidates(np.arange(len(old_vocab)))), np.stack(old_cand))
    model = checkpoint.load_model(atomic["root"] / "model")
    emb = TextEncoder(model, Beit3Tokenizer(atomic["spm"]), 16).encode(sorted(new))
    _, exact = exact_topk(emb, ImageCache.open(work / "image_cache").embeddings, index.k)
    np.testing.assert_array_equal(np.stack(index.candidates([index.row(t) for t in sorted(new)])), exact)


@pytest.mark.parametrize("case", ["missing", "binary"])
def test_add_entities_bad_file_is_a_one_line_error(atomic, tmp_path, case):
    path = tmp_path / "new.txt"
    if case == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00" * 50)
    proc = _run("--config", atomic["config"], "--workdir", atomic["work"], "--add-entities", path, check=False)
    _assert_one_line_error(proc, str(path))


def test_atomic_document_training_reads_the_configured_document_fields(atomic):
    """train.text=document tokenises train.document_fields of each document (the authors' three fields by default),
    not the assembled text with the page description."""
    from cfir_jax.core.cli import load_config_file
    from cfir_jax.data.corpus import Corpus, document_text
    from cfir_jax.model.tokenizer import resolve_tokenizer
    from cfir_jax.training.data import load_train_data

    config = load_config_file(str(atomic["config"]))
    config.train.text = "document"
    data = load_train_data(config, atomic["work"], with_eval=False)
    corpus = Corpus.open(atomic["work"] / "corpus")
    docs = [corpus.document(i) for i in range(corpus.num_documents)]
    tokenizer = resolve_tokenizer(config, corpus)
    want, _ = tokenizer([document_text(d, config.train.document_fields) for d in docs], config.train.max_text_len)
    np.testing.assert_array_equal(data.ids, want)
    whole, _ = tokenizer([d.text for d in docs], config.train.max_text_len)
    assert not np.array_equal(data.ids, whole)  # t1's page description is left out
