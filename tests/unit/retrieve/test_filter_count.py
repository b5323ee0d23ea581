"""A filter's count is a field of each answer (`Retrieval.passed`, `Result.passed` and `.live`), set where the
filter's note is made (`cfir_jax.retrieve.filters.RowFilter.run`), so evaluation reads it and never parses a note."""

from types import SimpleNamespace

import numpy as np

from cfir_jax.builders.image_fields import columns_of
from cfir_jax.core.image_field_types import FieldTypes
from cfir_jax.core.query_rule import conditions
from cfir_jax.retrieve.filters import RowFilter
from cfir_jax.retrieve.pipeline import Retrieval
from cfir_jax.retrieve.results import Result
from cfir_jax.search.live_rows import LiveRows

ROWS = [{"s": "a"}, {"s": "b"}, {"s": "a"}, {"s": "c"}, {"s": "a"}]


def _filter(removed=None) -> RowFilter:
    stores = SimpleNamespace(live=LiveRows(removed, len(ROWS)))
    rows = RowFilter(stores)
    rows._fields = SimpleNamespace(columns=columns_of(ROWS, FieldTypes(None).kinds), num_rows=len(ROWS))
    return rows


def _doc(where=None) -> SimpleNamespace:
    return SimpleNamespace(where=conditions(where))


def _run(rows: RowFilter, docs) -> list[Retrieval]:
    return rows.run(docs, rows.stores.live, lambda part, live: [Retrieval([], [], [], "", note="ranked") for _ in part],
                    lambda note, n: [Retrieval([], [], [], "", note) for _ in range(n)])


def test_each_answer_carries_how_many_images_passed_its_filter_of_the_live_ones():
    removed = np.array([False, False, False, False, True])  # row 4 (an "a") was removed
    docs = [_doc(["s=a"]), _doc(["s in b,c"]), _doc(), _doc(["s=z"])]
    got = _run(_filter(removed), docs)
    assert [r.passed for r in got] == [(2, 4), (2, 4), None, (0, 4)]
    assert got[0].note == "ranked; filtered by s=a: 2 of 4 images pass"  # the words say the same
    result = Result.of("q", got[0], lambda i: ("", ""), 5)
    assert (result.passed, result.live) == (2, 4)
    assert Result.from_json(result.to_json()) == result  # not in the JSON (the note says it), not compared


def test_every_live_image_counts_when_none_was_removed():
    got = _run(_filter(), [_doc(["s!=a"])])
    assert got[0].passed == (2, 5)
