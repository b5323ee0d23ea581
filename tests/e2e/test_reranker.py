"""The third stage: features of SR's top-N against plain recomputations, a planted signal only the re-ranker can
use (and its shuffled control), the W/reranker store's refusals, and re-rank off leaving CFIR untouched."""

import copy
import json
import pickle

import numpy as np
import pytest
from repo import run_script as _run

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.pipeline import DocumentInput, Retriever
from cfir_jax.retrieve.rerank_features import BASE_FEATURES

TOP_N = 20  # below the tiny world's top_k (100), so re-ranked hits are followed by SR's tail


def _with(config, **rerank):  # noqa: F811
    cfg = copy.deepcopy(config)
    cfg.retrieval.rerank.update(top_n=TOP_N, max_text_len=128, **rerank)
    return cfg


def _linked_copy(workdir, tmp_path, skip=()):  # noqa: F811
    """The same index under another root (its stores symlinked), so a test can add or drop stores of its own."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for store in workdir.iterdir():
        if store.name not in skip and store.name != "reranker":
            (tmp_path / store.name).symlink_to(store)
    return tmp_path


# The settings of the tests' re-ranker, as command-line overrides.
OVERRIDES = (f"--config.retrieval.rerank.top_n={TOP_N}", "--config.retrieval.rerank.max_text_len=128",
             "--config.retrieval.rerank.max_epochs=30", "--config.retrieval.rerank.patience=5")


@pytest.fixture(scope="module")
def fitted(workdir, tmp_path_factory):  # noqa: F811
    """A copy of the tiny index with a re-ranker fitted on its train split by `retrieve.py --fit-reranker`."""
    w = _linked_copy(workdir, tmp_path_factory.mktemp("rerank"))
    proc = _run("retrieve.py", "--index", str(w), "--fit-reranker", *OVERRIDES)
    return w, proc


# --------------------------------------------------------------------------------------------------- features
def test_late_interaction_on_the_device_equals_numpy_over_the_token_outputs(synthetic_spm):
    """encode_against's best and top-3 mean token-image similarities equal numpy's over encode_text_tokens, padding and
    the first token excluded; a text with fewer tokens than `top` averages all of them (one batch padded, one not)."""
    from cfir_jax.core.config import model_config
    from cfir_jax.model.beit3 import create_model
    from cfir_jax.model.text_encoder import TextEncoder
    from cfir_jax.model.tokenizer import Beit3Tokenizer

    model = create_model(model_config("tiny", vocab_size=1000, max_text_positions=64))
    encoder = TextEncoder(model, Beit3Tokenizer(synthetic_spm), max_len=16, batch_size=2)
    texts = ["a long text about the river and the old bridge over it, and more", "", "short one"]
    images = np.random.default_rng(0).normal(size=(3, 5, 64)).astype(np.float32)
    embeddings, best, top_mean = encoder.encode_against(texts, images, top=3)
    ids, mask = encoder.tokenizer(texts, 16)
    tokens = np.asarray(model.text_tower().encode_text_tokens(ids, mask))
    for b in range(3):
        own = tokens[b][~mask[b].astype(bool)][1:]
        sims = -np.sort(-(images[b] @ own.T), axis=1)
        np.testing.assert_allclose(best[b], sims[:, 0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(top_mean[b], sims[:, :3].mean(axis=1), rtol=1e-5, atol=1e-6)
    assert len(tokens[1][~mask[1].astype(bool)][1:]) < 3  # the empty text: its end token alone
    np.testing.assert_allclose(embeddings, encoder.encode(texts), atol=1e-6)


def test_retrievers_features_equal_a_plain_recomputation(workdir, config):  # noqa: F811
    """Every column of the features the retriever computes for SR's top-N, recomputed from the stores and the model
    itself: summary and document embeddings, the document's token outputs, ER lists and scores, the image text."""
    from cfir_jax.model import checkpoint
    from cfir_jax.search.topk import exact_topk
    from cfir_jax.stores.image_text import ImageTextCache

    r = Retriever(_with(config), workdir, rerank_features=True)
    assert r.rerank_feature_names == BASE_FEATURES + ("txt", "has_txt")  # the tiny world has image text
    text = ImageTextCache.open(workdir / "image_text")
    tower = r.rerank_encoder
    tokens_of = checkpoint.load_model(workdir / "model").text_tower().encode_text_tokens  # the model, straight
    docs = r.corpus_documents("test")[:4] + [DocumentInput("Zorblax Quintavenor met Hyllandrup.", "unseen")]
    for doc, res in zip(docs, r.retrieve_many(docs)):
        rows = np.asarray([h.row for h in res.hits[:TOP_N]])
        ids, mask = tower.tokenizer([doc.text], 128)
        states = np.asarray(tokens_of(ids, mask))[0]
        keep = ~mask[0].astype(bool)
        keep[0] = False
        images = np.asarray(r.embeddings[rows], np.float32)
        summary = r.query_encoder.encode([res.summary])[0]
        lists, scores = [], []
        for e in res.entities:
            row = r.entity_index.row(e)
            if row is not None:
                lists.append(r.entity_index.candidates([row])[0])
                scores.append(r.entity_index.scores([row])[0])
            else:
                s, c = exact_topk(r.entity_encoder.encode([e]), r.embeddings, r.entity_index.k)
                lists.append(c[0])
                scores.append(s[0])
        want = []
        for j, row in enumerate(rows):
            sims = sorted((float(t @ images[j]) for t in states[keep]), reverse=True)
            held = [(list(lst).index(row), float(sc[list(lst).index(row)])) for lst, sc in zip(lists, scores)
                    if row in lst]
            er = [len(held), len(held) / len(lists), np.log1p(min(p for p, _ in held)) / np.log1p(r.entity_index.k),
                  max(s for _, s in held)] if held else [0.0, 0.0, 1.0, 0.0]
            want.append([float(summary @ images[j]), float(states[0] @ images[j]), sims[0], np.mean(sims[:8]), *er,
                         float(summary @ np.asarray(text.embeddings[row], np.float32)), float(text.has_text[row])])
        np.testing.assert_allclose(res.rerank_features, want, rtol=2e-4, atol=2e-5, err_msg=doc.doc_id)
        np.testing.assert_allclose(states[0], tower.encode([doc.text])[0], atol=1e-5)  # token 0 is the embedding


# --------------------------------------------------------------------------------------------------- the store
def test_fit_writes_a_store_recording_what_it_was_fitted_on(fitted):
    w, proc = fitted
    assert "held-out lists:" in proc.stdout and "wrote " in proc.stdout
    stored = json.loads((w / "reranker" / "manifest.json").read_text())
    assert stored["kind"] == "reranker" and stored["top_n"] == TOP_N and stored["features"][-2:] == ["txt", "has_txt"]
    assert stored["sources"]["text_fingerprint"].startswith("text-") and stored["sources"]["image_text"]
    assert stored["lists_kept"] + stored["lists_skipped"] == stored["train_documents"] > 0
    assert not list(w.glob("reranker.tmp*"))  # written under a temporary name, renamed when complete


def _edit_manifest(src, dst, **changes):
    (dst / "reranker").mkdir(parents=True)
    (dst / "reranker" / "params.npz").symlink_to(src / "reranker" / "params.npz")
    manifest = json.loads((src / "reranker" / "manifest.json").read_text())
    for key, value in changes.items():
        if key in manifest.get("sources", {}):
            manifest["sources"][key] = value
        else:
            manifest[key] = value
    (dst / "reranker" / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("change, message", [
    ({"text_fingerprint": "text-0123456789abcdef"}, "another model"),
    ({"entity_index": "0000000000000000"}, "stale, fitted when entity_index was"),
    ({"image_text": None}, "stale, fitted when image_text was"),
    ({"top_n": 7}, "fitted with retrieval.rerank.top_n=7 but this run sets 20"),
    ({"format_version": 99}, "format version 99"),
])
def test_store_of_another_model_or_stale_sources_is_refused_in_one_line(fitted, workdir, config, tmp_path,  # noqa: F811
                                                                        change, message):
    w = _linked_copy(workdir, tmp_path / "w")
    _edit_manifest(fitted[0], w, **change)
    with pytest.raises(CfirError, match=message) as e:
        Retriever(_with(config, enabled=True), w)
    assert "\n" not in str(e.value)


def test_enabled_without_a_store_is_one_line_even_on_an_index_older_than_the_option(workdir, tmp_path):  # noqa: F811
    """An index whose recorded config predates retrieval.rerank takes the option's defaults (the override is no
    'unknown config field'), and enabling it without a fitted store says how to fit one."""
    w = _linked_copy(workdir, tmp_path / "w", skip=("index.json",))
    recorded = json.loads((workdir / "index.json").read_text())
    del recorded["config"]["retrieval"]["rerank"]
    (w / "index.json").write_text(json.dumps(recorded))
    proc = _run("retrieve.py", "--index", str(w), "--query", "examples/doc.txt",
                "--config.retrieval.rerank.enabled=true", "--config.retrieval.rerank.max_text_len=128", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "no fitted re-ranker here" in proc.stderr and "--fit-reranker" in proc.stderr


# ------------------------------------------------------------------------------------------------- retrieval
def test_rerank_off_leaves_results_byte_identical(fitted, workdir, config):  # noqa: F811
    """The default config re-ranks nothing, fitted store or not: the same hits, scores to the bit, and timings."""
    assert config.retrieval.rerank.enabled is False
    docs = Retriever(config, workdir).corpus_documents("test")
    plain = Retriever(config, workdir).retrieve_many(docs)
    with_store = Retriever(config, fitted[0]).retrieve_many(docs)
    assert pickle.dumps([r.hits for r in plain]) == pickle.dumps([r.hits for r in with_store])
    assert all(r.times_ms.keys() == s.times_ms.keys() and "rerank" not in r.times_ms
               for r, s in zip(plain, with_store))


def test_retrieve_many_equals_the_loop_with_rerank_on(fitted, config):  # noqa: F811
    cfg = _with(config, enabled=True)
    cfg.retrieval.update(batch_size=3, sr_backend="cpu")
    bulk = Retriever(cfg, fitted[0])
    assert bulk.model_used.endswith(f"re-ranked top {TOP_N}")
    docs = bulk.corpus_documents("test")[:7] + [DocumentInput("Nothing named here at all.", "no-entity")]
    together = bulk.retrieve_many(docs)
    single = Retriever(cfg, fitted[0])
    for x, y in zip(together, [single.retrieve(d) for d in docs]):
        assert [h.row for h in x.hits] == [h.row for h in y.hits]
        np.testing.assert_allclose([h.score for h in x.hits], [h.score for h in y.hits], rtol=1e-5, atol=1e-5)
        assert {"rerank", "rerank_encode"} <= x.times_ms.keys()
    sr = Retriever(config, fitted[0]).retrieve_many(docs)
    moved = [[h.row for h in x.hits[:TOP_N]] != [h.row for h in s.hits[:TOP_N]] for x, s in zip(together, sr)]
    assert any(moved)  # the head re-orders some lists...
    for x, s in zip(together, sr):  # ...within the top-N only: SR's tail stays, in order
        assert sorted(h.row for h in x.hits[:TOP_N]) == sorted(h.row for h in s.hits[:TOP_N])
        assert [h.row for h in x.hits[TOP_N:]] == [h.row for h in s.hits[TOP_N:]]


def test_compare_adds_the_rerank_row_after_the_others(fitted):
    proc = _run("retrieve.py", "--index", str(fitted[0]), "--evaluate", "test", "--compare", *OVERRIDES)
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("row "))

    def row(label):
        return next(i for i, line in enumerate(lines) if i > head and line.startswith(label))

    rerank = row("CFIR + re-rank")
    assert lines[rerank].rstrip().endswith("re-ranked top 20")
    # after Table 3 and every other row beyond the paper whose store the demo builds, none of which is re-ranked
    others = [row(label) for label in ("full CFIR", "CFIR + entity text match", "BM25 (image text)",
                                       "CFIR + BM25 candidates", "CFIR + BM25 fused")]
    assert max(others) < rerank
    assert not any("re-ranked" in line for line in lines[head + 1 : rerank])
    assert "re-rank, p50 per query: CFIR + re-rank:" in proc.stdout
