"""A ranking's hits made when read (`cfir_jax.retrieve.pipeline.Hits`): the same hits, in every way a caller reads
them (index, slice, iteration, equality, pickling, folding, the public result), as the list the pipeline made of all
1,000 before, for any scores, rows and entities."""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfir_jax.retrieve.duplicates import fold
from cfir_jax.retrieve.pipeline import Hits, RankedImage, Retrieval
from cfir_jax.retrieve.results import Result

IDS = [f"img{n}" for n in range(40)]
GROUP = np.array([n // 3 if n % 2 else -1 for n in range(40)])  # odd rows in groups of up to two, even rows alone


@st.composite
def rankings(draw):
    rows = draw(st.lists(st.integers(0, 39), unique=True, max_size=40))
    scores = sorted((draw(st.floats(-1, 1, width=32)) for _ in rows), reverse=True)
    by = [tuple(draw(st.lists(st.sampled_from(["harbour", "bridge", "Ada Lovelace"]), unique=True, max_size=2)))
          for _ in rows]
    return np.asarray(scores, np.float32), np.asarray(rows, np.int32), by


def rows_of(hits) -> list[int]:
    return [h.row for h in hits]


def _eager(scores, rows, by) -> list[RankedImage]:
    """The pipeline's hits before: every one made at once, numpy's values as Python's."""
    return [RankedImage(j + 1, IDS[row], s, row, b)
            for j, (s, row, b) in enumerate(zip(scores.astype(np.float64).tolist(), rows.tolist(), by))]


@settings(max_examples=200, deadline=None)
@given(rankings(), st.integers(-45, 45), st.integers(-45, 45), st.integers(0, 45))
def test_hits_read_in_any_way_are_the_eager_list(ranking, a, b, top):
    hits, eager = Hits(*ranking[:2], IDS, ranking[2]), _eager(*ranking)
    assert len(hits) == len(eager) and list(hits) == eager and hits == eager and hits == Hits(*ranking[:2], IDS,
                                                                                               ranking[2])
    assert hits[a:b] == eager[a:b] and hits[:top] == eager[:top] and hits[::-1] == eager[::-1]
    for at in (a, b, np.int64(a), np.int32(b)):  # numpy's integers index as Python's, a rank stays an int
        if -len(eager) <= at < len(eager):
            assert hits[at] == eager[at] and type(hits[at].rank) is int
        else:
            with pytest.raises(IndexError):
                hits[at]
    assert pickle.loads(pickle.dumps(hits)) == eager and type(pickle.loads(pickle.dumps(hits))) is list
    assert all(type(h.score) is float and type(h.row) is int for h in hits)
    lazy, listed = Retrieval(hits, ["harbour"], [], "s"), Retrieval(eager, ["harbour"], [], "s")
    assert lazy == listed and lazy.hit_rows().tolist() == listed.hit_rows().tolist() == rows_of(eager)
    for limit in (None, top):
        assert fold(lazy, GROUP, limit) == fold(listed, GROUP, limit)
    describe = lambda image_id: (f"caption of {image_id}", "")  # noqa: E731
    assert Result.of("d", lazy, describe, top) == Result.of("d", listed, describe, top)
