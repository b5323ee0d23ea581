"""The CFIR retrieval pipeline and its baselines, as a library: the Retriever orchestrates small parts.

CFIR: document -> named entities -> the union of their candidate lists from the entity index (entity ranking, ER,
`cfir_jax.retrieve.entity_ranking`) -> the document's summary embedded by the trained text tower -> the union scored
by dot product with the cached image embeddings (summary re-ranking, SR, `cfir_jax.retrieve.sr` over the search
layer `cfir_jax.search`) -> top-k, optionally re-scored by a third stage (`cfir_jax.retrieve.third_stage`).

The parts: the stores, opened and checked once (`cfir_jax.retrieve.stores`); ER, with unknown entities dropped
(`retrieval.unknown_entities="ignore"`, the paper) or searched over the cache at query time (`"search"`), and the
no-entity fallback to the whole cache, which the result's note states; the SR front end (CPU or device, exact or
fast, fused with the image text or not); the third stage; and one small class per method
(`cfir_jax.retrieve.methods`: cfir, dense_document, dense_summary, entity_only; beyond the paper, BM25 over the
images' own text, `cfir_jax.retrieve.lexical`: bm25, cfir_bm25, cfir_bm25_fused). `retrieve` is `retrieve_many`.

SR scores the union exactly, as the paper does (`retrieval.sr="exact"`), or through the compact int8 copy and an
exact re-rank of a shortlist (`"fast"`, ~16x faster at 4M images, top-1000 agreement ~0.9998). Evaluation uses
`retrieval.eval_sr` ("exact" by default); with "fast" it measures the agreement with exact scoring per query
(`Retriever(measure_agreement=True)`, outside the timed region). Every store and the compact copy are opened or
built when the Retriever is constructed, so per-query times measure queries: `entities`, `summary`, `encode`, `er`
(candidate lists and their union), `score` (SR, or the baselines' whole-cache search / entity ranking), `hits`
(which entities brought each hit in), with the third stage `rerank_encode` and `rerank`, with BM25 `lexical`.

Images removed from the collection (`index.py --remove`) are never returned by any method: the stores carry the
live rows (`Stores.live`, `cfir_jax.search.live_rows`); a call's rows (those, narrowed by its filter) are an argument
of each stage, which ER applies where the candidate lists are formed and SR's whole-cache search where its answers
come back; the third stage re-orders SR's live list.

A batch's order is chosen for the cores: summaries and queries are encoded before its entities are read, so the
worker processes that parse them (a service's, `EntityRanking.parse_with`) work meanwhile, and the entities the
index has never seen are encoded once for the whole batch. The module is over 400 lines because the Retriever is one
sequence of stages over a batch, read top to bottom: splitting it would pass its state between modules."""
from __future__ import annotations

import dataclasses
import functools
import operator
import time
from collections.abc import Iterator, Mapping, Sequence

import ml_collections
import numpy as np

from cfir_jax.core.config_check import SR_MODES
from cfir_jax.core.config_upgrade import upgrade
from cfir_jax.core.progress import bar as progress_bar
from cfir_jax.core.query_rule import Condition
from cfir_jax.data.corpus import document_text
from cfir_jax.nlp.summarizer import CachedSummarizer, make_summarizer
from cfir_jax.retrieve.entity_ranking import EntityRanking, brought_by, union_of
from cfir_jax.retrieve.filters import RowFilter
from cfir_jax.retrieve.lexical import LexicalSearch
from cfir_jax.retrieve.methods import METHODS, method_of
from cfir_jax.retrieve.query_language import QueryLanguages
from cfir_jax.retrieve.ranking import Ranking
from cfir_jax.retrieve.sr import SRFrontEnd
from cfir_jax.retrieve.stores import open_stores
from cfir_jax.retrieve.third_stage import ThirdStage
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.stores.convex_fusion import fitted
from cfir_jax.stores.entities import EntityStore
from cfir_jax.stores.integrity import check_embeddings, check_rows, check_scores, row_norm_bound
from cfir_jax.stores.summaries import SummaryStore

__all__ = ["METHODS", "SR_MODES", "DocumentInput", "Hits", "RankedImage", "Retrieval", "Retriever"]


@dataclasses.dataclass
class RankedImage:
    """One image of the ranking, with its cache row (internal: a search answers with `results.Hit`)."""

    rank: int
    image_id: str
    score: float
    row: int  # row of the image cache
    entities: tuple[str, ...] = ()  # the document entities whose candidate lists brought this image in
    duplicates: tuple[str, ...] = ()  # its near-duplicates folded under it (cfir_jax.retrieve.duplicates.fold)


class Hits(Sequence):
    """A ranking's hits, each made when it is read: a search ranks 1,000 images and shows its top_k, so the scores,
    rows and ids stay arrays and a `RankedImage` is made for each hit read (1,000 of them cost about a quarter of a
    service's CPU per document, 1.7 of 7.4 ms, with the collector's passes over them). Equal to a list of the same
    hits; pickled as that list."""

    def __init__(self, scores: np.ndarray, rows: np.ndarray, ids: Sequence[str], by: Sequence[tuple[str, ...]]):
        self.rows = np.asarray(rows, np.int64)  # cache rows, best first (folding reads them without the hits)
        self._scores, self._ids, self._by = np.asarray(scores, np.float64), ids, by

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, at):
        if isinstance(at, slice):
            return [self._hit(j) for j in range(*at.indices(len(self)))]
        at = operator.index(at)  # a numpy integer reads as the int it is (a hit's rank stays an int)
        j = at + len(self) if at < 0 else at
        if not 0 <= j < len(self):
            raise IndexError(at)
        return self._hit(j)

    def _hit(self, j: int) -> RankedImage:
        row = int(self.rows[j])
        return RankedImage(j + 1, self._ids[row], float(self._scores[j]), row, self._by[j])

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, Hits)) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return list, (list(self),)


@dataclasses.dataclass
class Retrieval:
    """One document's ranking by cache row (internal: `Index` alone makes the public `results.Result` of it)."""

    hits: Sequence[RankedImage]  # `Hits` as ranked; a list once folded or re-ranked
    entities: list[str]  # entities found in the document (normalised)
    unknown_entities: list[str]  # of those, the ones the index had not seen
    summary: str
    note: str = ""  # e.g. the fallback taken
    num_candidates: int = 0  # size of the candidate union
    times_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    sr_agreement: float | None = None  # fast SR's top-k overlap with exact scoring (when measured)
    rerank_features: np.ndarray | None = None  # [n, F] of SR's top-n, when the retriever collects them (fitting)
    lexical_added: int = 0  # candidates BM25 added beyond ER's union (cfir_bm25, cfir_bm25_fused)
    lang: str = "en"  # the document's language (stated or found: cfir_jax.retrieve.query_language)
    passed: tuple[int, int] | None = None  # a filter's count: (images that pass it, of the live); None: no filter
    ranked_rows: np.ndarray | None = None  # the union SR scored, kept where the document asks for facets
    facets: tuple[dict, int] | None = None  # (counts, images counted) where asked (cfir_jax.retrieve.facets)

    def hit_rows(self) -> np.ndarray:
        """The hits' cache rows, best first, without making a hit (folding and facets read them)."""
        hits = self.hits
        return hits.rows if isinstance(hits, Hits) else np.array([h.row for h in hits], np.int64)


@dataclasses.dataclass
class DocumentInput:
    """A document to retrieve for; entities/summary given when the index already computed them."""

    text: str
    doc_id: str = "query"
    entities: list[str] | None = None
    summary: str | None = None
    lang: str | None = None  # its language: the corpus', or stated; None: found (cfir_jax.retrieve.query_language)
    where: tuple[Condition, ...] = ()  # only images passing these conditions are ranked (its query's `where`)
    fold: bool = True  # its query's: near-duplicates folded under each one shown (cfir_jax.retrieve.duplicates)
    facets: tuple[str, ...] = ()  # its query's: the fields counted over what it ranked (cfir_jax.retrieve.facets)


class Retriever:
    """Loads the stores of a workdir once; `retrieve(doc)` runs one query, `retrieve_many(docs)` a batch.

    The pipeline under the library's `Index` (the one query core, which makes its records public), every benchmark
    and --compare row: `retrieve_many(docs) -> list[Retrieval]`, `describe_image(image_id) -> (caption, url)`,
    `corpus_documents(split)`; the attributes `config`, `method`, `notes`, `model_used`, `corpus`, `layout`.

    measure_agreement: with fast SR, also score each union exactly (untimed) and record the top-k overlap.
    rerank_features: compute the re-ranker's features of SR's top-N into each Retrieval (fitting the re-ranker).
    scoring: what scores unions and searches the cache (`cfir_jax.retrieve.scoring.Scoring`), made as scoring(rcfg,
    stores, fusion, fused): this process's `SRFrontEnd`, or a Ray front's shards (`cfir_jax.cluster.scoring.ShardedSR`).
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir, method: str = "cfir", load_nlp: bool = True,
                 measure_agreement: bool = False, rerank_features: bool = False, scoring=SRFrontEnd):
        config = upgrade(config)  # a no-op for a workdir config read by cli.workdir_config
        self.config, self.method, self.rcfg = config, method, config.retrieval
        self.methods = method_of(method, self.rcfg)
        self.sr_mode = self.rcfg.sr
        self.notes: list[str] = []  # what the retriever decided that the user should know (printed by retrieve.py)
        cfir = self.methods.cfir  # CFIR, alone or with BM25
        self.fusion = (float(self.rcfg.fusion.w_img), float(self.rcfg.fusion.w_txt))
        self.stores = open_stores(config, workdir, self.methods)  # with the stores the method and options ask for
        self.fused = "image_text" in self.stores.extra and not self.methods.text_convex  # retrieval.fusion asked it
        self.lexical = LexicalSearch(self.rcfg, self.stores.extra["lexical"], self.stores.live,  # BM25, fused or not
                                     config.index.languages, fitted(self.stores.layout, self.methods, self.rcfg)) \
            if self.methods.uses_lexical else None
        self.model_used = self.methods.model_label(self.stores)  # which model scored the queries (--compare)
        if "entity_text_match" in self.stores.extra:
            self.model_used += ", entities matched in image text"
        self.model_used += self.lexical.model_note(self.methods) if cfir and self.methods.uses_lexical else ""
        if self.fused:
            self.model_used += f", fused with image text (w_img={self.fusion[0]:g}, w_txt={self.fusion[1]:g})"
        self.sr = scoring(self.rcfg, self.stores, self.fusion, self.fused)
        self.filters = RowFilter(self.stores)  # where=[...]: the rows a filtered call may return
        self.entities = EntityRanking(config, self.stores, self.sr.exact_search) if self.methods.uses_entities \
            else None
        self.languages = QueryLanguages(config, self.stores.corpus)  # each query's language, and what reads it
        # The largest score an intact store allows (unit queries; rows of the recorded norm), and where rows come from.
        img_norm = row_norm_bound(self.stores.cache.manifest)
        self.score_bound = abs(self.fusion[0]) * img_norm + abs(self.fusion[1]) if self.fused else img_norm
        self.score_stores = f"{self.stores.layout.image_cache}" + \
            (f" or {self.stores.layout.image_text}" if self.fused else "")
        # The device scores exactly whatever retrieval.sr says: only the CPU's fast scorer has an agreement to measure.
        self.measure_agreement = measure_agreement and self.sr_mode == "fast" and self.sr.backend() == "cpu"
        self.third = None  # the third stage, when it runs (re-ranking or collecting its features)
        if cfir and (rerank_features or self.rcfg.rerank.enabled):
            self.third = ThirdStage(self.rcfg, self.stores, self.fusion if self.fused else (1.0, 0.0),
                                    collect=rerank_features)
            self.notes += self.third.notes
            self.model_used += self.third.model_note
        self._summarizer = None
        self._load_nlp = load_nlp
        # what is shown of the images last shown, least recently used out (a service runs for months)
        self._caption = functools.lru_cache(maxsize=max(0, int(self.rcfg.caption_cache)))(
            lambda n: _shown(self.corpus.image(n)))
        self._warm = False
        if cfir:
            self.sr.prepare()  # the compact copy (or the device copy) now (minutes at scale), not in a query's time

    # ------------------------------------------------------------------------------------ the parts' handles
    @property
    def layout(self):
        return self.stores.layout

    @property
    def corpus(self):
        return self.stores.corpus

    @property
    def cache(self):
        return self.stores.cache

    @property
    def embeddings(self):
        return self.stores.cache.embeddings

    @property
    def image_ids(self):
        return self.stores.cache.ids

    @property
    def entity_index(self):
        return self.stores.entity_index

    @property
    def entity_encoder(self):
        return self.stores.entity_encoder

    @property
    def query_encoder(self):
        return self.stores.query_encoder

    @property
    def rerank_encoder(self):
        return self.third.encoder if self.third is not None else None

    @property
    def rerank_feature_names(self) -> tuple[str, ...]:
        return self.third.feature_names

    def rerank_sources(self) -> dict[str, str | None]:
        """What the re-ranker's features are computed from (recorded by a fitted store)."""
        return self.third.sources()

    def sr_backend(self) -> str:
        return self.sr.backend()

    def sr_scorer(self):
        return self.sr.scorer()

    def device_cache(self):
        return self.sr.device_cache()

    def extractor(self):
        return self.entities.extractor()

    def cache_summaries(self, max_entries: int) -> None:
        """Keeps up to `max_entries` query summaries by document hash (the service: serve.summary_cache)."""
        if max_entries > 0 and not isinstance(self.summarizer(), CachedSummarizer):
            self._summarizer = CachedSummarizer(self._summarizer, max_entries)

    def summarizer(self):
        if self._summarizer is None:
            self._summarizer = make_summarizer(self.config, self.rcfg.summarizer or None)
        return self._summarizer

    def retrieve(self, doc: DocumentInput | str) -> Retrieval:
        return self.retrieve_many([doc if isinstance(doc, DocumentInput) else DocumentInput(doc)])[0]

    def retrieve_many(self, docs: Sequence[DocumentInput], progress: bool = False, live: LiveRows | None = None
                      ) -> list[Retrieval]:
        """Runs the method for every document (its language read, its `where` applied first: `retrieve.filters`),
        retrieval.batch_size at a time (stages batched); progress: a bar with documents/s (`core.progress`). live:
        the rows the call may return (None: the version's live rows, `Stores.live`; fewer: folding's refill); each
        document's filter narrows them, and the rows that leaves are an argument of every stage (ER, BM25, SR's
        whole-cache searches)."""
        self._warm_up()
        return self.filters.run(docs, self.stores.live if live is None else live,
                                lambda part, rows: self._retrieve_all(part, progress, rows),
                                lambda note, n: [Retrieval([], [], [], "", note) for _ in range(n)])

    def _retrieve_all(self, docs: Sequence[DocumentInput], progress: bool, live: LiveRows) -> list[Retrieval]:
        docs = self.languages.read(docs, self.entities is not None, self.methods.uses_summary())
        size = max(1, int(self.rcfg.batch_size))
        entities = self.entities.stream(docs) if self.entities is not None else None
        results: list[Retrieval] = []
        try:
            with progress_bar(total=len(docs), unit="doc", desc=f"retrieve ({self.method})",
                              show=None if progress else False) as bar:
                for b0 in range(0, len(docs), size):
                    batch = docs[b0 : b0 + size]
                    results += self._retrieve_batch(batch, entities, live)
                    bar.update(len(batch))
        finally:  # what workers still parse for a call that raised is given up, not left before the next call's
            if entities is not None:
                entities.close()
        return self.languages.annotate(docs, results, self.entities is not None)

    def _retrieve_batch(self, docs: Sequence[DocumentInput], stream: Iterator[list[str]] | None, live: LiveRows
                        ) -> list[Retrieval]:
        """One batch: summaries and encoding batched, then the documents' entities read from `stream` (worker
        processes parse them meanwhile where there are: `EntityRanking.stream`), each document ranked by its method
        (ER, fallbacks) over the rows `live`, then SR of every union of the batch at once, the third stage, and the
        results."""
        t1 = time.perf_counter()
        summaries = self._summaries(docs) if self.methods.uses_summary() else [""] * len(docs)
        t2 = time.perf_counter()
        queries = self.methods.encode(self.stores, docs, summaries)
        if queries is not None:  # a damaged model is named here, before its NaN scores could blame the cache
            check_embeddings(queries, self.stores.model_dir or self.stores.layout.model)
        t3 = time.perf_counter()
        lexical = self.lexical.search_docs(docs, live) if self.methods.uses_lexical else None
        t4 = time.perf_counter()
        entities = [next(stream) if stream is not None else [] for _ in docs]
        entity_s = time.perf_counter() - t4
        per_doc_ms = {"entities": 1e3 * entity_s / len(docs), "summary": 1e3 * (t2 - t1) / len(docs),
                      "encode": 1e3 * (t3 - t2) / len(docs),
                      **({"lexical": 1e3 * (t4 - t3) / len(docs)} if lexical else {})}
        t5 = time.perf_counter()
        encoded = self.entities.encode_unseen(entities) if self.entities is not None else {}
        unseen_ms = 1e3 * (time.perf_counter() - t5) / len(docs)
        ranked = [self._rank_one(entities[i], queries[i] if queries is not None else None, live,
                                 lexical[i] if lexical else None, encoded) for i in range(len(docs))]
        for r in ranked:  # the batch's unseen entities encoded at once: a share of it is each document's ER
            r.times_ms["er"] += unseen_ms
        self._score_unions(queries, ranked)
        for r in ranked if self.methods.dot_scores else ():  # a damaged row scores NaN or far above 1: refused
            check_scores(r.ranked[0], self.score_bound, self.score_stores)
        rerank_ms, features = [{}] * len(docs), [None] * len(docs)
        if self.third is not None:
            ordered = [r.ranked for r in ranked]
            rerank_ms, features = self.third.run(docs, queries, [r.lists for r in ranked],
                                                 [r.scores for r in ranked], ordered)
            for r, order in zip(ranked, ordered):
                r.ranked = order
        self.lexical.fuse_all(ranked, lexical, self.rcfg.top_k, self.methods.convex) \
            if self.methods.lexical_fused else None
        return [self._result(r, entities[i], summaries[i], dict(per_doc_ms, **r.times_ms), rerank_ms[i], features[i],
                             live, bool(docs[i].facets)) for i, r in enumerate(ranked)]

    def _rank_one(self, entities: list[str], query: np.ndarray | None, live: LiveRows, lexical=None,
                  encoded: Mapping[str, np.ndarray] | None = None) -> Ranking:
        """ER (entity methods; with BM25's `lexical` ranking's top M; `encoded`: the batch's unseen entities'
        embeddings) and the method's ranking over the rows `live`; SR left to the batch."""
        t_start = time.perf_counter()
        r = Ranking()
        if self.entities is not None:
            r.lists, r.scores, r.used, r.unknown = self.entities.candidates(entities, live, self.third is not None,
                                                                            encoded)
            r.union = union_of(r.lists)
            if r.union is not None:
                check_rows(r.union, len(self.embeddings), self.stores.layout.entity_index)  # sorted: two numbers
                if self.methods.lexical_candidates:  # no entity: the whole cache is searched, BM25's top M with it
                    r.added, r.union = self.lexical.grow(r.union, lexical)
        elif lexical is not None:
            r.union = np.sort(lexical[1])
        t_er = time.perf_counter()
        r.ranked, r.note = self.methods.rank(self, query, r.lists, r.used, live, lexical)
        r.times_ms = {"er": 1e3 * (t_er - t_start), "score": 1e3 * (time.perf_counter() - t_er)}
        return r

    def _score_unions(self, queries: np.ndarray, ranked: list[Ranking]) -> None:
        """SR of every union of the batch at once (the device scorer pads them into one jitted call); its time is
        shared among them. With measure_agreement, each SR list's overlap with exact scoring, untimed."""
        sr = [r for r in ranked if r.ranked is None]
        if not sr:
            return
        rows = [i for i, r in enumerate(ranked) if r.ranked is None]
        t_sr = time.perf_counter()
        scored = self.sr.score_unions(queries[rows], [r.union for r in sr])
        share = 1e3 * (time.perf_counter() - t_sr) / len(sr)
        for i, r, pair in zip(rows, sr, scored):
            r.ranked = pair
            r.times_ms["score"] += share
            if self.measure_agreement:
                r.agreement = self.sr.agreement(queries[i], r.union, pair[1])

    def _result(self, r: Ranking, entities: list[str], summary: str, times: dict[str, float],
                rerank_ms: dict[str, float], features, live: LiveRows, faceted: bool = False) -> Retrieval:
        t_hits = time.perf_counter()
        scores, rows = r.ranked
        hits = Hits(scores, rows, self.image_ids, brought_by(rows, r.lists, r.used))
        times = dict(times, hits=1e3 * (time.perf_counter() - t_hits), **rerank_ms)
        num = len(r.union) if r.union is not None else live.num_live  # a whole-cache search's rows
        return Retrieval(hits, list(entities), r.unknown, summary, r.note, num + r.added * self.methods.lexical_fused,
                         times, r.agreement, features, r.added, ranked_rows=r.union if faceted else None)

    def _summaries(self, docs: Sequence[DocumentInput]) -> list[str]:
        missing = [i for i, d in enumerate(docs) if d.summary is None]
        made = iter(self.summarizer().summarize([docs[i].text for i in missing]) if missing else [])
        return [next(made) if d.summary is None else d.summary for d in docs]  # the missing, in their order

    def _warm_up(self) -> None:
        """Loads the models and compiles the encoders once, so per-query times measure queries."""
        if self._warm:
            return
        self.methods.warm_up(self.stores)
        if self.methods.uses_summary():
            self.summarizer()
        if self.entities is not None:  # last: spaCy may be loading beside them (cfir_jax.nlp.entity_workers)
            self.entities.warm_up()
        if self.third is not None:
            self.third.warm_up()
        self._warm = True

    def describe_image(self, image_id: str) -> tuple[str, str]:
        """(caption, url) of an image of the corpus ('' when unknown)."""
        return self.shown(image_id)[:2]

    def shown(self, image_id: str) -> tuple[str, str, dict]:
        """(caption, url, own fields) of an image of the corpus, as a hit shows it (`_shown`; unknown: '')."""
        if not hasattr(self, "_corpus_row"):
            self._corpus_row = {i: n for n, i in enumerate(self.corpus.image_ids)}
        n = self._corpus_row.get(image_id)
        return ("", "", {}) if n is None else self._caption(n)

    def corpus_documents(self, split: str) -> list[DocumentInput]:
        """The documents of a qrels split with the entities and summaries the index computed for them."""
        qrels = self.corpus.qrels(split)
        row_of = {d: i for i, d in enumerate(self.corpus.doc_ids)}
        # Stores computed from other documents than the corpus now holds are refused (one line): rerun index.py.
        fp = self.corpus.documents_fingerprint
        entities = EntityStore.open(self.layout.entities, corpus_fingerprint=fp) \
            if self.methods.uses_entities else None
        summaries = SummaryStore.open(self.layout.summaries, corpus_fingerprint=fp) \
            if self.methods.summarizes else None
        # A method that embeds the document reads retrieval.document_fields of it (entities and summaries come from
        # the stores, so the text is read for nothing else).
        fields = self.rcfg.document_fields if self.methods.reads_document() else "all"
        docs = []
        for doc_id in sorted(qrels):
            if doc_id not in row_of:
                continue
            i = row_of[doc_id]
            doc = self.corpus.document(i)
            docs.append(DocumentInput(document_text(doc, fields), doc_id, entities.entities_of(i) if entities else None,
                                      summaries.summary(i) if summaries is not None else None, doc.lang))
        return docs



def _shown(image) -> tuple[str, str, dict]:
    """What a hit shows of an image of the corpus (`cfir_jax.data.corpus.Image`): its caption, url and own fields,
    their nulls left out (a null is no value, docs/filters.md)."""
    return image.caption, image.url, {k: v for k, v in image.fields.items() if v is not None}
