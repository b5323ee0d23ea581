"""The --compare rows as data (cfir_jax.eval.comparison): the paper's Table 3 first, each row beyond the paper when
its store exists, overrides applied as dotted keys over the evaluated config."""

import pytest

from cfir_jax.eval.comparison import TABLE3, Row, comparison_rows, single_row


@pytest.fixture
def config():
    from configs.demo import get_config

    return get_config("tiny")


def _store(workdir, name):
    (workdir / name).mkdir()
    (workdir / name / "manifest.json").write_text("{}")


def test_table3_alone_when_the_workdir_has_no_store_beyond_the_paper(config, tmp_path):
    rows = comparison_rows(config, tmp_path)
    assert [r.label for r in rows] == ["document only", "entities only", "summary only", "entities + document",
                                       "full CFIR"]
    assert [r.method for r in rows] == ["dense_document", "entity_only", "dense_summary", "cfir", "cfir"]


def test_rows_beyond_the_paper_follow_their_stores(config, tmp_path):
    for name in ("image_text", "entity_text_match", "reranker"):
        _store(tmp_path, name)
    rows = comparison_rows(config, tmp_path)
    assert [r.label for r in rows[len(TABLE3):]] == ["CFIR + image text", "CFIR + entity text match",
                                                     "CFIR + re-rank"]
    fused = rows[len(TABLE3)].config(config)
    assert (fused.retrieval.fusion.w_img, fused.retrieval.fusion.w_txt) == (1.0, config.retrieval.fusion.compare_w_txt)
    config.retrieval.fusion.w_txt = 0.25  # fusion on: the fused row uses it, and a fused re-ranked row joins
    rows = comparison_rows(config, tmp_path)
    assert rows[len(TABLE3)].config(config).retrieval.fusion.w_txt == 0.25
    assert rows[-1].label == "CFIR + image text + re-rank"
    assert rows[-1].config(config).retrieval.rerank.enabled


def test_the_papers_rows_stay_the_papers_whatever_the_config_says(config, tmp_path):
    config.retrieval.fusion.w_txt = 0.5
    config.retrieval.entity_text_match = True
    config.retrieval.rerank.enabled = True
    for row in TABLE3:
        rcfg = row.config(config).retrieval
        assert (rcfg.fusion.w_img, rcfg.fusion.w_txt, rcfg.entity_text_match, rcfg.rerank.enabled) == \
            (1.0, 0.0, False, False), row.name
    assert config.retrieval.fusion.w_txt == 0.5  # the evaluated config itself is untouched
    assert TABLE3[3].config(config).retrieval.text == "document"


def test_a_row_of_one_more_setting_is_one_line(config):
    """Table 4's K rows later: a row carries any config override (here retrieval.top_k)."""
    row = Row("k100", "cfir", {"retrieval.top_k": 100}, "K = 100")
    assert row.config(config).retrieval.top_k == 100
    assert single_row("entity_only").config(config).to_dict() == config.to_dict()
