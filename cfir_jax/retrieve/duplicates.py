"""Near-duplicates folded at query time: each group of near-identical pictures (W/duplicates,
`cfir_jax.stores.duplicates`) shows its best-ranked member, the others of the ranking listed under it
(docs/duplicates.md).

`fold_positions` is the one rule, a pure function over a ranking's cache rows; `fold` applies it to the pipeline's
`Retrieval` (ranks renumbered over the shown hits, each hit's folded duplicates' ids in `RankedImage.duplicates`);
`folded` is what every door calls (the library's `Index`, the service's batcher and picture search) with the
retriever's stores. Folding happens after ranking, over the whole list the pipeline returned (retrieval.top_k), and
the caller then cuts to its top_k: top_k counts the shown hits.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from cfir_jax.core.errors import StoreError
from cfir_jax.stores.duplicates import Duplicates

log = logging.getLogger(__name__)
_ABSENT = "absent"  # Stores.duplicates when the workdir has no usable store: searches are not folded


def fold_positions(rows: Sequence[int], group: np.ndarray) -> list[tuple[int, list[int]]]:
    """rows [M]: a ranking's cache rows, best first; group [N]: each row's group label (-1: none, as a row outside
    it). Returns, best first, (position of each group's best-ranked row, [positions of its other rows, best
    first])."""
    shown: dict[int, tuple[int, list[int]]] = {}
    out: list[tuple[int, list[int]]] = []
    n = len(group)
    for pos, row in enumerate(rows):
        label = int(group[row]) if 0 <= row < n else -1
        key = label if label >= 0 else -1 - pos  # a row without a group is a group of its own
        if key in shown:
            shown[key][1].append(pos)
        else:
            shown[key] = (pos, [])
            out.append(shown[key])
    return out


def fold(retrieval, group: np.ndarray):
    """The `Retrieval` with each group's best-ranked hit shown (ranks 1, 2, ... over the shown hits) and its other
    hits' image ids in its `duplicates`, best first."""
    hits = retrieval.hits
    kept = fold_positions([h.row for h in hits], group)
    shown = [dataclasses.replace(hits[p], rank=n + 1, duplicates=tuple(hits[q].image_id for q in others))
             for n, (p, others) in enumerate(kept)]
    return dataclasses.replace(retrieval, hits=shown)


def store_of(stores) -> Duplicates | None:
    """The duplicates store of the retriever's `stores` (opened once, held to its image cache), None when the workdir
    has none that follows its cache (an older workdir: said once in the log, searches are not folded)."""
    if stores.duplicates is None:
        try:
            store = Duplicates.open(stores.layout.duplicates)
            if not store.follows(stores.cache):
                raise StoreError(f"{stores.layout.duplicates}: made for another image cache or other removals")
            stores.duplicates = store
        except StoreError as e:
            log.warning("near-duplicates not folded: %s (index.py --stages duplicates makes it)",
                        str(e).splitlines()[0])
            stores.duplicates = _ABSENT
    return None if stores.duplicates is _ABSENT else stores.duplicates


def folded(retriever, retrievals: list, fold_them: bool) -> list:
    """What every door calls: `retrievals` folded by the retriever's duplicates store when `fold_them` (and the
    workdir has one), else as they are."""
    store = store_of(retriever.stores) if fold_them else None
    return [fold(r, store.group) for r in retrievals] if store is not None else list(retrievals)
