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


def test_the_papers_rows_drop_unseen_entities_and_the_rows_beyond_follow_the_config(config, tmp_path):
    """Issue 29: the paper drops query entities its index never saw, so Table 3's and Table 4's rows run with
    retrieval.unknown_entities='ignore' whatever the config says; the rows beyond the paper keep the config's rule."""
    from cfir_jax.eval.comparison import k_rows

    config.retrieval.unknown_entities = "search"
    for row in (*TABLE3, *k_rows((4, 8))):
        assert row.config(config).retrieval.unknown_entities == "ignore", row.name
    _store(tmp_path, "image_text")
    fused = comparison_rows(config, tmp_path)[len(TABLE3)]
    assert fused.config(config).retrieval.unknown_entities == "search"
    assert single_row("cfir").config(config).retrieval.unknown_entities == "search"


def test_the_unknown_entities_line_counts_what_each_rule_did():
    from cfir_jax.retrieve.report import EvalRow, eval_table, unknown_rules_line
    from cfir_jax.retrieve.results import Result

    results = [Result("a", (), ("A", "B", "C"), ("C",)), Result("b", (), ("D",)),
               Result("c", (), ("E", "F"), ("E", "F"))]
    line = unknown_rules_line({"ignore": (results, ["entities only", "full CFIR"]),
                               "search": (results, ["CFIR + image text"])})
    assert "\n" not in line
    assert line.startswith("unknown query entities: 3 of 6 (50.0%), in 2 of 3 topics; ")
    assert "ignore: 3 dropped in entities only, full CFIR" in line
    assert "search: 3 searched over the cache in CFIR + image text" in line
    metrics = dict.fromkeys(("mrr@10", "recall@10", "recall@100", "recall@1000", "success@1000"), 0.5)
    table = eval_table([EvalRow("entities only", metrics, results, "m", unknown_rule="ignore", no_hits=2)])
    head, _, body = table.splitlines()
    assert "unseen entities" in head and "no hits" in head
    cells = body.split()
    assert "ignore" in cells and cells[cells.index("ignore") + 1] == "2"
