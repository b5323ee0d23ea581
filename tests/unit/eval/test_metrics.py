"""Metrics must equal trec_eval's (through pytrec_eval) on random runs, and hand-checkable cases."""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest
import pytrec_eval

from cfir_jax.core.errors import CfirError
from cfir_jax.eval import metrics
from cfir_jax.eval.metrics import DEFAULT_MEASURES, evaluate, parse_measure

MEASURES = ("mrr@10", "mrr@1", "mrr", "recall@10", "recall@100", "recall@1000", "success@1", "success@1000",
            "ndcg@10", "p@5")
TREC_NAME = {"recall": "recall", "success": "success", "ndcg": "ndcg_cut", "p": "P"}


def _pytrec_values(run, qrels, measures=MEASURES) -> dict[str, dict[str, float]]:
    """Per-topic values computed by trec_eval (pytrec_eval) for our measure names.

    trec_eval has no recip_rank cutoff: MRR@k is recip_rank under -M k, i.e. recip_rank when the first relevant
    rank (1 / recip_rank) is <= k, else 0. Computed here from full-run recip_rank, independently of our ranking.
    """
    params = {"recip_rank"}
    for m in map(parse_measure, measures):
        if m.kind != "mrr":
            params.add(f"{TREC_NAME[m.kind]}.{m.cutoff}")
    raw = pytrec_eval.RelevanceEvaluator(qrels, params).evaluate(run)
    out = {}
    for qid, vals in raw.items():
        out[qid] = {}
        for m in map(parse_measure, measures):
            if m.kind == "mrr":
                rr = vals["recip_rank"]
                keep = m.cutoff is None or (rr > 0 and round(1 / rr) <= m.cutoff)
                out[qid][m.name] = rr if keep else 0.0
            else:
                out[qid][m.name] = vals[f"{TREC_NAME[m.kind]}_{m.cutoff}"]
    return out


def _random_case(seed: int):
    """A run and qrels with score ties, topics missing on each side, rel <= 0 rows, and topics over 1000 hits."""
    rng = np.random.default_rng(seed)
    # Ids differing in case and length, so strcmp tie-breaking is exercised ("D1" < "d1" < "d10").
    vocab = [f"{p}{i}" for p in ("d", "D", "img_") for i in range(700)]
    run, qrels = {}, {}
    for t in range(25):
        qid = f"t{t}"
        in_run, in_qrels = rng.random() < 0.85, rng.random() < 0.85
        if in_run:
            n = int(rng.choice([1, 5, 40, 300, 1200]))
            docs = rng.choice(len(vocab), size=min(n, len(vocab)), replace=False)
            if rng.random() < 0.5:
                scores = rng.integers(0, 4, size=len(docs)).astype(float)  # heavy ties
            else:
                scores = np.round(rng.normal(size=len(docs)), 2)
            run[qid] = {vocab[d]: float(s) for d, s in zip(docs, scores)}
        if in_qrels:
            pool = list(run.get(qid, {})) + [vocab[i] for i in rng.integers(0, len(vocab), 8)]
            judged = rng.choice(len(pool), size=min(len(pool), int(rng.integers(1, 12))), replace=False)
            only_nonrel = rng.random() < 0.15
            qrels[qid] = {
                pool[j]: int(rng.choice([-1, 0])) if only_nonrel else int(rng.choice([-1, 0, 0, 1, 1, 2, 3]))
                for j in judged
            }
    qrels.setdefault("t0", {"d1": 1})
    run.setdefault("t0", {"d1": 0.5, "D1": 0.5})
    return run, qrels


@pytest.mark.parametrize("seed", range(24))
def test_per_topic_values_equal_trec_eval_on_random_runs(seed):
    run, qrels = _random_case(seed)
    want = _pytrec_values(run, qrels)
    got = evaluate(run, qrels, MEASURES).per_query
    assert set(got) == set(want)
    for qid in want:
        for m in MEASURES:
            assert got[qid][m] == pytest.approx(want[qid][m], abs=1e-9), (qid, m)


@pytest.mark.parametrize("seed", range(24, 32))
def test_aggregate_is_trec_eval_mean_over_evaluated_topics(seed):
    run, qrels = _random_case(seed)
    want = _pytrec_values(run, qrels)
    result = evaluate(run, qrels, MEASURES)
    assert result.num_queries == len(want)
    for m in MEASURES:
        assert result.aggregate[m] == pytest.approx(np.mean([v[m] for v in want.values()]), abs=1e-9)


@pytest.mark.parametrize("seed", range(32, 40))
def test_complete_averages_over_all_qrels_topics_like_trec_eval_c(seed):
    run, qrels = _random_case(seed)
    want = _pytrec_values(run, qrels)
    result = evaluate(run, qrels, MEASURES, complete=True)
    # trec_eval -c divides the sum over evaluated topics by the number of qrels topics.
    assert set(result.per_query) == set(qrels)
    for m in MEASURES:
        assert result.aggregate[m] == pytest.approx(sum(v[m] for v in want.values()) / len(qrels), abs=1e-9)


def test_ties_are_broken_by_docid_descending_not_by_given_order():
    qrels = {"q": {"b": 1}}
    for order in (["a", "b", "c"], ["c", "b", "a"], ["b", "a", "c"]):
        run = {"q": [(d, 1.0) for d in order]}
        # trec_eval ranks c, b, a: b is second whatever the given order.
        assert evaluate(run, qrels, ["mrr"]).aggregate["mrr"] == 0.5


def test_uppercase_sorts_below_lowercase_in_ties():
    # strcmp: "B" (0x42) < "a" (0x61) < "b", so descending order is b, a, B.
    run = {"q": {"B": 2.0, "a": 2.0, "b": 2.0}}
    assert evaluate(run, {"q": {"B": 1}}, ["mrr"]).aggregate["mrr"] == pytest.approx(1 / 3)
    assert evaluate(run, {"q": {"b": 1}}, ["mrr"]).aggregate["mrr"] == 1.0


def test_mrr_at_10_counts_rank_10_and_drops_rank_11():
    hits = {f"d{i:02d}": 100.0 - i for i in range(1, 20)}  # d01 ranked 1st ... d19 19th
    assert evaluate({"q": hits}, {"q": {"d10": 1}}, ["mrr@10"]).aggregate["mrr@10"] == pytest.approx(0.1)
    assert evaluate({"q": hits}, {"q": {"d11": 1}}, ["mrr@10"]).aggregate["mrr@10"] == 0.0
    assert evaluate({"q": hits}, {"q": {"d11": 1}}, ["mrr"]).aggregate["mrr"] == pytest.approx(1 / 11)


def test_recall_is_fraction_of_relevant_retrieved_within_cutoff():
    hits = {f"d{i:02d}": 100.0 - i for i in range(1, 20)}
    qrels = {"q": {"d01": 1, "d05": 2, "d15": 1, "d99": 1}}
    result = evaluate({"q": hits}, qrels, ["recall@10", "recall@1000", "success@1", "p@5"])
    assert result.aggregate == pytest.approx({"recall@10": 2 / 4, "recall@1000": 3 / 4, "success@1": 1.0, "p@5": 0.4})


def test_nonpositive_judgments_are_not_relevant():
    run = {"q": {"a": 3.0, "b": 2.0, "c": 1.0}}
    result = evaluate(run, {"q": {"a": 0, "b": -1, "c": 1}}, ["mrr", "recall@1000"])
    assert result.aggregate == pytest.approx({"mrr": 1 / 3, "recall@1000": 1.0})


def test_run_topics_without_qrels_are_ignored_and_missing_run_topics_skipped_by_default():
    run = {"q1": {"a": 1.0}, "extra": {"a": 1.0}}
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}}
    result = evaluate(run, qrels, ["mrr"])
    assert set(result.per_query) == {"q1"} and result.aggregate["mrr"] == 1.0
    complete = evaluate(run, qrels, ["mrr"], complete=True)
    assert complete.per_query["q2"] == {"mrr": 0.0} and complete.aggregate["mrr"] == 0.5


def test_topic_judged_only_nonrelevant_counts_as_zero_like_trec_eval():
    run = {"q1": {"a": 1.0}, "q2": {"a": 1.0}}
    qrels = {"q1": {"a": 1}, "q2": {"a": 0}}
    result = evaluate(run, qrels, ["mrr", "recall@10"])
    assert result.per_query["q2"] == {"mrr": 0.0, "recall@10": 0.0}
    assert result.aggregate["mrr"] == 0.5
    assert set(pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(run)) == {"q1", "q2"}


def test_empty_run_topic_is_treated_as_absent_like_a_file_without_its_lines():
    qrels = {"q1": {"a": 1}, "q2": {"a": 1}}
    result = evaluate({"q1": {"a": 1.0}, "q2": {}}, qrels, ["mrr"])
    assert set(result.per_query) == {"q1"}


def test_ndcg_uses_graded_gains_and_log2_discount():
    run = {"q": {"a": 3.0, "b": 2.0, "c": 1.0}}
    qrels = {"q": {"a": 1, "c": 2}}
    dcg = 1 / math.log2(2) + 2 / math.log2(4)
    ideal = 2 / math.log2(2) + 1 / math.log2(3)
    assert evaluate(run, qrels, ["ndcg@10"]).aggregate["ndcg@10"] == pytest.approx(dcg / ideal)


def test_sequence_and_mapping_runs_give_the_same_result():
    run, qrels = _random_case(7)
    as_pairs = {q: list(reversed(list(h.items()))) for q, h in run.items()}
    assert evaluate(as_pairs, qrels, MEASURES).per_query == evaluate(run, qrels, MEASURES).per_query


def test_trec_eval_measure_spellings_are_accepted_and_keyed_as_given():
    run = {"q": {"a": 2.0, "b": 1.0}}
    result = evaluate(run, {"q": {"b": 1}}, ["recip_rank", "recall.1000", "success_1", "ndcg_cut.10", "P.2"])
    assert result.aggregate["recip_rank"] == 0.5 and result.aggregate["recall.1000"] == 1.0
    assert result.aggregate["success_1"] == 0.0 and result.aggregate["P.2"] == 0.5


def test_default_measures_are_the_atomic_ones():
    result = evaluate({"q": {"a": 1.0}}, {"q": {"a": 1}})
    assert result.measures == DEFAULT_MEASURES
    assert all(result.aggregate[m] == 1.0 for m in DEFAULT_MEASURES)


def test_table_lists_num_q_and_every_measure():
    result = evaluate({"q1": {"a": 1.0}, "q2": {"b": 1.0}}, {"q1": {"a": 1}, "q2": {"a": 1}}, ["mrr@10", "recall@10"])
    text = result.table(per_query=True)
    assert "num_q" in text and "\tall\t2" in text
    assert any(line.split() == ["mrr@10", "all", "0.5000"] for line in text.splitlines())
    assert any(line.split() == ["recall@10", "q2", "0.0000"] for line in text.splitlines())


@pytest.mark.parametrize("name", ["map", "recall@0", "mrr@x", "ndcg"])
def test_unknown_measure_is_a_one_line_error(name):
    with pytest.raises(CfirError, match="measure"):
        evaluate({"q": {"a": 1.0}}, {"q": {"a": 1}}, [name])


def test_nan_score_is_refused():
    with pytest.raises(CfirError, match="NaN"):
        evaluate({"q": {"a": float("nan"), "b": 1.0}}, {"q": {"b": 1}})


def test_duplicate_docid_in_a_pair_list_is_refused():
    with pytest.raises(CfirError, match="twice"):
        evaluate({"q": [("a", 1.0), ("a", 0.5)]}, {"q": {"a": 1}})


def test_no_common_topic_is_a_one_line_error():
    with pytest.raises(CfirError, match="no topic"):
        evaluate({"x": {"a": 1.0}}, {"q": {"a": 1}})


def test_twenty_thousand_topics_of_1000_hits_give_the_planted_ranks():
    """At AToMiC scale: each topic's one relevant image is planted at a drawn rank (beyond 1000: not retrieved), so
    every measure is known from the ranks alone, independently of trec_eval."""
    rng = np.random.default_rng(0)
    names = np.array([f"img{i}" for i in range(100_000)])
    ranks = rng.integers(1, 1300, 20_000)  # 1-based rank of the relevant image; > 1000 is outside the run
    run, qrels = {}, {}
    for q, rank in enumerate(ranks):
        ids = names[rng.choice(len(names), 1001, replace=False)].tolist()
        relevant = ids.pop()  # 1001 distinct names: the relevant one plus 1000 hits
        if rank <= 1000:
            ids[rank - 1] = relevant
        run[f"q{q}"] = dict(zip(ids, np.linspace(1.0, 0.0, 1000).tolist()))  # hit i has rank i + 1
        qrels[f"q{q}"] = {relevant: 1}
    start = time.perf_counter()
    result = evaluate(run, qrels)
    elapsed = time.perf_counter() - start
    found = ranks <= 1000
    want = {"mrr@10": np.mean(np.where(ranks <= 10, 1.0 / ranks, 0.0)), "recall@10": np.mean(ranks <= 10),
            "recall@100": np.mean(ranks <= 100), "recall@1000": np.mean(found), "success@1000": np.mean(found)}
    assert result.num_queries == 20_000
    assert result.aggregate == pytest.approx(want, abs=1e-12)
    assert 0 < want["mrr@10"] and 0.05 < want["recall@100"] < want["recall@1000"] < 0.9  # ranks span the cutoffs
    assert elapsed < 300.0, f"evaluate took {elapsed:.1f} s"


# ------------------------------------------------------------------------------------------ the authors' metric

# Topic A judges two images, B one. A's run ranks both relevant images first and second; B's image is second.
AUTHORS_QRELS = {"A": {"a1": 1, "a2": 1}, "B": {"b1": 1}}
AUTHORS_RUN = {"A": {"a1": 3.0, "a2": 2.0, "x": 1.0}, "B": {"y": 3.0, "b1": 2.0}}


def test_authors_metric_differs_from_trec_eval_on_a_hand_made_case():
    """trec_eval: per text, any relevant image counts (A: 1, B: 1/2 -> MRR 0.75). The authors: one query per qrels
    line, each with only its own image relevant (A/a1: 1, A/a2: 1/2, B/b1: 1/2 -> 2/3)."""
    trec = metrics.evaluate(AUTHORS_RUN, AUTHORS_QRELS, measures=("mrr@10", "recall@10", "success@10"))
    assert trec.aggregate["mrr@10"] == pytest.approx(0.75)
    authors = metrics.authors_measures(AUTHORS_RUN, AUTHORS_QRELS)
    assert authors["num_rows"] == 3
    assert authors["mrr@10"] == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert authors["mrr@10_offset"] == authors["mrr@10"]  # one chunk: the missing offset is 0
    assert authors["recall@10"] == pytest.approx(1.0) == trec.aggregate["recall@10"]
    # B's image outside A's and B's top 1: trec_eval's R@1 is (1/2 + 0) / 2, the authors' hit rate 1/3.
    run1 = {q: dict(sorted(h.items(), key=lambda p: -p[1])[:1]) for q, h in AUTHORS_RUN.items()}
    assert metrics.evaluate(run1, AUTHORS_QRELS, measures=("recall@1",)).aggregate["recall@1"] == pytest.approx(0.25)
    assert metrics.authors_measures(run1, AUTHORS_QRELS)["recall@10"] == pytest.approx(1 / 3)


def test_authors_metric_chunks_drop_the_offset_and_divide_by_one_chunk_too_many():
    # Chunks of 2: [A/a1, A/a2], [B/b1]; 3 // 2 + 1 = 2 chunks, as many as there are.
    m = metrics.authors_measures(AUTHORS_RUN, AUTHORS_QRELS, chunk=2)
    assert m["mrr@10_offset"] == pytest.approx(((1 + 0.5) / 2 + 0.5) / 2)
    # Stage 2 compares B's ranking with the first chunk's first image (a1), which B's run does not hold.
    assert m["mrr@10"] == pytest.approx(((1 + 0.5) / 2 + 0.0) / 2)
    # Chunks of 3: one full chunk, but 3 // 3 + 1 = 2: every measure halved.
    m = metrics.authors_measures(AUTHORS_RUN, AUTHORS_QRELS, chunk=3)
    assert m["recall@1000"] == pytest.approx(0.5) and m["mrr@10_offset"] == pytest.approx(1 / 3)
    # A qrels topic missing from the run scores 0 (it is still a query).
    m = metrics.authors_measures({"A": AUTHORS_RUN["A"]}, AUTHORS_QRELS)
    assert m["recall@1000"] == pytest.approx(2 / 3)
    with pytest.raises(CfirError, match="no relevant line"):
        metrics.authors_measures(AUTHORS_RUN, {"A": {"a1": 0}})


def test_c_on_a_run_with_empty_topics_is_trec_eval_scoring_them_against_an_empty_ranking():
    """trec_eval -c evaluates every qrels topic the run lacks as a topic that retrieved nothing. pytrec_eval is
    trec_eval's code: given such a topic with no hits it scores it that way, so its per-topic values over all qrels
    topics are -c's, and their mean is what --evaluate prints by default (issue 29). Without -c (the old mean) the
    empty topics leave the mean, which is then higher."""
    qrels = {"q1": {"a": 1, "b": 0}, "q2": {"c": 1}, "q3": {"d": 1, "e": 1}, "q4": {"f": 1}}
    run = {"q1": [("b", 3.0), ("a", 2.0)], "q2": [], "q3": [("e", 1.0), ("x", 2.0)]}  # q2 empty, q4 absent
    names = ("mrr@10", "recall@1000", "success@1000")
    trec_names = {"recall.1000", "success.1000", "recip_rank"}
    own = pytrec_eval.RelevanceEvaluator(qrels, trec_names).evaluate(
        {q: {d: s for d, s in run.get(q, [])} for q in qrels})
    assert set(own) == set(qrels) and own["q2"]["recip_rank"] == own["q4"]["recall_1000"] == 0.0
    keys = {"mrr@10": "recip_rank", "recall@1000": "recall_1000", "success@1000": "success_1000"}
    c = evaluate(run, qrels, names, complete=True)
    assert c.num_queries == 4 and c.no_hits == 2
    for name in names:
        assert c.aggregate[name] == pytest.approx(sum(v[keys[name]] for v in own.values()) / 4, abs=1e-12)
    assert c.aggregate["mrr@10"] == pytest.approx((1 / 2 + 0 + 1 / 2 + 0) / 4)
    assert c.aggregate["recall@1000"] == pytest.approx((1 + 0 + 1 / 2 + 0) / 4)
    no_c = evaluate(run, qrels, names)
    assert no_c.num_queries == 2 and no_c.no_hits == 2
    assert no_c.aggregate["mrr@10"] == pytest.approx(1 / 2) and no_c.aggregate["mrr@10"] > c.aggregate["mrr@10"]
    assert re.search(r"^no_hits *\tall\t2$", c.table(), re.M)
    assert metrics.complete_for("trec_eval") and metrics.complete_for("both")
    assert not metrics.complete_for("trec_eval_no_c")
