"""The AToMiC reader: settings, text assembly, captions, image bytes, and errors on bad input."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from atomic_fixtures import CORRUPT, write_atomic_fixture

from cfir_jax.core.errors import CfirError
from cfir_jax.data.atomic import assemble_text, build_atomic_corpus, image_caption, parquet_files, read_qrels
from cfir_jax.data.corpus import Document, document_text


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return write_atomic_fixture(tmp_path_factory.mktemp("atomic"))


@pytest.fixture(scope="module")
def base(fx, tmp_path_factory):
    return build_atomic_corpus(fx.texts_dir, fx.images_dir, fx.qrels_dir, tmp_path_factory.mktemp("c") / "base")


def _judged(fx, splits):
    return {i for s in splits for _, i in fx.qrels[s]}


def test_small_setting_keeps_only_images_of_the_chosen_split(fx, tmp_path):
    c = build_atomic_corpus(fx.texts_dir, fx.images_dir, fx.qrels_dir, tmp_path / "s", "small", ["validation"])
    assert set(c.image_ids) == _judged(fx, ["validation"]) & set(fx.images)
    assert set(c.doc_ids) == {t for t, _ in fx.qrels["validation"]}
    assert c.splits == ("validation",)


def test_base_setting_takes_images_of_all_splits_but_documents_of_the_chosen_ones(fx, tmp_path):
    c = build_atomic_corpus(fx.texts_dir, fx.images_dir, fx.qrels_dir, tmp_path / "b", "base", ["validation"])
    assert set(c.image_ids) == _judged(fx, ["train", "validation", "test"]) & set(fx.images)
    assert set(c.doc_ids) == {"t3", "t4"}


def test_large_setting_takes_the_whole_image_collection(fx, tmp_path):
    c = build_atomic_corpus(fx.texts_dir, fx.images_dir, fx.qrels_dir, tmp_path / "l", "large", ["test"])
    assert c.image_ids == [f"i{k}" for k in range(10)]  # parquet order is kept
    assert set(c.doc_ids) == {"t5", "t6"}


def test_judgements_on_missing_texts_or_images_are_dropped_and_counted(base):
    assert "t_missing" not in base.qrels("train")
    assert "t6" not in base.qrels("test")
    assert base.manifest["splits"]["train"]["dropped"] == 1
    assert base.manifest["splits"]["test"]["dropped"] == 1
    assert base.qrels("train") == {"t1": {"i0": 1, "i1": 1}, "t2": {"i2": 1}}


def test_text_is_title_section_and_descriptions_joined_skipping_empty_fields(fx, base):
    by_id = {base.document(k).doc_id: base.document(k) for k in range(base.num_documents)}
    assert by_id["t1"].text == "Alpha History Alpha is a town. It was founded in 1900."
    assert by_id["t2"].text == "Beta Beta is a river."  # None section title, empty section description
    assert by_id["t4"].text == "Delta"
    assert by_id["t3"].title == "Gamma"


def test_documents_keep_the_category_media_and_hierachy_lists(fx, base):
    by_id = {base.document(k).doc_id: base.document(k) for k in range(base.num_documents)}
    lists = {k: v for k, v in by_id["t1"].metadata.items() if k in ("category", "media", "hierachy")}
    assert lists == {"category": ("Cat",), "media": ("i1",), "hierachy": ("Top", "History")}
    assert by_id["t2"].metadata["hierachy"] == ("Top",)  # the fixture's None section title: an empty item, dropped


def test_document_fields_select_the_text_the_dense_baselines_read(base):
    """The authors' document model reads page title + section title + section description (no page description);
    their test queries the page title alone; 'all' is the assembled text. Empty fields are skipped."""
    from configs.base import get_config

    by_id = {base.document(k).doc_id: base.document(k) for k in range(base.num_documents)}
    config = get_config()
    t1 = by_id["t1"]
    assert t1.metadata["context_page_description"] == ("Alpha is a town.",)
    assert document_text(t1, config.train.document_fields) == "Alpha History It was founded in 1900."
    assert document_text(t1, config.retrieval.document_fields) == "Alpha"
    assert document_text(t1, "all") == document_text(t1, None) == t1.text
    assert document_text(by_id["t2"], config.train.document_fields) == "Beta"  # no section title or description
    assert document_text(t1, ("context_section_description", "page_title")) == "It was founded in 1900. Alpha"
    with pytest.raises(CfirError, match="document fields \\['body'\\]"):
        document_text(t1, ("body",))
    # A synthetic document has no fields: its whole text. An AToMiC document of a corpus written before the fields
    # were kept (list fields only) is refused in one line.
    assert document_text(Document("s", "a whole text"), ("page_title",)) == "a whole text"
    # (The reader writes all three list fields; a synthetic document's metadata holds its categories alone.)
    old = Document("o", "Alpha History", metadata={"category": ("Cat",), "media": (), "hierachy": ()})
    assert document_text(Document("s", "a whole text", metadata={"category": ("Cat",)}), ("page_title",)) == \
        "a whole text"
    with pytest.raises(CfirError, match="no per-field text.*delete W/corpus"):
        document_text(old, ("page_title",))


def test_caption_falls_back_from_reference_to_alt_text_to_attribution(fx):
    assert image_caption(fx.images["i1"]) == "Second reference"  # first non-empty of the list
    assert image_caption(fx.images["i2"]) == "Alt text only"
    assert image_caption(fx.images["i3"]) == "Attribution only"
    assert image_caption(fx.images["i4"]) == ""


def test_image_bytes_and_urls_pass_through_even_when_corrupt(fx, base):
    by_id = {base.image(k).image_id: base.image(k) for k in range(base.num_images)}
    assert by_id["i3"].image == CORRUPT
    assert by_id["i0"].image == fx.images["i0"]["image"]["bytes"] and by_id["i0"].image[8:12] == b"WEBP"
    assert by_id["i5"].image == b""  # no bytes in the struct
    assert by_id["i0"].url == fx.images["i0"]["image_url"]
    assert by_id["i0"].embedding is None and base.embeddings() is None


def test_assemble_text_skips_none_and_whitespace():
    row = {"page_title": "P", "section_title": "  ", "context_page_description": None,
           "context_section_description": "S"}
    assert assemble_text(row) == "P S"


def test_read_qrels_reads_one_split(fx):
    assert read_qrels(fx.qrels_dir, "validation") == {"t3": {"i3": 1}, "t4": {"i4": 1}}


def test_rebuilding_the_same_corpus_reuses_it(fx, base):
    again = build_atomic_corpus(fx.texts_dir, fx.images_dir, fx.qrels_dir, base.path)
    assert again.manifest["created"] == base.manifest["created"]


def test_missing_directory_is_a_clear_error(fx, tmp_path):
    with pytest.raises(CfirError, match="texts directory not found"):
        build_atomic_corpus(tmp_path / "nope", fx.images_dir, fx.qrels_dir, tmp_path / "o")


def test_directory_without_parquet_files_is_a_clear_error(fx, tmp_path):
    (tmp_path / "empty" / "data").mkdir(parents=True)
    with pytest.raises(CfirError, match="no parquet files found"):
        build_atomic_corpus(fx.texts_dir, tmp_path / "empty", fx.qrels_dir, tmp_path / "o")


def test_missing_column_names_the_column_and_file(fx, tmp_path):
    bad = tmp_path / "texts" / "data" / "train-00000-of-00001-x.parquet"
    bad.parent.mkdir(parents=True)
    pq.write_table(pa.table({"text_id": ["t1"], "page_title": ["x"]}), bad)
    with pytest.raises(CfirError, match=r"train-00000-of-00001-x.parquet: missing column 'section_title'"):
        build_atomic_corpus(bad.parent.parent, fx.images_dir, fx.qrels_dir, tmp_path / "o")


def test_non_parquet_file_is_a_clear_error(fx, tmp_path):
    bad = tmp_path / "q" / "data" / "test-00000-of-00001-x.parquet"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"\x00binary junk")
    with pytest.raises(CfirError, match="not a readable parquet file"):
        read_qrels(tmp_path / "q", "test")


def test_unknown_setting_is_rejected(fx, tmp_path):
    with pytest.raises(CfirError, match="unknown AToMiC setting"):
        build_atomic_corpus(fx.texts_dir, fx.images_dir, fx.qrels_dir, tmp_path / "o", setting="huge")


def test_explicit_parquet_paths_are_accepted(fx):
    files = parquet_files(fx.texts_dir)
    assert parquet_files([str(f) for f in files]) == files
    assert [f.name.split("-")[0] for f in parquet_files(fx.qrels_dir, "validation")] == ["validation"]
