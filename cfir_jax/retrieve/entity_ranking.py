"""Entity ranking (ER): a document's entities -> their candidate lists from the entity index -> the candidate union.

Entities the index has never seen are dropped (`retrieval.unknown_entities="ignore"`, the paper) or encoded by the
frozen entity encoder and searched over the cache at query time (`"search"`, the default: no entity is lost). With
`retrieval.entity_text_match` each known entity's list also holds the images whose own text names it. A document
with no usable entity has no union: the method falls back to the whole cache (`cfir_jax.retrieve.methods`). The
entity-only baseline ranks the union by each image's best entity score (`entity_only_ranking`). Removed images never
enter a list (stored, text-matched or searched), so neither the union nor any method built on it returns one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import REFERENCE
from cfir_jax.nlp import entity_workers
from cfir_jax.nlp.entities import EntityExtractor, load_spacy
from cfir_jax.nlp.entity_workers import EntityWorkers, Settings
from cfir_jax.search.knn import ScannSearcher, drop_padding, search_with_tail
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.search.topk import best_first, unique_sorted
from cfir_jax.stores.integrity import check_embeddings

Ranked = tuple[np.ndarray, np.ndarray]  # (scores [k'], cache rows [k'])


class EntityRanking:
    """Candidate lists of entities. stores: the opened `Stores` (entity index, encoder, text matches);
    exact_search(queries [Q, D], k, live) -> (scores, rows) [Q, k']: the whole-cache search of the rows `live` for
    unseen entities when the index kept no ScaNN searcher (`Scoring.exact_search`)."""

    def __init__(self, config, stores, exact_search: Callable[[np.ndarray, int, LiveRows], Ranked]):
        self.config, self.rcfg = config, config.retrieval
        self.index, self.encoder, self.text_match = stores.entity_index, stores.entity_encoder, \
            stores.extra.get("entity_text_match")
        self.embeddings = stores.embeddings
        self.encoder_dir = stores.encoder_dir or stores.layout.encoder
        self._exact_search = exact_search
        self._nlp = None
        self._pool = None
        self._serving: EntityWorkers | None = None  # a service's workers (`parse_with`)
        # Loaded now, with the index: a later update that replaces the index directory cannot pair this index's
        # lists with another version's tree. It covers cache rows [0, searcher_rows); rows appended since are
        # searched exactly, and removed rows are never returned (`search_with_tail`).
        self._searcher = ScannSearcher.load(self.index.searcher_dir()) \
            if self.rcfg.unknown_entities == "search" and self.index.manifest.get("has_searcher") else None

    @property
    def searcher(self) -> ScannSearcher | None:
        """The entity index's ScaNN searcher over the cache, when this ranking loaded it (unseen entities searched)."""
        return self._searcher

    def extractor(self):
        """The spaCy entity extractor (loaded on first use), or the pool of one worker a command started to load it
        beside the models (`cfir_jax.nlp.entity_workers.start`: the same pipeline, the same entities)."""
        if self._nlp is None:
            e = self.config.index.entities
            self._nlp = entity_workers.claim(e.spacy_model, e.labels) or \
                EntityExtractor(load_spacy(e.spacy_model or None), e.labels)
        return self._nlp

    def warm_up(self) -> None:
        self.encoder.encode(["warm up"])
        extractor = self.extractor()
        if isinstance(extractor, EntityWorkers):
            extractor.wait_ready()  # its load ran beside the encoders'; a query's time is then the query's

    def workers(self):
        """The persistent spaCy worker processes of bulk retrieval (entity_workers.bulk; started on first use, kept
        for the Retriever's life: a later batch pays no start-up)."""
        if self._pool is None:
            e = self.config.index.entities
            self._pool = EntityWorkers(e.spacy_model, e.labels, Settings.of(self.config, "bulk"))
        return self._pool

    def parse_with(self, pool: EntityWorkers | None) -> None:
        """A service's entity workers (`entity_workers.serve`, one pool per index generation; None: none) parse the
        documents of its batches from now on (`stream`)."""
        self._serving = pool

    def parse_ahead(self, docs: Sequence, language: Callable[[object], str]) -> None:
        """A service's workers (`parse_with`) start on the entities of `docs` (a request queued behind the batch
        that runs, from any thread) before `stream` asks for them: they parse the next batch while this one is
        encoded, ranked and answered. language(doc): its code (`QueryLanguage.language`); only English documents
        without entities go (the others' entities are their language's NER's), and one whose language is refused
        is left to its own refusal."""
        if self._serving is None or self._serving.degraded:
            return
        texts = []
        for d in docs:
            if d.entities is None:
                try:
                    english = language(d) == REFERENCE
                except CfirError:  # its own refusal comes when its batch admits it
                    continue
                if english:
                    texts.append(d.text)
        if texts:  # in chunks as `ParsedBy`'s: two a worker
            self._serving.ahead(texts, -(-len(texts) // (self._serving.workers * entity_workers.PIPELINE_DEPTH)))

    def give_up_ahead(self, docs: Sequence) -> None:
        """What `parse_ahead` handed the service's workers for `docs` is given up (their request will never run)."""
        if self._serving is not None:
            self._serving.give_up([d.text for d in docs if d.entities is None])

    def stream(self, docs: Sequence) -> Iterator[list[str]]:
        """The entities of each document in order, lazily. A service's workers (`parse_with`) parse any two or more
        (or one they parsed ahead: `parse_ahead`), starting now if not before, while the caller encodes them
        (`Retriever`: summaries and queries before entities); bulk retrieval's (entity_workers.bulk > 1) parse ahead
        of encoding and SR when many need them (at least two retrieval batches); else this thread parses them with
        one spaCy nlp.pipe."""
        missing = [d.text for d in docs if d.entities is None]
        found: Iterator[list[str]] = iter(())
        if missing:
            workers = int(self.config.entity_workers.bulk)
            if self._serving is not None and not self._serving.degraded and \
                    (len(missing) >= 2 or self._serving.parsed_ahead(missing)):
                found = ParsedBy(self._serving, missing, lambda rest: self.extractor().extract(rest))
            elif len(missing) >= 2 * self.rcfg.batch_size and workers > 1:
                found = self.workers().stream(missing, max(1, self.rcfg.batch_size // workers))
            else:
                found = self.extractor().extract(missing)
        return Entities(docs, found)

    def encode_unseen(self, entities: Sequence[Sequence[str]]) -> dict[str, np.ndarray]:
        """The embeddings [D] of the entities the index has never seen, of every document of a batch at once, where
        they are searched (`retrieval.unknown_entities="search"`; else none): the encoder runs batches of a fixed
        size, so one call for the batch costs what one document's did."""
        if self.rcfg.unknown_entities != "search":
            return {}
        unseen = list(dict.fromkeys(e for doc in entities for e in doc if self.index.row(e) is None))
        return dict(zip(unseen, self.encoder.encode(unseen)))  # checked where they are searched

    def candidates(self, entities: list[str], live: LiveRows, with_scores: bool = True,
                   encoded: Mapping[str, np.ndarray] | None = None
                   ) -> tuple[list[np.ndarray], list[np.ndarray] | None, list[str], list[str]]:
        """Candidate lists per usable entity, with each list's entity-image scores [k_j] (stored by the index; the
        query-time search's for unseen entities) when with_scores, else None: (lists, scores, used, unknown). Only
        rows of `live` enter a list (the call's rows: removed images and a filter's failing ones never do).
        encoded: the unseen entities' embeddings made for the batch (`encode_unseen`); those missing are encoded
        here."""
        known_rows, known, unknown = [], [], []
        for e in entities:
            r = self.index.row(e)
            if r is None:
                unknown.append(e)
            else:
                known_rows.append(r)
                known.append(e)
        rows_known = np.asarray(known_rows, np.int64)
        lists, scores = self._stored_lists(rows_known, with_scores, live) if known_rows else \
            ([], [] if with_scores else None)
        if self.text_match is not None and known_rows:
            lists, scores = self._with_text_matches(rows_known, lists, scores, live)
        searched: list[str] = []
        if unknown and self.rcfg.unknown_entities == "search":
            found, rows = self._search(unknown, live, encoded or {})
            lists += drop_padding(rows)  # ScaNN may find fewer than K: its padding never reaches the union
            if with_scores:
                scores += [np.asarray(s[r >= 0], np.float32) for s, r in zip(found, np.asarray(rows))]
            searched = unknown
        return lists, scores, known + searched, unknown

    def _stored_lists(self, rows_known: np.ndarray, with_scores: bool, live: LiveRows
                      ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """The index's lists of rows_known (best first) and their scores when with_scores, of live rows only. With
        rows removed, a list is read past the cut (retrieval.k) to its first k live candidates, so that the union
        still holds k per entity where the stored list has them."""
        removed = live.num_removed > 0
        index = self.index.with_k(0) if removed else self.index
        lists = index.candidates(rows_known)
        scores = index.scores(rows_known) if with_scores else None
        if not removed:
            return lists, scores
        k = self.index.k
        if scores is None:
            return [live.keep(c)[:k] for c in lists], None
        pairs = [live.keep(c, s) for c, s in zip(lists, scores)]
        return [c[:k] for c, _ in pairs], [s[:k] for _, s in pairs]

    def _with_text_matches(self, rows_known, lists, scores, live: LiveRows):
        """Matched images the embedding search missed go after the entity's own top-K (its order is kept); their
        entity-image score, which the index never computed, is taken as the list's lowest."""
        extra = [live.keep(np.setdiff1d(m, c).astype(np.int32))
                 for c, m in zip(lists, self.text_match.rows_of(rows_known))]
        if scores is not None:
            scores = [np.concatenate([s, np.full(len(x), s.min() if len(s) else 0.0, np.float32)])
                      for s, x in zip(scores, extra)]
        return [np.concatenate([c, x]) for c, x in zip(lists, extra)], scores

    def _search(self, unknown: list[str], live: LiveRows, encoded: Mapping[str, np.ndarray]) -> Ranked:
        """Unseen entities' top-K live rows over the cache: the index's ScaNN searcher when it kept one (with exact
        search over the rows appended since it was built, removed rows filtered), else exact (which keeps the live
        ones itself). encoded: embeddings made already (`encode_unseen`)."""
        emb = np.stack([encoded[e] for e in unknown]) if all(e in encoded for e in unknown) else \
            self.encoder.encode(unknown)
        check_embeddings(emb, self.encoder_dir, "entity")  # a damaged encoder, named as such
        if self._searcher is not None:
            return search_with_tail(self._searcher, self.embeddings, emb, self.index.k, live.removed)
        return self._exact_search(emb, self.index.k, live)

    def entity_only_ranking(self, lists: list[np.ndarray], used: list[str], k: int) -> Ranked:
        """Entity-only baseline: each candidate scored by its best entity-candidate similarity."""
        rows = np.concatenate(lists) if lists else np.zeros(0, np.int32)
        if not len(rows):
            return np.zeros(0, np.float32), np.zeros(0, np.int32)
        emb = self.encoder.encode(used)
        scores = np.concatenate([np.asarray(self.embeddings[np.asarray(lst)], np.float32) @ emb[j]
                                 for j, lst in enumerate(lists)])
        order = best_first(scores, rows)
        rows, scores = rows[order], scores[order]
        _, first = np.unique(rows, return_index=True)
        keep = np.sort(first)[:k]
        return scores[keep], rows[keep]


class Entities:
    """Each document's entities in order: its own when given, else the next of `found` (`EntityRanking.stream`).
    `close` gives up what `found` has not answered (a batch that raised before it read them: worker processes
    would otherwise go on with them while the next batch waits)."""

    def __init__(self, docs: Sequence, found: Iterator[list[str]]):
        self._docs, self._found = iter(docs), found

    def __iter__(self) -> Entities:
        return self

    def __next__(self) -> list[str]:
        d = next(self._docs)
        return d.entities if d.entities is not None else next(self._found)

    def close(self) -> None:
        close = getattr(self._found, "close", None)  # a generator, or the pool's Stream; an empty iterator has none
        if close is not None:
            close()


class ParsedBy:
    """texts' entities, in order, parsed by a service's pool, its workers started when this is made, in chunks (two
    per worker: they finish together); those left when a reload closes the pool mid-batch are parsed by `here` (this
    thread)."""

    def __init__(self, pool: EntityWorkers, texts: list[str], here: Callable[[list[str]], Iterator[list[str]]]):
        self._texts, self._here, self._read = texts, here, 0
        self._parsed = pool.stream(texts, -(-len(texts) // (pool.workers * entity_workers.PIPELINE_DEPTH)))
        self._rest: Iterator[list[str]] | None = None

    def __iter__(self) -> ParsedBy:
        return self

    def __next__(self) -> list[str]:
        if self._rest is None:
            try:
                entities = next(self._parsed)
            except entity_workers.PoolClosed:
                self._rest = iter(self._here(self._texts[self._read :]))
            else:
                self._read += 1
                return entities
        return next(self._rest)

    def close(self) -> None:
        self._parsed.close()
        if self._rest is not None and hasattr(self._rest, "close"):
            self._rest.close()


def union_of(lists: list[np.ndarray]) -> np.ndarray | None:
    """The candidate union once, de-duplicated and sorted (the scorers' gathers want sorted ids anyway); None when
    there is no list."""
    return unique_sorted(np.concatenate(lists).astype(np.int32, copy=False)) if lists else None


def brought_by(rows: np.ndarray, lists: list[np.ndarray], used: list[str]) -> list[tuple[str, ...]]:
    """Which entities' lists hold each of rows [k]: binary search in each sorted list (~0.1 ms per 10,000-candidate
    list; Python sets or np.isin cost ~1 ms per list). Rows brought by the same entities share one tuple: a ranking
    has 1,000 rows and a document a few entities, so the tuples are made per pattern, not per row."""
    rows = np.asarray(rows, np.int64)
    members = np.zeros((len(lists), len(rows)), bool)
    for j, lst in enumerate(lists):
        ordered = np.sort(np.asarray(lst, np.int64))
        if len(ordered):  # a list a filter (or removals) emptied brings nothing in
            at = np.minimum(np.searchsorted(ordered, rows), len(ordered) - 1)
            members[j] = ordered[at] == rows
    if not 0 < len(lists) < 63:  # more entities than an int64's bits: a tuple per row
        return [tuple(e for e, m in zip(used, members[:, i]) if m) for i in range(len(rows))]
    codes = (members.T.astype(np.int64) << np.arange(len(lists))).sum(axis=1)  # each row's entities as bits
    made = {c: tuple(e for j, e in enumerate(used) if c >> j & 1) for c in np.unique(codes).tolist()}
    return [made[c] for c in codes.tolist()]
