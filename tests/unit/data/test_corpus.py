"""The corpus format: write/open round trip through tfds array_record + grain, reuse, and errors on bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys

import grain
import numpy as np
import pytest

from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus, Document, Image
from cfir_jax.data.corpus_writer import Qrels, write_corpus


def _docs(n=3):
    return [Document(f"d{k}", f"text of document {k} – ünïcode", f"Title {k}", (f"E{k}",)) for k in range(n)]


def _images(n=4, dim=None):
    rng = np.random.default_rng(0)
    return [
        Image(f"i{k}", f"caption {k}", f"http://x/{k}", bytes([k, 255, 0]) * k,
              None if dim is None else rng.standard_normal(dim).astype(np.float32), ("E0",) * (k % 2))
        for k in range(n)
    ]


QRELS = {"train": {"d0": {"i0": 1, "i1": 1}}, "test": {"d2": {"i3": 1}}}


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "c", "toy", iter(_docs()), iter(_images(dim=8)), QRELS)


def test_records_round_trip_in_row_order(corpus):
    assert corpus.doc_ids == ["d0", "d1", "d2"] and corpus.image_ids == ["i0", "i1", "i2", "i3"]
    assert [corpus.document(k) for k in range(3)] == [dataclasses.replace(d, lang="en") for d in _docs()]  # read
    for k, want in enumerate(_images(dim=8)):
        got = corpus.image(k)
        assert (got.image_id, got.caption, got.url, got.image, got.entities) == (
            want.image_id, want.caption, want.url, want.image, want.entities)
        np.testing.assert_array_equal(got.embedding, want.embedding)


def test_documents_are_a_random_access_grain_dataset(corpus):
    assert isinstance(corpus.documents, grain.MapDataset)
    assert len(corpus.documents) == 3 and corpus.documents[2].doc_id == "d2"
    assert sorted(d.doc_id for d in corpus.documents.shuffle(seed=1)) == corpus.doc_ids


def test_a_row_read_alone_is_the_grain_dataset_s_row_and_needs_no_grain(corpus):
    """`image(i)` / `document(i)` read the record itself (a query's captions load no grain); the same as the dataset."""
    assert [corpus.document(k) for k in range(3)] == [corpus.documents[k] for k in range(3)]
    for k in range(4):
        alone, in_dataset = corpus.image(k), corpus.images[k]
        assert alone == in_dataset and np.array_equal(alone.embedding, in_dataset.embedding)
    fresh = Corpus.open(corpus.path)
    fresh.image(1), fresh.document(1)
    assert "images" not in vars(fresh) and "documents" not in vars(fresh)  # the grain datasets were never made


def test_embeddings_matrix_matches_the_records(corpus):
    emb = corpus.embeddings()
    assert emb.shape == (4, 8) and emb.dtype == np.float32
    np.testing.assert_array_equal(emb[2], corpus.image(2).embedding)


def test_qrels_round_trip_and_unknown_split_is_rejected(corpus):
    assert corpus.qrels("train") == QRELS["train"] and corpus.qrels("test") == QRELS["test"]
    assert corpus.splits == ("train", "test")
    with pytest.raises(CfirError, match="no 'validation' qrels"):
        corpus.qrels("validation")


def test_no_tensorflow_is_imported(corpus):
    corpus.document(0)
    assert "tensorflow" not in sys.modules


def test_tokenizer_is_copied_when_given(tmp_path):
    spm = tmp_path / "m.spm"
    spm.write_bytes(b"model")
    c = write_corpus(tmp_path / "c", "toy", _docs(), _images(), {}, tokenizer_spm=spm)
    assert c.tokenizer_path.read_bytes() == b"model"
    assert write_corpus(tmp_path / "d", "toy", _docs(), _images(), {}).tokenizer_path is None


def test_images_without_embeddings_have_none(tmp_path):
    c = write_corpus(tmp_path / "c", "toy", _docs(), _images(), {})
    assert c.embeddings() is None and c.image(1).embedding is None


def test_complete_corpus_is_reused_unless_fields_differ(tmp_path):
    first = write_corpus(tmp_path / "c", "toy", _docs(), _images(), {}, config={"a": 1})
    again = write_corpus(tmp_path / "c", "toy", _docs(1), _images(), {}, config={"a": 1})
    assert again.num_documents == 3 and again.manifest["created"] == first.manifest["created"]
    rebuilt = write_corpus(tmp_path / "c", "toy", _docs(1), _images(), {}, config={"a": 2})
    assert rebuilt.num_documents == 1


def test_qrels_naming_an_unknown_image_is_rejected_or_dropped(tmp_path):
    bad = {"train": {"d0": {"nope": 1, "i0": 1}}}
    with pytest.raises(CfirError, match="image_id 'nope'"):
        write_corpus(tmp_path / "c", "toy", _docs(), _images(), bad)
    c = write_corpus(tmp_path / "d", "toy", _docs(), _images(), Qrels(bad, drop_unknown=True))
    assert c.qrels("train") == {"d0": {"i0": 1}} and c.manifest["splits"]["train"]["dropped"] == 1


@pytest.mark.parametrize("bad_id", ["", "has space", "tab\tid"])
def test_ids_that_break_trec_files_are_rejected(tmp_path, bad_id):
    with pytest.raises(CfirError, match="without whitespace"):
        write_corpus(tmp_path / "c", "toy", [Document(bad_id, "x")], _images(), {})


def test_duplicate_ids_are_rejected(tmp_path):
    with pytest.raises(CfirError, match="duplicate image id 'i0'"):
        write_corpus(tmp_path / "c", "toy", _docs(), _images() + _images(1), {})


def test_mixed_or_misshaped_embeddings_are_rejected(tmp_path):
    images = _images(dim=8)
    with pytest.raises(CfirError, match="give all or none"):
        write_corpus(tmp_path / "a", "toy", _docs(), images[:2] + [Image("plain")], {})
    with pytest.raises(CfirError, match=r"shape \(4,\), expected \(8,\)"):
        write_corpus(tmp_path / "b", "toy", _docs(), images[:1] + [Image("z", embedding=np.zeros(4))], {})


def test_empty_inputs_and_unknown_splits_are_rejected(tmp_path):
    with pytest.raises(CfirError, match="no documents"):
        write_corpus(tmp_path / "a", "toy", [], _images(), {})
    with pytest.raises(CfirError, match="no images"):
        write_corpus(tmp_path / "b", "toy", _docs(), iter([]), {})
    with pytest.raises(CfirError, match="split 'dev' is unknown"):
        write_corpus(tmp_path / "c", "toy", _docs(), _images(), {"dev": {}})


def test_failed_write_leaves_no_corpus(tmp_path):
    with pytest.raises(CfirError):
        write_corpus(tmp_path / "c", "toy", _docs(), _images(), {"train": {"ghost": {"i0": 1}}})
    with pytest.raises(CfirError, match="no corpus store here"):
        Corpus.open(tmp_path / "c")


def test_opening_an_incomplete_corpus_is_a_clear_error(corpus, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(corpus.path, broken)
    shutil.rmtree(broken / "images")
    with pytest.raises(CfirError, match="images records missing"):
        Corpus.open(broken)
    (broken / "manifest.json").unlink()
    with pytest.raises(CfirError, match="incomplete corpus store"):
        Corpus.open(broken)


def test_manifest_count_mismatch_is_detected(corpus):
    manifest = json.loads((corpus.path / "manifest.json").read_text())
    manifest["num_images"] = 5
    (corpus.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CfirError, match="image_ids.txt: 4 ids but the manifest says 5"):
        Corpus.open(corpus.path)


def test_row_out_of_range_is_a_clear_error(corpus):
    with pytest.raises(CfirError, match="document row 3 out of range"):
        corpus.document(3)
