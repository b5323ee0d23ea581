"""Near-duplicates folded at query time: each group of near-identical images (W/duplicates,
`cfir_jax.stores.duplicates`) shows its best-ranked member, the others of the ranking listed under it
(docs/duplicates.md).

`fold_positions` is the one rule, a pure function over a ranking's cache rows; `fold` applies it to the pipeline's
`Retrieval` (ranks renumbered over the shown hits, each hit's folded duplicates' ids in `RankedImage.duplicates`);
`folded` is what every door calls (the library's `Index`, the service's batcher and image search) with the
retriever's stores. Folding happens after ranking, over the whole list the pipeline returned (retrieval.top_k), and
the caller then cuts to its top_k: top_k counts the shown hits.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from cfir_jax.core.errors import StoreError
from cfir_jax.retrieve.pipeline import DocumentInput, RankedImage, Retrieval, Retriever
from cfir_jax.stores.duplicates import Duplicates

log = logging.getLogger(__name__)
_ABSENT = "absent"  # Stores.duplicates when the workdir has no usable store: searches are not folded


def fold_positions(rows: Sequence[int], group: np.ndarray) -> list[tuple[int, list[int]]]:
    """rows [M]: a ranking's cache rows, best first; group [N]: each row's group label (-1: none, as a row outside
    it). Returns, best first, (position of each group's best-ranked row, [positions of its other rows, best
    first])."""
    shown, others = _folded_positions(rows, group)
    return [(p, others.get(p, [])) for p in shown]


def _folded_positions(rows: Sequence[int], group: np.ndarray) -> tuple[list[int], dict[int, list[int]]]:
    """`fold_positions` as the positions shown, best first, and the others of those that fold some: found with
    numpy, as a ranking is 1,000 hits folded for every search."""
    rows = np.asarray(rows, np.int64)
    inside = (rows >= 0) & (rows < len(group))
    labels = np.full(len(rows), -1, np.int64)
    labels[inside] = group[rows[inside]]
    grouped = np.flatnonzero(labels >= 0)
    if not len(grouped):
        return list(range(len(rows))), {}
    # the grouped positions by label and, within a label, best first: a label's first is the one shown
    order = grouped[np.argsort(labels[grouped], kind="stable")]
    starts = np.flatnonzero(np.concatenate([[True], labels[order][1:] != labels[order][:-1]]))
    ends = np.append(starts[1:], len(order))
    others = {int(order[a]): order[a + 1 : b].tolist() for a, b in zip(starts.tolist(), ends.tolist()) if b > a + 1}
    first = np.ones(len(rows), bool)
    first[grouped] = False
    first[order[starts]] = True
    return np.flatnonzero(first).tolist(), others


def fold(retrieval, group: np.ndarray, limit: int | None = None):
    """The `Retrieval` with each group's best-ranked hit shown (ranks 1, 2, ... over the shown hits) and its other
    hits' image ids in its `duplicates`, best first; its first `limit` shown hits only when given (a search shows its
    top_k of the 1,000 it ranked). A hit whose rank and duplicates stay is kept as it is."""
    hits = retrieval.hits
    shown_at, others = _folded_positions(retrieval.hit_rows(), group)
    shown = []
    for n, p in enumerate(shown_at[:limit]):
        h = hits[p]
        if p in others or h.rank != n + 1 or h.duplicates:
            h = RankedImage(n + 1, h.image_id, h.score, h.row, h.entities,
                            tuple(hits[q].image_id for q in others.get(p, ())))
        shown.append(h)
    return dataclasses.replace(retrieval, hits=shown)


def prepare(retriever: Retriever) -> None:
    """Opens the retriever's near-duplicate groups now, where the workdir has them, so that they are of the version
    its other stores were opened at (the caller holds that version's reading), not of one committed later."""
    stores = getattr(retriever, "stores", None)  # a stand-in engine without stores (tests) folds nothing
    if stores is not None and (stores.layout.duplicates / "manifest.json").is_file():
        store_of(stores)


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
            # a StoreError's message is one line (its fix named): logged whole
            log.warning("near-duplicates not folded: %s (index.py --stages duplicates makes it)", e)
            stores.duplicates = _ABSENT
    return None if stores.duplicates is _ABSENT else stores.duplicates


def retrieve_folded(retriever: Retriever, docs: Sequence[DocumentInput], fold_them, top, progress: bool = False
                    ) -> list[Retrieval]:
    """The retriever's rankings of `docs` (`Retriever.retrieve_many`, each under its own conditions), folded when
    `fold_them`, filled up to `top` shown hits (`folded`): what the library's `Index` answers with. A document that
    asks for facets has them counted over its whole ranking first, each group of near-duplicates once where folded
    (`cfir_jax.retrieve.facets`)."""
    raw = retriever.retrieve_many(docs, progress=progress)
    faceted(retriever, raw, [d.facets for d in docs], fold_them)
    return folded(retriever, raw, fold_them, docs, top)


def faceted(retriever: Retriever, retrievals: list[Retrieval], names: Sequence[Sequence[str]],
            fold_them: bool | Sequence[bool]) -> None:
    """Counts each retrieval's facets where its query asks (`names`, each its own), each group of near-duplicates once
    where it is folded (`fold_them`: one for all, or each's) and the workdir has the groups."""
    if not any(names):
        return
    folds = [bool(fold_them)] * len(retrievals) if isinstance(fold_them, bool) else [bool(f) for f in fold_them]
    stores = getattr(retriever, "stores", None)
    store = store_of(stores) if any(folds) and stores is not None else None
    groups = [store.group if f and store is not None else None for f in folds]
    retriever.filters.facets().count_retrievals(names, retrievals, groups)  # cfir_jax.retrieve.facets


def folded(retriever: Retriever, retrievals: list[Retrieval], fold_them: bool | Sequence[bool],
           docs: Sequence[DocumentInput] | None = None, top: int | Sequence[int] = 0) -> list[Retrieval]:
    """What every door calls: `retrievals` folded by the retriever's duplicates store when `fold_them` (one for all,
    or each ranking's own: a service's batch of requests) and the workdir has one, else as they are. With `docs`
    (the documents retrieved) and `top` (the hits to show: one for all, or each's), a ranking that folding left
    shorter than its top, and that the pipeline had cut at retrieval.top_k, is retrieved again with the folded
    images set aside, as a filter sets rows aside (`refilled`), so that many hits show where that many groups
    exist."""
    n = len(retrievals)
    folds = [bool(fold_them)] * n if isinstance(fold_them, bool) else [bool(f) for f in fold_them]
    tops = [int(top)] * n if isinstance(top, int) else [int(t) for t in top]
    stores = getattr(retriever, "stores", None)  # a stand-in engine without stores (tests) folds nothing
    store = store_of(stores) if any(folds) and stores is not None else None
    if store is None:
        return list(retrievals)
    # With docs, the caller shows each ranking's top: the shown hits past it are never made
    out = [fold(r, store.group, tops[i] if docs is not None and tops[i] > 0 else None) if f else r
           for i, (r, f) in enumerate(zip(retrievals, folds))]
    for i, (raw, shown) in enumerate(zip(retrievals, out)):
        if folds[i] and docs is not None and len(shown.hits) < tops[i] and len(raw.hits) >= int(retriever.rcfg.top_k):
            out[i] = refilled(retriever, store.group, docs[i], shown, tops[i])
    return out


def refilled(retriever: Retriever, group: np.ndarray, doc: DocumentInput, shown: Retrieval, top: int,
             rounds: int = 4) -> Retrieval:
    """`shown` (a folded ranking of `doc` short of `top` hits) filled up: the document retrieved again with the
    images folded so far counted as removed for the call (the call's rows, `retrieve_many(..., live=...)`,
    narrowed by the document's own filter), its new ranking folded, each shown hit keeping the duplicates folded
    under it before. At most `rounds` more retrievals; it stops when a ranking brings nothing new."""
    live = retriever.stores.live
    hidden = {d for h in shown.hits for d in h.duplicates}
    for _ in range(rounds):
        rows = live.without([retriever.stores.cache.index_of(i) for i in hidden])
        raw = retriever.retrieve_many([doc], live=rows)[0]
        before = {h.image_id: h.duplicates for h in shown.hits}
        again = fold(raw, group, top)
        hits = [dataclasses.replace(h, duplicates=before.get(h.image_id, ()) + h.duplicates) for h in again.hits]
        new = {d for h in again.hits for d in h.duplicates}
        if len(hits) <= len(shown.hits) and not new - hidden:
            break
        shown, hidden = dataclasses.replace(again, hits=hits, note=shown.note, facets=shown.facets), hidden | new
        # the first note and facets: a filter's count of passing images, not of those left beside the folded ones
        if len(shown.hits) >= top or len(raw.hits) < int(retriever.rcfg.top_k):
            break
    return shown
