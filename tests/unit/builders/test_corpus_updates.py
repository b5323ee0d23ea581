"""Staging the corpus for --add and --remove: parts read as the union, refusals in one line, removed lists."""

from __future__ import annotations

import base64
import json
import pickle

import numpy as np
import pytest

from cfir_jax.builders.corpus_update import (
    resolve_addition,
    resolve_removals,
    stage_corpus_addition,
    stage_corpus_removal,
)
from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus, Document, Image
from cfir_jax.data.corpus_writer import write_corpus
from cfir_jax.data.files import build_files_corpus

DIM = 4


def _emb(k: int) -> np.ndarray:
    return np.random.default_rng(k).standard_normal(DIM).astype(np.float32)


def _docs(ids):
    return [Document(d, f"text of {d}", f"Title {d}", metadata={"category": (f"cat {d}",)}) for d in ids]


def _images(ids, dim=DIM):
    return [Image(i, f"caption {i}", image=f"bytes {i}".encode(), embedding=None if dim is None else _emb(k),
                  texts={"caption_reference_description": (f"caption {i}",)})
            for k, i in enumerate(ids, start=int(ids[0][1:] or 0))]


BASE_QRELS = {"train": {"d0": {"i0": 1}}, "test": {"d1": {"i1": 1}}}


@pytest.fixture
def base(tmp_path):
    return write_corpus(tmp_path / "corpus", "toy", _docs(["d0", "d1"]), _images(["i0", "i1", "i2"]), BASE_QRELS)


def _addition(root, docs=("d2", "d3"), images=("i3", "i4"), qrels="d2 0 i3 1\nd0 0 i4 1\n", dim=DIM):
    root.mkdir(parents=True)
    if docs:
        (root / "documents.jsonl").write_text("".join(
            json.dumps({"id": d, "text": f"text of {d}", "title": f"Title {d}", "category": [f"cat {d}"]}) + "\n"
            for d in docs))
    if images:
        rows = []
        for k, i in enumerate(images, start=int(images[0][1:])):
            row = {"id": i, "bytes": base64.b64encode(f"bytes {i}".encode()).decode(), "caption": f"caption {i}"}
            if dim is not None:
                row["embedding"] = _emb(k).tolist() if dim == DIM else [0.0] * dim
            rows.append(json.dumps(row) + "\n")
        (root / "images.jsonl").write_text("".join(rows))
    if qrels:
        (root / "qrels").mkdir()
        (root / "qrels" / "train.qrels").write_text(qrels)
    return root


def test_a_corpus_with_a_part_reads_as_the_union_written_in_one_go(tmp_path, base):
    info = stage_corpus_addition(base, tmp_path / "staged", _addition(tmp_path / "add"))
    assert info == {"documents_added": 2, "images_added": 2, "judgements_added": 2, "first_new_document": 2,
                    "first_new_image": 3, "part": "parts/0001"}
    grown = Corpus.open(tmp_path / "staged")
    whole = write_corpus(tmp_path / "whole", "toy", _docs(["d0", "d1", "d2", "d3"]),
                         _images(["i0", "i1", "i2", "i3", "i4"]),
                         {"train": {"d0": {"i0": 1, "i4": 1}, "d2": {"i3": 1}}, "test": {"d1": {"i1": 1}}})
    assert grown.doc_ids == whole.doc_ids and grown.image_ids == whole.image_ids
    assert [grown.document(r) for r in range(4)] == [whole.document(r) for r in range(4)]
    for r in range(5):
        a, b = grown.image(r), whole.image(r)
        assert (a.image_id, a.caption, a.image, a.texts) == (b.image_id, b.caption, b.image, b.texts)
    np.testing.assert_array_equal(grown.embeddings(), whole.embeddings())
    assert grown.qrels("train") == whole.qrels("train") and grown.qrels("test") == whole.qrels("test")
    assert grown.manifest["splits"] == whole.manifest["splits"]
    assert grown.manifest["images_with_text"] == 5 and len(grown.embedding_files) == 2
    # The image records a training worker process reads: one picklable source over base and part.
    records = pickle.loads(pickle.dumps(grown.image_records))
    assert len(records) == 5 and bytes(records[4]["image"]) == b"bytes i4"


def test_the_old_corpus_is_untouched_and_its_files_are_linked(tmp_path, base):
    before = (base.path / "doc_ids.txt").read_text()
    stage_corpus_addition(base, tmp_path / "staged", _addition(tmp_path / "add"))
    assert (base.path / "doc_ids.txt").read_text() == before and "parts" not in base.manifest
    old, new = base.path / "embeddings.npy", tmp_path / "staged" / "embeddings.npy"
    assert old.stat().st_ino == new.stat().st_ino
    assert Corpus.open(base.path).num_documents == 2


def test_a_second_addition_is_a_second_part(tmp_path, base):
    stage_corpus_addition(base, tmp_path / "s1", _addition(tmp_path / "a1"))
    once = Corpus.open(tmp_path / "s1")
    info = stage_corpus_addition(once, tmp_path / "s2", _addition(tmp_path / "a2", docs=(), images=("i5",),
                                                                   qrels=None))
    twice = Corpus.open(tmp_path / "s2")
    assert info["part"] == "parts/0002" and twice.image_ids[-1] == "i5" and twice.image(5).image == b"bytes i5"
    assert twice.embeddings().shape == (6, DIM)
    # Images alone keep the documents' fingerprint: entities and summaries stay current.
    assert twice.documents_fingerprint == once.documents_fingerprint != base.documents_fingerprint


def test_the_forms_of_add_path(tmp_path):
    a = _addition(tmp_path / "a")
    assert resolve_addition(a).documents == a / "documents.jsonl" and resolve_addition(a).qrels == a / "qrels"
    assert resolve_addition(a / "images.jsonl").images == a / "images.jsonl"
    pics = tmp_path / "pics" / "sub"
    pics.mkdir(parents=True)
    (pics / "cat.png").write_bytes(b"x")
    assert resolve_addition(tmp_path / "pics").images == tmp_path / "pics"
    (tmp_path / "empty").mkdir()
    with pytest.raises(CfirError, match="nothing to add"):
        resolve_addition(tmp_path / "empty")


def test_an_image_directory_adds_its_files(tmp_path):
    base = write_corpus(tmp_path / "c", "toy", _docs(["d0"]), _images(["i0"], dim=None), {})
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "new.png").write_bytes(b"png")
    stage_corpus_addition(base, tmp_path / "s", pics)
    grown = Corpus.open(tmp_path / "s")
    assert grown.image_ids == ["i0", "new"] and grown.image(1).image == b"png" and grown.embeddings() is None


def test_an_added_folder_with_two_files_of_one_stem_adds_both(tmp_path):
    base = write_corpus(tmp_path / "c", "toy", _docs(["d0"]), _images(["i0"], dim=None), {})
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "tom.png").write_bytes(b"png")
    (pics / "tom.JPG").write_bytes(b"jpg")
    stage_corpus_addition(base, tmp_path / "s", pics)
    grown = Corpus.open(tmp_path / "s")
    assert grown.image_ids == ["i0", "tom", "tom.png"] and grown.image(2).image == b"png"


@pytest.mark.parametrize("what,line", [("documents.jsonl", 2), ("images.jsonl", 1)])
def test_ids_already_in_the_collection_are_refused_naming_file_and_line(tmp_path, base, what, line):
    add = _addition(tmp_path / "add", docs=("d2", "d0"), images=("i2",))
    if what == "documents.jsonl":
        (add / "images.jsonl").unlink()
    with pytest.raises(CfirError) as e:
        stage_corpus_addition(base, tmp_path / "s", add)
    assert f"{add / what}:{line}:" in str(e.value) and "already in the collection" in str(e.value)
    assert "\n" not in str(e.value)


def test_embeddings_must_match_the_collection(tmp_path, base):
    with pytest.raises(CfirError, match="have no 'embedding'"):
        stage_corpus_addition(base, tmp_path / "s1", _addition(tmp_path / "a1", dim=None))
    with pytest.raises(CfirError, match="dim 3 but the collection's have 4"):
        stage_corpus_addition(base, tmp_path / "s2", _addition(tmp_path / "a2", dim=3))
    plain = write_corpus(tmp_path / "plain", "toy", _docs(["d0"]), _images(["i0"], dim=None), {})
    with pytest.raises(CfirError, match="collection's have none"):
        stage_corpus_addition(plain, tmp_path / "s3", _addition(tmp_path / "a3", qrels=None))


def test_qrels_of_the_addition_must_name_collection_rows(tmp_path, base):
    with pytest.raises(CfirError, match="image_id 'i9'"):
        stage_corpus_addition(base, tmp_path / "s", _addition(tmp_path / "a", qrels="d2 0 i9 1\n"))


def test_removal_writes_the_removed_lists_and_keeps_rows(tmp_path, base):
    info = stage_corpus_removal(base, tmp_path / "s1", ["i1"], ["d0"])
    once = Corpus.open(tmp_path / "s1")
    assert info == {"images_removed": 1, "documents_removed": 1, "removed_images": 1, "removed_documents": 1}
    assert once.removed_image_ids == {"i1"} and once.removed_doc_ids == {"d0"} and once.num_images == 3
    assert once.documents_fingerprint == base.documents_fingerprint
    assert (once.manifest["removed_images"], once.manifest["removed_documents"]) == (1, 1)
    assert base.removed_image_ids == frozenset()
    info = stage_corpus_removal(once, tmp_path / "s2", ["i0"], [])
    twice = Corpus.open(tmp_path / "s2")
    assert twice.removed_image_ids == {"i0", "i1"} and info["images_removed"] == 1
    assert (tmp_path / "s2" / "removed_images.txt").read_text() == "i0\ni1\n"


def test_resolve_removals_reads_ids_prefixes_and_skips_removed(tmp_path, base):
    stage_corpus_removal(base, tmp_path / "r", ["i2"], [])
    removed = Corpus.open(tmp_path / "r")
    ids = tmp_path / "ids.txt"
    ids.write_text("i0\n\nd1\nimage:i1\ni0\ni2\n")
    assert resolve_removals(removed, ids) == (["i0", "i1"], ["d1"], ["i2"])


def test_removal_lines_name_ids_in_either_unicode_form(tmp_path):
    """Ids are NFC (cfir_jax.data.files): a --remove line typed in NFD names the same image."""
    nfc = write_corpus(tmp_path / "c", "toy", _docs(["d0"]), [Image("Z\u00fcrich", image=b"png")], {})
    ids = tmp_path / "ids.txt"
    ids.write_text("Zu\u0308rich\n", encoding="utf-8")
    assert resolve_removals(nfc, ids) == (["Z\u00fcrich"], [], [])


def test_resolve_removals_errors_name_file_and_line(tmp_path):
    both = write_corpus(tmp_path / "c", "toy", _docs(["x", "d1"]), _images(["x"], dim=None), {})
    ids = tmp_path / "ids.txt"
    ids.write_text("d1\nnope\n")
    with pytest.raises(CfirError, match=rf"{ids}:2: 'nope' is neither an image nor a document id"):
        resolve_removals(both, ids)
    ids.write_text("x\n")
    with pytest.raises(CfirError, match=rf"{ids}:1: 'x' is both .* write image:x or document:x"):
        resolve_removals(both, ids)
    ids.write_text("document:x\nimage:x\n")
    assert resolve_removals(both, ids) == (["x"], ["x"], [])
    ids.write_text("d1\nimage:d1\n")
    with pytest.raises(CfirError, match=rf"{ids}:2: 'd1' is not an image id"):
        resolve_removals(both, ids)


def test_a_grown_files_corpus_is_still_current_for_index_py(tmp_path):
    src = _addition(tmp_path / "src", docs=("d0", "d1"), images=("i0", "i1"), qrels=None)
    base = build_files_corpus(src / "documents.jsonl", src / "images.jsonl", None, tmp_path / "corpus")
    stage_corpus_addition(base, tmp_path / "grown", _addition(tmp_path / "add", qrels="d2 0 i3 1\n"))
    again = build_files_corpus(src / "documents.jsonl", src / "images.jsonl", None, tmp_path / "grown")
    assert again.num_documents == 4 and again.qrels("train") == {"d2": {"i3": 1}}


def test_images_beside_a_documents_file_are_added_with_it(tmp_path):
    base = write_corpus(tmp_path / "c", "toy", _docs(["d0"]), _images(["i0"], dim=None), {})
    new = _addition(tmp_path / "new", docs=("d1",), images=(), qrels="")
    for name in ("a.png", "b c.png", "sub/d.gif"):
        (new / name).parent.mkdir(parents=True, exist_ok=True)
        (new / name).write_bytes(name.encode())
    add = resolve_addition(new)
    assert add.documents == new / "documents.jsonl" and add.images == new
    info = stage_corpus_addition(base, tmp_path / "s", new)
    grown = Corpus.open(tmp_path / "s")
    assert info["images_added"] == 3 and info["documents_added"] == 1
    assert grown.image_ids == ["i0", "a", "b%20c", "sub/d"] and grown.image(2).image == b"b c.png"


def test_images_that_nothing_would_read_are_refused_naming_them(tmp_path):
    beside_folder = _addition(tmp_path / "f", images=(), qrels="")
    (beside_folder / "images").mkdir()
    (beside_folder / "images" / "in.png").write_bytes(b"x")
    (beside_folder / "loose.png").write_bytes(b"x")
    with pytest.raises(CfirError, match=r"images loose\.png sit beside images/") as e:
        resolve_addition(beside_folder)
    assert "\n" not in str(e.value)
    unnamed = _addition(tmp_path / "r", qrels="")
    rows = [json.dumps({"id": f"p{k}", "path": f"p{k}.png"}) + "\n" for k in range(2)]
    (unnamed / "images.jsonl").write_text("".join(rows))
    for k in range(6):
        (unnamed / f"p{k}.png").write_bytes(b"x")
    with pytest.raises(CfirError, match=r"no row of images\.jsonl names the images p2\.png, p3\.png, p4\.png and 1 "
                                        r"more"):
        resolve_addition(unnamed)
    for k in range(2, 6):
        (unnamed / f"p{k}.png").unlink()
    assert resolve_addition(unnamed).images == unnamed / "images.jsonl"  # every image named by a row: read
