"""TREC qrels and runs: round trips, trec_eval's ranking in written files, and one-line errors on bad input."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import pytrec_eval

from cfir_jax.core.errors import CfirError
from cfir_jax.eval.trec import read_qrels, read_run, trec_order, write_qrels, write_run


def _rows(path):
    return [line.split() for line in path.read_text().splitlines()]


def test_run_round_trip_keeps_float32_and_double_scores_exactly(tmp_path):
    rng = np.random.default_rng(0)
    run = {
        "q1": dict(zip([f"img{i}" for i in range(50)], rng.random(50).astype(np.float32).tolist())),
        "q2": {"a": 1e-300, "b": -2.5, "c": 0.1 + 0.2, "d": float("inf")},
    }
    write_run(tmp_path / "run.trec", run)
    assert read_run(tmp_path / "run.trec") == run


def test_written_ranks_are_the_ranks_trec_eval_assigns(tmp_path):
    rng = np.random.default_rng(1)
    docs = [f"{p}{i}" for p in ("d", "D", "x_") for i in range(12)]
    scores = rng.integers(0, 3, size=len(docs)).astype(float)  # many ties
    write_run(tmp_path / "run.trec", {"q": list(zip(docs, scores))})
    rows = _rows(tmp_path / "run.trec")
    assert [int(r[3]) for r in rows] == list(range(1, len(docs) + 1))
    run = {"q": dict(zip(docs, scores.tolist()))}
    for qid, _, docid, rank, _, _ in rows:
        # With docid the only relevant document, trec_eval's recip_rank is 1 / (its rank in trec_eval's order).
        rr = pytrec_eval.RelevanceEvaluator({qid: {docid: 1}}, {"recip_rank"}).evaluate(run)[qid]["recip_rank"]
        assert rr == pytest.approx(1 / int(rank)), docid


def test_trec_order_sorts_score_then_docid_descending():
    assert trec_order([("a", 1.0), ("B", 2.0), ("b", 1.0), ("c", 0.0)]) == [
        ("B", 2.0), ("b", 1.0), ("a", 1.0), ("c", 0.0)
    ]


def test_write_run_keeps_only_the_top_max_hits(tmp_path):
    hits = [(f"d{i:04d}", float(i % 7)) for i in range(30)]
    write_run(tmp_path / "run.trec", {"q": hits}, max_hits=10)
    rows = _rows(tmp_path / "run.trec")
    assert [r[2] for r in rows] == [d for d, _ in trec_order(hits)[:10]]


def test_write_run_writes_six_columns_with_the_tag(tmp_path):
    write_run(tmp_path / "run.trec", {"q": {"a": 1.0, "b": 2.0}}, tag="myrun")
    want = [["q", "Q0", "b", "1", "2.0", "myrun"], ["q", "Q0", "a", "2", "1.0", "myrun"]]
    assert _rows(tmp_path / "run.trec") == want


def test_pair_lists_and_mappings_write_the_same_file(tmp_path):
    hits = {"x": 0.5, "y": 0.5, "z": 0.7}
    write_run(tmp_path / "a.trec", {"q": hits})
    write_run(tmp_path / "b.trec", {"q": list(reversed(list(hits.items())))})
    assert (tmp_path / "a.trec").read_text() == (tmp_path / "b.trec").read_text()


def test_read_run_ignores_the_rank_column_comments_and_blank_lines(tmp_path):
    (tmp_path / "run.trec").write_text("# a comment\n\nq Q0 a 7 0.5 t\n  q Q0 b 1 0.9 t\n")
    assert read_run(tmp_path / "run.trec") == {"q": {"a": 0.5, "b": 0.9}}


def test_qrels_round_trip_keeps_nonrelevant_and_negative_judgments(tmp_path):
    qrels = {"t1": {"a": 1, "b": 0}, "t2": {"c": -1, "d": 2}}
    write_qrels(tmp_path / "qrels.txt", qrels)
    assert read_qrels(tmp_path / "qrels.txt") == qrels


def test_read_qrels_accepts_q0_or_0_in_the_iter_column(tmp_path):
    (tmp_path / "qrels.txt").write_text("t1 Q0 a 1\nt1 0 b 0\n")
    assert read_qrels(tmp_path / "qrels.txt") == {"t1": {"a": 1, "b": 0}}


def test_read_qrels_reads_atomic_parquet(tmp_path):
    table = pa.table({"text_id": ["t1", "t1", "t2"], "Q0": ["Q0"] * 3, "image_id": ["i1", "i2", "i1"],
                      "rel": pa.array([1, 0, 1], pa.int64())})
    pq.write_table(table, tmp_path / "validation-00000-of-00001.parquet")
    assert read_qrels(tmp_path / "validation-00000-of-00001.parquet") == {"t1": {"i1": 1, "i2": 0}, "t2": {"i1": 1}}


def test_parquet_qrels_without_image_id_name_the_missing_column(tmp_path):
    pq.write_table(pa.table({"text_id": ["t1"], "rel": [1]}), tmp_path / "q.parquet")
    with pytest.raises(CfirError, match="image_id"):
        read_qrels(tmp_path / "q.parquet")


def test_a_text_file_named_parquet_is_a_one_line_error(tmp_path):
    (tmp_path / "q.parquet").write_text("t1 0 a 1\n")
    with pytest.raises(CfirError, match="parquet"):
        read_qrels(tmp_path / "q.parquet")


@pytest.mark.parametrize("reader", [read_run, read_qrels])
def test_missing_file_is_a_one_line_error(tmp_path, reader):
    with pytest.raises(CfirError, match="not found"):
        reader(tmp_path / "nope.txt")


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n"])
@pytest.mark.parametrize("reader", [read_run, read_qrels])
def test_file_without_records_is_empty(tmp_path, reader, content):
    (tmp_path / "f.txt").write_text(content)
    with pytest.raises(CfirError, match="empty"):
        reader(tmp_path / "f.txt")


@pytest.mark.parametrize("data", [b"q Q0 a 1 0.5 t\n\x00\x01\x02", b"\xff\xfe\x00b\x89PNG"])
def test_binary_file_is_refused(tmp_path, data):
    (tmp_path / "run.trec").write_bytes(data)
    with pytest.raises(CfirError, match="binary|UTF-8"):
        read_run(tmp_path / "run.trec")


def test_wrong_column_count_names_the_line(tmp_path):
    (tmp_path / "run.trec").write_text("q Q0 a 1 0.5 t\nq Q0 b 2 0.4\n")
    with pytest.raises(CfirError, match=r"run.trec:2: 5 columns, expected 6"):
        read_run(tmp_path / "run.trec")
    (tmp_path / "qrels.txt").write_text("t1 0 a 1 extra\n")
    with pytest.raises(CfirError, match=r"qrels.txt:1: 5 columns, expected 4"):
        read_qrels(tmp_path / "qrels.txt")


@pytest.mark.parametrize("score", ["high", "nan", "1_000"])
def test_non_numeric_score_names_the_line(tmp_path, score):
    (tmp_path / "run.trec").write_text(f"q Q0 a 1 0.5 t\nq Q0 b 2 {score} t\n")
    with pytest.raises(CfirError, match=r"run.trec:2: score .* is not a number"):
        read_run(tmp_path / "run.trec")


@pytest.mark.parametrize("rel", ["yes", "1.5"])
def test_non_integer_relevance_names_the_line(tmp_path, rel):
    (tmp_path / "qrels.txt").write_text(f"t1 0 a {rel}\n")
    with pytest.raises(CfirError, match=r"qrels.txt:1: relevance .* is not an integer"):
        read_qrels(tmp_path / "qrels.txt")


def test_duplicate_docid_in_a_run_topic_names_the_line(tmp_path):
    (tmp_path / "run.trec").write_text("q Q0 a 1 0.5 t\nr Q0 a 1 0.5 t\nq Q0 a 2 0.4 t\n")
    with pytest.raises(CfirError, match=r"run.trec:3: docid a appears twice in topic q"):
        read_run(tmp_path / "run.trec")


def test_duplicate_judgment_names_the_line(tmp_path):
    (tmp_path / "qrels.txt").write_text("t1 0 a 1\nt1 0 a 0\n")
    with pytest.raises(CfirError, match=r"qrels.txt:2: docid a judged twice"):
        read_qrels(tmp_path / "qrels.txt")


@pytest.mark.parametrize(
    "run, kwargs, match",
    [
        ({"q": [("a", 1.0), ("a", 2.0)]}, {}, "twice"),
        ({"q": [("a b", 1.0)]}, {}, "whitespace"),
        ({"q": [("", 1.0)]}, {}, "empty"),
        ({"q x": [("a", 1.0)]}, {}, "whitespace"),
        ({"q": [("a", float("nan"))]}, {}, "NaN"),
        ({"q": [("a", "high")]}, {}, "not a number"),
        ({"q": [("a", 1.0)]}, {"tag": "my run"}, "whitespace"),
        ({"q": [("a", 1.0)]}, {"max_hits": 0}, "max_hits"),
    ],
)
def test_write_run_refuses_what_a_trec_file_cannot_hold(tmp_path, run, kwargs, match):
    with pytest.raises(CfirError, match=match):
        write_run(tmp_path / "run.trec", run, **kwargs)


def test_write_qrels_refuses_a_fractional_relevance(tmp_path):
    with pytest.raises(CfirError, match="not an integer"):
        write_qrels(tmp_path / "qrels.txt", {"t": {"a": 0.5}})


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    write_run(tmp_path / "run.trec", {"q": {"a": 1.0}})
    before = (tmp_path / "run.trec").read_text()
    with pytest.raises(CfirError):
        write_run(tmp_path / "run.trec", {"q": {"b": 1.0}, "r": {"a": float("nan")}})
    assert (tmp_path / "run.trec").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.trec"]
