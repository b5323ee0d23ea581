"""One shard of the index: rows [lo, hi) of one version of a workdir's image cache, and what a query asks of them.

The cluster service (`cfir_jax.serve.cluster`) splits the cache's N rows into S contiguous ranges. Shard s opens the
workdir's stores as every reader does (memory-mapped: nothing is copied, and only the pages of its own rows are
read for scoring) and answers three questions, each over its rows only:

- `score`: each document's part of its candidate union (the known entities' stored lists, their text matches, and
  the unseen entities' lists the front merged, each cut to [lo, hi) after the removed rows are dropped) scored by
  the same SR as one process (`SRFrontEnd.score_unions`: exact, fused or the two-pass fast scorer, which then
  shortlists on this shard's rows alone), its top-k with scores and which lists brought each hit in;
- `score` without lists: the whole-cache search (CFIR's no-entity fallback, the dense baselines) over its live rows;
- `search`: the unseen entities' exact top-K over its live rows (the front merges the shards' into each list);
- `pictures`: a picture's exact top-k over its live rows (search by picture; the front embeds it and merges).

Its answers merge into the single process's (`cfir_jax.serve.merge`): the whole-cache searches run the blocked
search with the matmul shapes of the whole cache (`exact_topk(..., fixed_block=True)`), so scores are bit-equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ml_collections
import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.entity_ranking import brought_by, union_of
from cfir_jax.retrieve.pipeline import Retriever
from cfir_jax.search.fused import fused_queries
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.search.topk import DEFAULT_BLOCK_SIZE, exact_topk
from cfir_jax.stores import versions

Ranked = tuple[np.ndarray, np.ndarray]  # (scores [k'], rows [k']), best first
IMAGES_ONLY = (1.0, 0.0)


def shard_bounds(num_rows: int, shards: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of `shards` contiguous ranges of num_rows rows, sizes differing by at most one."""
    if shards < 1:
        raise CfirError(f"serve.shards={shards}: use at least 1")
    if shards > num_rows:
        raise CfirError(f"serve.shards={shards} exceeds the {num_rows} rows of the image cache: use at most that")
    edges = [num_rows * s // shards for s in range(shards + 1)]
    return list(zip(edges[:-1], edges[1:]))


@dataclasses.dataclass
class ShardDoc:
    """What one document asks of a shard. query [D] float32 (the method's embedding); known: the document's entities
    the entity index holds (their stored lists are read here); searched: the unseen entities' merged lists (global
    rows; this shard keeps its own); lists empty and searched empty: the whole-cache search."""

    query: np.ndarray
    known: list[str] = dataclasses.field(default_factory=list)
    searched: list[np.ndarray] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ShardAnswer:
    """A shard's top-k of one document: scores [k'] and global rows [k'] best first, for each hit the positions of
    the lists (known, then searched) that hold it, the size of its part of the union (the live rows it searched
    for a whole-cache search), and the version it answered at."""

    scores: np.ndarray
    rows: np.ndarray
    lists_of: list[tuple[int, ...]]
    union_size: int
    version: int


class RowRange:
    """Rows [lo, hi) of a database [N, D] (a np.memmap or `FusedRows`) as a [hi - lo, D] array for `exact_topk`,
    which reads it one slice at a time."""

    def __init__(self, database, lo: int, hi: int):
        self.database, self.lo, self.hi = database, lo, hi
        self.shape, self.dtype, self.ndim = (hi - lo, database.shape[1]), database.dtype, 2

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, _ = s.indices(self.hi - self.lo)
        return np.asarray(self.database[self.lo + start : self.lo + stop])


class ShardIndex:
    """Shard `shard` of `shards` of one version of a workdir, opened for the served methods (read-only, memory-mapped).

    One Retriever per served method opens the stores, all of them under one `versions.reading` (one version for
    every method: a commit between two opens would mix versions); its SR front end scores the union parts, and the
    whole-cache searches run here over [lo, hi)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, shard: int, shards: int,
                 methods: Sequence[str]):
        with versions.reading(workdir) as version:
            self.retrievers = {m: Retriever(config, workdir, method=m, load_nlp=False) for m in methods}
        first = next(iter(self.retrievers.values()))
        self.version = version
        self.num_rows = first.stores.cache.num_images
        self.shard, self.shards = shard, shards
        self.lo, self.hi = shard_bounds(self.num_rows, shards)[shard]
        removed = first.stores.live.removed
        self.live = LiveRows(None if removed is None else removed[self.lo : self.hi], self.hi - self.lo)
        self.top_k = int(config.retrieval.top_k)
        # The whole cache's block shape: every shard's blocked search compiles what one process's does.
        self.block = min(DEFAULT_BLOCK_SIZE, self.num_rows)

    def warm_up(self, max_batch: int) -> None:
        """Compiles the whole-cache search of each method at every power-of-two batch size up to max_batch (what a
        front's batch sends), before this version answers."""
        sizes = sorted({min(1 << n, max_batch) for n in range(max(1, max_batch).bit_length() + 1)})
        for method, retriever in self.retrievers.items():
            dim = retriever.embeddings.shape[1]
            for size in sizes:
                self.score(method, [ShardDoc(np.zeros(dim, np.float32)) for _ in range(size)], self.top_k)

    def describe(self) -> dict:
        return {"shard": self.shard, "rows": [self.lo, self.hi], "live_rows": self.live.num_live,
                "version": self.version}

    # ------------------------------------------------------------------------------------ searches over [lo, hi)
    def own_search(self, retriever: Retriever, queries: np.ndarray, k: int, weights=IMAGES_ONLY) -> Ranked:
        """Exact top-k over this shard's live rows, queries [Q, D] -> (scores, global rows) [Q, k'], as
        `SRFrontEnd.exact_search` searches the whole cache (the same rows and weights: a fused retriever's image-only
        search scores the images alone)."""
        sr = retriever.sr
        rows = sr.embeddings
        if sr.fused and weights != IMAGES_ONLY:
            queries, rows = fused_queries(queries, *weights), sr.rows
        view = RowRange(rows, self.lo, self.hi)

        def search(fetch: int) -> Ranked:  # rows of the view: the shard's live rows are numbered from lo
            return exact_topk(np.asarray(queries, np.float32), view, min(fetch, len(view)), block_size=self.block,
                              fixed_block=True)

        scores, local = self.live.search(search, k)
        return scores, np.where(local >= 0, local + self.lo, -1).astype(np.int32)

    def search(self, embeddings: list[np.ndarray], k: int) -> list[Ranked]:
        """The unseen entities' exact top-k over this shard's live rows, one [U_i, D] matrix per document (searched
        one document at a time, as one process searches a document's unseen entities together)."""
        retriever = self._entity_retriever()
        return [self.own_search(retriever, e, k) for e in embeddings]

    def pictures(self, query: np.ndarray, k: int) -> Ranked:
        """A picture's exact top-k over this shard's live rows, the images alone (search by picture), query [D] ->
        (scores [k'], global rows [k'])."""
        retriever = next(iter(self.retrievers.values()))  # every method reads the one image cache
        scores, rows = self.own_search(retriever, np.asarray(query, np.float32)[None], k)
        return scores[0], rows[0]

    def _entity_retriever(self) -> Retriever:
        for r in self.retrievers.values():
            if r.entities is not None:
                return r
        raise CfirError("no served method reads entities on this shard")

    # ----------------------------------------------------------------------------------------------- scoring
    def score(self, method: str, docs: list[ShardDoc], top_k: int) -> list[ShardAnswer]:
        """Each document's top-k of its part of the union (SR of the batch's union parts at once), or of this
        shard's live rows when it has no list (the whole-cache search)."""
        retriever = self.retrievers[method]
        answers: list[ShardAnswer | None] = [None] * len(docs)
        parts, unions, at = [], [], []
        for i, doc in enumerate(docs):
            if retriever.entities is not None and (doc.known or doc.searched):
                lists = self._lists(retriever, doc)
                parts.append(lists)
                unions.append(union_of(lists))
                at.append(i)
            else:
                weights = retriever.fusion if retriever.fused else IMAGES_ONLY
                scores, rows = self.own_search(retriever, doc.query[None], top_k, weights)
                answers[i] = ShardAnswer(scores[0], rows[0], [()] * len(rows[0]), self.live.num_live, self.version)
        full = [n for n, u in enumerate(unions) if len(u)]  # an empty part has no hit here
        for n in range(len(unions)):
            if not len(unions[n]):
                answers[at[n]] = ShardAnswer(np.zeros(0, np.float32), np.zeros(0, np.int32), [], 0, self.version)
        if full:
            queries = np.stack([docs[at[n]].query for n in full]).astype(np.float32)
            scored = retriever.sr.score_unions(queries, [unions[n] for n in full])
            for n, (scores, rows) in zip(full, scored):
                i, lists, union = at[n], parts[n], unions[n]
                scores, rows = scores[:top_k], rows[:top_k]
                members = brought_by(rows, lists, list(range(len(lists))))
                answers[i] = ShardAnswer(np.asarray(scores, np.float32), np.asarray(rows, np.int32), members,
                                         len(union), self.version)
        return answers

    def _lists(self, retriever: Retriever, doc: ShardDoc) -> list[np.ndarray]:
        """The document's candidate lists cut to [lo, hi): the known entities' (stored, removed rows dropped, text
        matches added, exactly as one process forms them) and then the searched ones."""
        lists = []
        if doc.known:
            lists, _, used, unknown = retriever.entities.candidates(doc.known, with_scores=False)
            if unknown:
                raise CfirError(f"entities {unknown} are not in this shard's entity index: the front and the shard "
                                "opened different versions")
        lists = [*lists, *(np.asarray(s, np.int32) for s in doc.searched)]
        return [lst[(lst >= self.lo) & (lst < self.hi)] for lst in (np.asarray(x) for x in lists)]
