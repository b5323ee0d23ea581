"""A collection from plain files: documents, images (a folder or rows) and qrels into the corpus format, and the
one-line error of each malformed row, naming the file and the line."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image as PILImage

from cfir_jax.core.errors import CfirError
from cfir_jax.data.files import build_files_corpus, read_documents, read_images, read_qrels


def _png(color=(200, 10, 10)) -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", (8, 8), color).save(out, format="PNG")
    return out.getvalue()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


DOCS = [{"id": "d1", "text": "Ada Lovelace wrote notes.", "title": "Ada", "tags": ["math", "history"], "n": 3},
        {"id": "d2", "text": "The Eiffel Tower at night."}]


def test_documents_keep_title_and_string_fields_as_metadata(tmp_path):
    docs = list(read_documents(_jsonl(tmp_path / "docs.jsonl", DOCS)))
    assert [d.doc_id for d in docs] == ["d1", "d2"]
    assert docs[0].title == "Ada" and docs[0].text == "Ada Lovelace wrote notes."
    assert docs[0].metadata == {"tags": ("math", "history")}  # a number is not text: left out
    assert docs[1].title == "" and docs[1].metadata == {}


def test_documents_from_parquet_equal_those_from_jsonl(tmp_path):
    rows = [{"id": "d1", "text": "one", "title": "T"}, {"id": "d2", "text": "two", "title": ""}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "docs.parquet")
    assert list(read_documents(tmp_path / "docs.parquet")) == list(read_documents(_jsonl(tmp_path / "d.jsonl", rows)))


@pytest.mark.parametrize("rows, message", [
    ([{"id": "d1", "text": "a"}, {"id": "d2"}], "docs.jsonl:2: missing field 'text'"),
    ([{"text": "a"}], "docs.jsonl:1: missing field 'id'"),
    ([{"id": "d1", "text": "a"}, {"id": "d1", "text": "b"}], "docs.jsonl:2: duplicate document id 'd1' (first at"),
    ([{"id": "d 1", "text": "a"}], "docs.jsonl:1: document id 'd 1' has whitespace"),
    ([{"id": "d1", "text": 5}], "docs.jsonl:1: field 'text' must be a string"),
])
def test_a_malformed_document_row_is_one_line_naming_file_and_line(tmp_path, rows, message):
    with pytest.raises(CfirError, match="^.*" + message.replace("(", r"\(")) as e:
        list(read_documents(_jsonl(tmp_path / "docs.jsonl", rows)))
    assert "\n" not in str(e.value) and str(tmp_path / "docs.jsonl") in str(e.value)


def test_non_utf8_text_is_one_line_naming_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"id": "d1", "text": "fine"}\n{"id": "d2", "text": "caf\xe9"}\n')
    with pytest.raises(CfirError, match=r"docs\.jsonl:2: not UTF-8 text"):
        list(read_documents(path))


def test_a_line_that_is_not_json_names_its_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"id": "d1", "text": "a"}\n\n{"id": "d2", text}\n')
    with pytest.raises(CfirError, match=r"docs\.jsonl:3: not a JSON object"):
        list(read_documents(path))


def test_an_image_folder_gives_ids_from_relative_paths(tmp_path):
    (tmp_path / "imgs" / "cats").mkdir(parents=True)
    (tmp_path / "imgs" / "cats" / "tom.png").write_bytes(_png())
    (tmp_path / "imgs" / "b.JPG").write_bytes(b"not really a jpeg")
    (tmp_path / "imgs" / "notes.txt").write_text("ignored")
    images = list(read_images(tmp_path / "imgs"))
    assert [i.image_id for i in images] == ["b", "cats/tom"]
    assert images[1].image == _png() and images[1].embedding is None


def test_two_files_of_one_stem_get_two_ids_the_second_keeping_its_suffix(tmp_path):
    """tom.png and tom.JPG in one folder: neither the build nor an add is refused; sorted by name, the second keeps
    its suffix."""
    (tmp_path / "imgs" / "cats").mkdir(parents=True)
    (tmp_path / "imgs" / "cats" / "tom.png").write_bytes(_png())
    (tmp_path / "imgs" / "cats" / "tom.JPG").write_bytes(_png((0, 0, 255)))
    (tmp_path / "imgs" / "a.png").write_bytes(_png())
    (tmp_path / "imgs" / "a.jpg").write_bytes(_png())
    images = list(read_images(tmp_path / "imgs"))
    assert [(i.image_id, i.url) for i in images] == [("a", "a.jpg"), ("a.png", "a.png"), ("cats/tom", "cats/tom.JPG"),
                                                     ("cats/tom.png", "cats/tom.png")]
    assert images[2].image == _png((0, 0, 255)) and images[3].image == _png()
    with pytest.raises(CfirError, match="'a' is already in the collection"):  # a re-add is still refused
        list(read_images(tmp_path / "imgs", existing={"a"}))


def test_ids_are_nfc_and_a_name_in_another_unicode_form_is_skipped_and_named(tmp_path):
    """Zürich.png in NFC and NFD look the same: one id (NFC); the second file is not read but written with no bytes
    under its name percent-encoded, so the image cache skips it and names it in skipped.tsv. Row ids are NFC too."""
    nfc, nfd = "Z\u00fcrich", "Zu\u0308rich"
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / f"{nfd}.png").write_bytes(_png())
    (tmp_path / "imgs" / f"{nfc}.png").write_bytes(_png((0, 0, 255)))
    images = list(read_images(tmp_path / "imgs"))  # sorted by name: the NFD name ("u" < "\u00fc") is read first
    assert [(i.image_id, i.url, i.image) for i in images] == [(nfc, f"{nfd}.png", _png()),
                                                              ("Z%C3%BCrich.png", f"{nfc}.png", b"")]
    rows = [{"id": nfd, "path": f"{nfd}.png"}, {"id": "b", "path": f"{nfc}.png"}]
    assert [i.image_id for i in read_images(_jsonl(tmp_path / "images.jsonl", rows))] == [nfc, "b"]


def test_image_rows_read_path_bytes_captions_and_embeddings(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "x.png").write_bytes(_png())
    rows = [{"id": "x", "path": "pics/x.png", "caption": "a red square", "embedding": [1.0, 0.0]},
            {"id": "y", "bytes": base64.b64encode(_png((0, 0, 255))).decode(), "embedding": [0.0, 1.0],
             "caption_alt_text_description": ["blue"]},
            {"id": "gone", "path": "pics/missing.png", "embedding": [0.5, 0.5]}]
    images = list(read_images(_jsonl(tmp_path / "images.jsonl", rows)))
    assert [i.image_id for i in images] == ["x", "y", "gone"]
    assert images[0].image == _png() and images[0].caption == "a red square"
    assert images[0].texts == {"caption_reference_description": ("a red square",)}
    assert images[1].image == _png((0, 0, 255)) and images[1].caption == "blue"
    assert images[2].image == b""  # a missing file: written empty, skipped and listed by the image cache
    np.testing.assert_array_equal(images[1].embedding, [0.0, 1.0])


@pytest.mark.parametrize("rows, message", [
    ([{"id": "a", "path": "a.png"}, {"id": "b"}], r"images\.jsonl:2: missing field 'path' \(or 'bytes'\)"),
    ([{"id": "a", "path": "a.png"}, {"id": "a", "path": "b.png"}], r"images\.jsonl:2: duplicate image id 'a'"),
    ([{"id": "a", "path": "a", "embedding": [1.0]}, {"id": "b", "path": "b"}],
     r"images\.jsonl:2: no embedding, but the first row has"),
    ([{"id": "a", "path": "a", "embedding": [1.0]}, {"id": "b", "path": "b", "embedding": [1.0, 2.0]}],
     r"images\.jsonl:2: embedding of 2 numbers, the first row's has 1"),
    ([{"id": "a", "bytes": "%%%"}], r"images\.jsonl:1: field 'bytes' is not base64"),
])
def test_a_malformed_image_row_is_one_line_naming_file_and_line(tmp_path, rows, message):
    with pytest.raises(CfirError, match=message) as e:
        list(read_images(_jsonl(tmp_path / "images.jsonl", rows)))
    assert "\n" not in str(e.value)


def test_qrels_per_split_and_a_bad_line(tmp_path):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "test.qrels").write_text("d1 0 x 1\nd2 0 y 1\n")
    (tmp_path / "q" / "train.txt").write_text("d1 0 y 1\n")
    assert read_qrels(tmp_path / "q") == {"train": {"d1": {"y": 1}}, "test": {"d1": {"x": 1}, "d2": {"y": 1}}}
    (tmp_path / "q" / "validation.qrels").write_text("d1 0 x 1\nd1 x\n")
    with pytest.raises(CfirError, match=r"validation\.qrels:2: expected `doc_id 0 image_id rel`"):
        read_qrels(tmp_path / "q")


def test_a_collection_is_written_as_a_corpus_and_reused_until_a_file_changes(tmp_path):
    docs = _jsonl(tmp_path / "docs.jsonl", DOCS)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "x.png").write_bytes(_png())
    (tmp_path / "imgs" / "broken.png").write_bytes(b"\x89PNG broken")
    corpus = build_files_corpus(docs, tmp_path / "imgs", None, tmp_path / "c")
    assert corpus.doc_ids == ["d1", "d2"] and corpus.image_ids == ["broken", "x"] and corpus.splits == ()
    assert corpus.document(0).metadata == {"tags": ("math", "history")}
    assert corpus.manifest["source"] == "files"
    mtime = (tmp_path / "c" / "manifest.json").stat().st_mtime_ns
    assert build_files_corpus(docs, tmp_path / "imgs", None, tmp_path / "c").image_ids == ["broken", "x"]
    assert (tmp_path / "c" / "manifest.json").stat().st_mtime_ns == mtime
    (tmp_path / "imgs" / "y.png").write_bytes(_png((0, 255, 0)))
    assert build_files_corpus(docs, tmp_path / "imgs", None, tmp_path / "c").image_ids == ["broken", "x", "y"]


def test_a_judgement_naming_no_document_of_the_collection_names_its_qrels_file(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "x.png").write_bytes(_png())
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "test.qrels").write_text("d9 0 x 1\n")
    with pytest.raises(CfirError, match=r"q/test\.qrels: doc_id 'd9' is not a document of the corpus"):
        build_files_corpus(_jsonl(tmp_path / "docs.jsonl", DOCS), tmp_path / "imgs", tmp_path / "q", tmp_path / "c")


def _gif() -> bytes:
    out = io.BytesIO()
    PILImage.new("P", (8, 8), 3).save(out, format="GIF")
    return out.getvalue()


def test_images_named_as_people_name_them_get_reversible_ids_and_keep_their_paths(tmp_path):
    from cfir_jax.data.files import image_id_of_path, path_of_image_id

    imgs = tmp_path / "imgs"
    (imgs / "people").mkdir(parents=True)
    (imgs / "trips" / "2019 summer").mkdir(parents=True)
    (imgs / "people" / "Grace Hopper.jpg").write_bytes(_png())
    (imgs / "trips" / "2019 summer" / "beach\tday 100%.png").write_bytes(_png((0, 0, 200)))
    (imgs / "trips" / "Zoë at night.GIF").write_bytes(_gif())
    (imgs / "broken.png").write_bytes(b"\x89PNG broken")
    (imgs / "empty.jpeg").write_bytes(b"")
    corpus = build_files_corpus(_jsonl(tmp_path / "docs.jsonl", DOCS), imgs, None, tmp_path / "c")
    assert corpus.image_ids == ["broken", "empty", "people/Grace%20Hopper", "trips/2019%20summer/beach%09day%20100%25",
                                "trips/Zo\u00eb%20at%20night"]
    assert all(not any(c.isspace() for c in i) for i in corpus.image_ids)
    paths = [corpus.image(r).url for r in range(corpus.num_images)]
    assert paths == ["broken.png", "empty.jpeg", "people/Grace Hopper.jpg", "trips/2019 summer/beach\tday 100%.png",
                     "trips/Zo\u00eb at night.GIF"]
    for image_id, path in zip(corpus.image_ids, paths):
        assert path_of_image_id(image_id) == path.rsplit(".", 1)[0]
    assert corpus.image(2).image == _png() and corpus.image(4).image == _gif() and corpus.image(1).image == b""
    # Reversible: a name that looks encoded stays apart from the name it would decode to.
    assert image_id_of_path("a%20b") == "a%2520b" != image_id_of_path("a b") == "a%20b"
    assert image_id_of_path("plain/name-1_x.y") == "plain/name-1_x.y"


def test_an_images_lists_booleans_and_nulls_read_alike_from_jsonl_and_parquet(tmp_path):
    """Fields as archives export them (issue 61): a list of strings, a boolean, a date with an offset, a null; a
    parquet file's list and bool columns (null where a row has none) read as the JSONL's."""
    rows = [{"id": "a", "bytes": "", "tags": ["news", "sport"], "featured": True, "date": "2020-06-30T21:00-04:00"},
            {"id": "b", "bytes": "", "tags": None, "featured": False, "date": None}]
    from_jsonl = [img.fields for img in read_images(_jsonl(tmp_path / "images.jsonl", rows))]
    assert from_jsonl == [{"tags": ["news", "sport"], "featured": True, "date": "2020-06-30T21:00-04:00"},
                          {"featured": False}]
    parquet_rows = [{**r, "bytes": b""} for r in rows]
    pq.write_table(pa.Table.from_pylist(parquet_rows), tmp_path / "images.parquet")
    assert [img.fields for img in read_images(tmp_path / "images.parquet")] == from_jsonl
