"""Near-duplicates folded at query time (docs/duplicates.md): each group shows its best-ranked member with the others
of the ranking under it, ranks count the shown hits, and the records carry the folded ids through their JSON."""

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cfir_jax.retrieve import report
from cfir_jax.retrieve.duplicates import fold, fold_positions
from cfir_jax.retrieve.pipeline import RankedImage, Retrieval
from cfir_jax.retrieve.results import Hit, Result

# rows 0..7; {2, 5, 7} one group (label 2), {3, 6} another (label 3), -1: removed
GROUP = np.array([0, 1, 2, 3, 4, 2, 3, 2, -1])


def _retrieval(rows) -> Retrieval:
    hits = [RankedImage(n + 1, f"img{r}", 1.0 - n / 8, r, ("e",)) for n, r in enumerate(rows)]
    return Retrieval(hits, ["e"], [], "s", "", len(rows), {})


def test_each_group_shows_its_best_ranked_member_with_the_others_under_it():
    folded = fold(_retrieval([5, 0, 6, 2, 3, 7, 1]), GROUP)
    assert [(h.rank, h.image_id, h.duplicates) for h in folded.hits] == [
        (1, "img5", ("img2", "img7")), (2, "img0", ()), (3, "img6", ("img3",)), (4, "img1", ())]
    assert [h.score for h in folded.hits] == [1.0, 0.875, 0.75, 0.25]  # each shown hit keeps its own score


def test_a_ranking_without_duplicates_is_unchanged():
    plain = _retrieval([0, 1, 4, 2])
    assert fold(plain, GROUP).hits == plain.hits


def test_the_folded_ids_travel_through_the_json_and_older_answers_read_back():
    record = Result.of("doc", fold(_retrieval([5, 0, 2]), GROUP), lambda i: ("", ""), 5)
    answer = json.loads(report.as_json(record, 5))
    assert list(answer["hits"][0]) == ["rank", "image_id", "score", "entities", "caption", "url", "duplicates"]
    assert answer["hits"][0]["duplicates"] == ["img2"] and Result.from_json(answer) == record
    for h in answer["hits"]:
        del h["duplicates"]  # a service of before this key
    assert Result.from_json(answer).hits[0] == Hit(1, "img5", 1.0, "", "", ("e",))


def test_the_page_lists_a_hits_folded_duplicates():
    record = Result.of("doc", fold(_retrieval([5, 0, 2, 7]), GROUP), lambda i: ("", ""), 5)
    page = report.html_page(record, lambda i: b"", 5)
    assert "+2 near-duplicates" in page and "img2" in page and "img7" in page
    assert "near-duplicate" not in report.html_page(Result.of("d", _retrieval([0, 1]), lambda i: ("", ""), 5),
                                                    lambda i: b"", 5)
    assert "img5 (+2 near-duplicates)" in report.table(record, 5)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.integers(0, 11), unique=True, max_size=12),
       labels=st.lists(st.integers(-1, 11), min_size=12, max_size=12))
def test_folding_keeps_every_row_once_and_one_per_group(rows, labels):
    group = np.array(labels)
    kept = fold_positions(rows, group)
    every = sorted(p for shown, others in kept for p in [shown, *others])
    assert every == list(range(len(rows)))  # nothing lost, nothing twice
    shown_labels = [group[rows[p]] for p, _ in kept if group[rows[p]] >= 0]
    assert len(shown_labels) == len(set(shown_labels))  # one shown hit per group
    for shown, others in kept:
        assert all(o > shown and group[rows[o]] == group[rows[shown]] >= 0 for o in others)
    assert [p for p, _ in kept] == sorted(p for p, _ in kept)  # the shown hits keep the ranking's order
