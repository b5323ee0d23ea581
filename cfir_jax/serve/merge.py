"""The cluster's front side of retrieval: a document's entities, summary and query embedding here, its union scored by
the shards, and their top-k merged into the single process's answer.

`ClusterRetriever` is the Retriever (an `Engine`, `cfir_jax.retrieve.engine`) with its batch's scoring on the
shards, so the micro-batcher and the HTTP app of the single process serve it unchanged. A batch:

1. entities (spaCy), summaries and query embeddings, batched, by the Retriever's own stages (it also holds the
   entity index's vocabulary, the entity encoder, the corpus and the image ids);
2. unseen entities (`retrieval.unknown_entities="search"`): each shard's exact top-K over its rows, merged here into
   the entity's list, as one process's exact whole-cache search finds it;
3. one call per shard with the whole batch (`ShardDoc`s: query, known entities, merged lists), each answering its
   top-k of its part of the union, or of its rows for a whole-cache search;
4. the merge: every shard's hits by score, ties to the lower row (`merge_ranked`), cut to top_k.

With exact SR the answer equals one process's (ids, order and scores); with fast SR each shard shortlists its own
rows. A search through a ScaNN searcher (an index built with one) is exact here over every shard's rows.

Search by picture (`ShardedPictureSearch`): the picture is embedded here, once, by the vision tower of the model the
front already holds for its queries (a shard holds no model), or an indexed picture's row is read here from the
memory-mapped cache (one row: cheaper than a shard's round trip); each shard answers its exact nearest live rows
and the merge is the one above, so the answer equals one process's exact picture search. Where the config asks for
ScaNN (index.entity_index.backend), the cluster still searches exactly, and its note says so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.image_query import PictureSearch
from cfir_jax.retrieve.methods import NO_ENTITY_NOTE
from cfir_jax.retrieve.pipeline import DocumentInput, Hit, Result, Retriever
from cfir_jax.search.knn import drop_padding
from cfir_jax.search.topk import best_first
from cfir_jax.serve.resident import WARM_TEXT_NO_ENTITY
from cfir_jax.serve.shard import ShardAnswer, ShardDoc
from cfir_jax.stores.integrity import check_embeddings

CLUSTER_METHODS = ("cfir", "dense_document", "dense_summary")


def merge_ranked(scores: Sequence[np.ndarray], rows: Sequence[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best k of several (scores [k_i], rows [k_i]) by score, ties to the lower row (one process's rule:
    `cfir_jax.search.topk`), padding (row -1) dropped: (positions into the concatenation [k'], rows [k'])."""
    s = np.concatenate([np.asarray(x, np.float32) for x in scores]) if scores else np.zeros(0, np.float32)
    r = np.concatenate([np.asarray(x, np.int64) for x in rows]) if rows else np.zeros(0, np.int64)
    valid = np.flatnonzero(r >= 0)
    order = valid[best_first(s[valid], r[valid], k)]
    return order, r[order]


def check_cluster_config(config, methods: Sequence[str]) -> None:
    """One-line refusals of what the cluster does not serve."""
    other = [m for m in methods if m not in CLUSTER_METHODS]
    if other:
        raise CfirError(f"serve.engine=ray answers {', '.join(CLUSTER_METHODS)}, not {', '.join(other)}: drop them "
                        "from serve.methods / --method")
    if config.retrieval.rerank.enabled:
        raise CfirError("serve.engine=ray does not run the third stage: set retrieval.rerank.enabled=false")


class ShardedPictureSearch(PictureSearch):
    """Search by picture on a front: the picture embedded here (PictureSearch's tower), its nearest live rows found
    by every shard over its own rows (exactly) and merged by score, ties to the lower row."""

    def __init__(self, retriever: ClusterRetriever):
        self.client, self.version = retriever.client, retriever.version
        super().__init__(retriever)

    def _searcher(self, backend: str) -> tuple[None, str]:
        if self.wants_scann(backend):
            return None, self.exact_note() + f" (index.entity_index.backend={backend}: the cluster searches its " \
                "shards exactly)"
        return None, self.exact_note()

    def nearest(self, query: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        answers = self.client.pictures(self.version, np.asarray(query[0], np.float32), top_k)
        order, rows = merge_ranked([a[0] for a in answers], [a[1] for a in answers], top_k)
        scores = np.concatenate([np.asarray(a[0], np.float32) for a in answers]) if answers else np.zeros(0)
        return scores[order], rows


class ClusterRetriever(Retriever):
    """One method's retrieval over sharded rows: the Retriever (an `Engine`) whose batches score their candidates on
    the shards. client: the shards (`score(version, method, docs, top_k)` -> per shard a list of ShardAnswer,
    `search(version, embeddings, k)` -> per shard a list of (scores, rows), `pictures(version, query, k)` -> per
    shard (scores, rows)), called with this retriever's version,
    so every shard answers at the version the front has loaded."""

    picture_search = ShardedPictureSearch  # search by picture (`cfir_jax.retrieve.image_query`) on the shards

    def __init__(self, config, workdir: str, method: str, client):
        super().__init__(config, workdir, method=method)
        self.client = client
        self.version = self.stores.version

    def warm_front(self, max_batch: int) -> None:
        """This side warmed at every batch size up to max_batch (entities, summaries, the query encoder, the unseen
        entities' encoder), without a shard call: the shards warm themselves when they load this version. spaCy
        compiles nothing: the document is parsed once."""
        self._warm_up()
        text = self.corpus.document(0).text if len(self.corpus.doc_ids) else WARM_TEXT_NO_ENTITY
        if self.entities is not None:
            next(self.entities.stream([DocumentInput(text, "warm-0")]))
        size = 1
        while True:
            docs = [DocumentInput(text, f"warm-{i}") for i in range(min(size, max_batch))]
            self._front(docs)
            if size >= max_batch:
                break
            size *= 2
        if self.entities is not None and self.rcfg.unknown_entities == "search":
            self.entities.encoder.encode(["warm"])

    def _front(self, docs: Sequence[DocumentInput]):
        """This side of a batch: summaries and query embeddings, and what the shards are asked."""
        t1 = time.perf_counter()
        summaries = self._summaries(docs) if self.methods.uses_summary() else [""] * len(docs)
        t2 = time.perf_counter()
        queries = self.methods.encode(self.stores, docs, summaries)
        check_embeddings(queries, self.stores.model_dir or self.stores.layout.model)
        t3 = time.perf_counter()
        n = len(docs)
        times = {"summary": 1e3 * (t2 - t1) / n, "encode": 1e3 * (t3 - t2) / n}
        return summaries, queries, times

    def _retrieve_batch(self, docs: Sequence[DocumentInput], entities: list[list[str]], entity_s: float
                        ) -> list[Result]:
        """The batch's Results, equal to the Retriever's (exact SR), with the same per-stage times."""
        n = len(docs)
        summaries, queries, times = self._front(docs)
        times["entities"] = 1e3 * entity_s / n
        t3 = time.perf_counter()
        asks, used, unknown = self._ask(entities, queries)
        t4 = time.perf_counter()
        answers = self.client.score(self.version, self.method, asks, int(self.rcfg.top_k))
        t5 = time.perf_counter()
        times.update(er=1e3 * (t4 - t3) / n, score=1e3 * (t5 - t4) / n)
        out = []
        for i in range(n):
            t_hits = time.perf_counter()
            per_shard = [a[i] for a in answers]
            for a in per_shard:
                if a.version != self.version:
                    raise CfirError(f"a shard answered at version {a.version}, not {self.version}")
            hits, size = self._merge(per_shard, used[i])
            lists = bool(asks[i].known or asks[i].searched) and self.entities is not None
            note = NO_ENTITY_NOTE if self.method == "cfir" and not lists else ""
            out.append(Result(hits, list(entities[i]), unknown[i], summaries[i], note, size,
                              dict(times, hits=1e3 * (time.perf_counter() - t_hits))))
        return out

    def _ask(self, entities: list[list[str]], queries: np.ndarray):
        """Per document: what the shards are asked (ShardDoc), the names of its lists in order, its unknown
        entities; the unseen entities' lists merged from every shard's search."""
        asks, used, unknown = [], [], []
        reads = self.entities is not None
        for ents, q in zip(entities, queries):
            known = [e for e in ents if reads and self.entity_index.row(e) is not None]
            unknown.append([e for e in ents if reads and self.entity_index.row(e) is None])
            asks.append(ShardDoc(np.asarray(q, np.float32), known))
            used.append(list(known))
        searching = [i for i, u in enumerate(unknown) if u] if self.rcfg.unknown_entities == "search" else []
        if searching:
            encoder = self.entities.encoder
            embs = []
            for i in searching:
                e = encoder.encode(unknown[i])
                check_embeddings(e, self.stores.encoder_dir or self.stores.layout.encoder, "entity")
                embs.append(e)
            k = self.entity_index.k
            found = self.client.search(self.version, embs, k)
            for j, i in enumerate(searching):
                parts = [shard[j] for shard in found]
                merged = []
                for e in range(len(unknown[i])):
                    _, rows = merge_ranked([p[0][e] for p in parts], [p[1][e] for p in parts], k)
                    merged.append(rows.astype(np.int32))
                asks[i].searched = drop_padding(np.asarray(merged)) if merged else []
                used[i] += unknown[i]
        return asks, used, unknown

    def _merge(self, answers: list[ShardAnswer], used: list[str]) -> tuple[list[Hit], int]:
        """The shards' top-k of one document merged into its hits, and the size of its whole union."""
        order, rows = merge_ranked([a.scores for a in answers], [a.rows for a in answers], int(self.rcfg.top_k))
        scores = np.concatenate([a.scores for a in answers]) if answers else np.zeros(0, np.float32)
        members = [m for a in answers for m in a.lists_of]
        hits = [Hit(j + 1, self.image_ids[int(row)], float(scores[p]), int(row), tuple(used[x] for x in members[p]))
                for j, (p, row) in enumerate(zip(order, rows))]
        return hits, sum(a.union_size for a in answers)


class LocalShards:
    """The shards as objects of this process (tests, the benchmark's reference): the client ClusterRetriever calls."""

    def __init__(self, shards: Sequence):
        self.shards = list(shards)

    def _at(self, version: int):
        for s in self.shards:
            if s.version != version:
                raise CfirError(f"shard {s.shard} holds version {s.version}, not {version}")
        return self.shards

    def score(self, version: int, method: str, docs: list[ShardDoc], top_k: int) -> list[list[ShardAnswer]]:
        return [s.score(method, docs, top_k) for s in self._at(version)]

    def search(self, version: int, embeddings: list[np.ndarray], k: int) -> list:
        return [s.search(embeddings, k) for s in self._at(version)]

    def pictures(self, version: int, query: np.ndarray, k: int) -> list:
        return [s.pictures(query, k) for s in self._at(version)]
