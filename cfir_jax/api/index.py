"""An index opened from Python: `cfir_jax.open(W)` reads the workdir's own config (as `retrieve.py --index W` does)
and returns an `Index` whose `search` answers with the typed records of `cfir_jax.retrieve.results`.

    with cfir_jax.open("demo_work") as index:
        result = index.search(Path("examples/doc.txt"), top_k=5)
        print([(h.id, h.score, h.caption) for h in result.hits])

The stores and models are opened once, when the index is opened (the method named there) or first searched (any
other method), so a search costs what the pipeline's stages cost. The collection's changes (`add`, `remove`,
`compact`) hold the workdir's writer lock, commit a new version and reopen the stores at it on the next search.
Every refusal is the one-line `CfirError` the commands print.

The module is over 400 lines because `Index` is the one query core and the only holder of a Retriever: every door's
verbs (search, check and admit a query, the services' warm-up, evaluation's and the fits' reads) are its methods, so
that no caller reaches through it; a second module would split that one door in two.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from cfir_jax.api import operations as ops
from cfir_jax.core.errors import CfirError
from cfir_jax.core.query_rule import (
    Condition,
    FilterLimits,
    Query,
    check_facets,
    check_id,
    check_lang,
    check_text,
    check_top_k,
    conditions,
)
from cfir_jax.eval import languages
from cfir_jax.retrieve import duplicates, image_query
from cfir_jax.retrieve.lexical import LexicalSearch
from cfir_jax.retrieve.pipeline import DocumentInput, Retrieval, Retriever
from cfir_jax.retrieve.queries import read_documents
from cfir_jax.retrieve.results import Result
from cfir_jax.stores import lexical, versions

__all__ = ["Index", "open"]


def open(workdir: str | os.PathLike, method: str = "cfir", *, config: ops.ConfigLike = None,  # noqa: A001
         **overrides: Any) -> Index:
    """Opens the index of `workdir` for `method`: with the config it was built with (or `config`, a ConfigDict or a
    config file), `overrides` set on it by name: `retrieval__top_k=100` (or `**{"retrieval.top_k": 100}`)."""
    index = Index(ops.config_of(config, workdir if config is None else None, overrides), workdir, method)
    index._retriever()  # a missing or damaged store is said here, not at the first search
    return index


class Index:
    """A workdir's index, opened for searching and changing; a context manager (`with cfir_jax.open(W) as index`).

    It is the one query core: every door (the commands, the library, the services) reads, checks, retrieves and
    makes the `Result` of a query here, and only here is a `Retriever` made, and held: the other doors (the services,
    the fits, evaluation) ask with its verbs (the last group of methods), never for the Retriever. config: a checked
    config (`open` reads it); method: the default method of `search`; evaluation: score as evaluation does, with
    retrieval.eval_sr (exact unless asked otherwise), and with fast SR also score each union exactly and record the
    agreement (`retrieve.py --qrels`, `--evaluate`). The stores open at the first search (`cfir_jax.open` opens them
    at once; a service opens its methods together, `open_methods`).

    What the other doors need of the pipeline: scoring, what scores the unions (a Ray front's shards,
    `cfir_jax.cluster.scoring.ShardedSR.factory`; None: this process's SR); rerank_features, the re-ranker's
    features of SR's top-N in each `retrieve` answer (fitting it); make(config, workdir, method, **options), what
    opens a method's Retriever (None: the `Retriever`; a test's stand-in)."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | os.PathLike, method: str = "cfir", *,
                 evaluation: bool = False, scoring: Callable | None = None, rerank_features: bool = False,
                 make: Callable[..., Retriever] | None = None):
        if evaluation:
            config.retrieval.sr = config.retrieval.eval_sr
        self.config, self.workdir, self.method = config, workdir, method
        self._options = {"measure_agreement": evaluation, "rerank_features": rerank_features,
                         **({"scoring": scoring} if scoring is not None else {})}
        self._make = make
        self._retrievers: dict[str, Retriever] = {}
        self._image_rows: dict[str, int] | None = None  # the corpus' row of each image id (the HTML page)
        self._version = 0

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Lets go of the opened stores and models (a later search opens them again)."""
        self._retrievers.clear()
        self._image_rows = None

    def __repr__(self) -> str:
        return f"Index({os.fspath(self.workdir)!r}, method={self.method!r}, version={self.version})"

    @property
    def version(self) -> int:
        """The version of the workdir this index answers from (W/index.json's; + 1 with every change)."""
        return self._version if self._retrievers else ops.version(self.workdir)

    @property
    def max_top_k(self) -> int:
        """The most hits a search returns: retrieval.top_k (open with retrieval__top_k=N for more)."""
        return int(self.config.retrieval.top_k)

    @property
    def notes(self) -> list[str]:
        """What the retriever of the default method decided that the user should know (the commands print them)."""
        return self._retriever().notes

    @property
    def scored_by(self):
        """How SR scores the unions (`cfir_jax.retrieve.sr.ScoredBy`: its words, and whether fast)."""
        return self._retriever().sr.scored_by()

    def _retriever(self, method: str | None = None) -> Retriever:
        """The pipeline under the index for `method` (opened on first use): `cfir_jax.retrieve.pipeline.Retriever`,
        held here alone."""
        method = method or self.method
        if method not in self._retrievers:
            with versions.reading(self.workdir) as version:  # every store of one version
                retriever = self._open(method)
                image_query.prepare(retriever)  # the image search's stores, of this version too
                duplicates.prepare(retriever)  # and the near-duplicates' groups
            if self._retrievers and version != self._version:  # the workdir changed since: one version for all
                self.close()
            self._retrievers[method], self._version = retriever, version
        return self._retrievers[method]

    def _open(self, method: str) -> Retriever:
        """A method's Retriever over the workdir's stores (the caller holds the version's reading)."""
        if self._make is not None:  # a test's stand-in
            return self._make(self.config, self.workdir, method, **self._options)
        return Retriever(self.config, self.workdir, method, **self._options)

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods open (a service's: those it serves, the default first)."""
        return tuple(self._retrievers)

    def open_methods(self, methods: Sequence[str]) -> int:
        """Opens `methods` together, all of one version of the workdir, with the image search's
        stores of the first, which becomes the default method (a service's served methods); returns the version."""
        with versions.reading(self.workdir) as version:  # nests inside a caller's reading of the same workdir
            opened = {method: self._open(method) for method in methods}
            image_query.prepare(opened[methods[0]])
            for retriever in opened.values():
                duplicates.prepare(retriever)
        self.close()
        self._retrievers, self._version, self.method = opened, version, methods[0]
        return version

    def parse_entities_with(self, pool) -> None:
        """Every open method's documents are parsed for entities by `pool` (a service's `EntityWorkers`; None: in
        the retrieving thread, or bulk retrieval's own workers) while their queries are encoded."""
        for retriever in self._retrievers.values():
            if retriever.entities is not None:
                retriever.entities.parse_with(pool)

    def parse_entities_ahead(self, docs: Sequence[DocumentInput]) -> None:
        """The pool of `parse_entities_with` starts on `docs`' entities before a search asks for them (from any
        thread): a service's request queued behind the batch that runs, parsed while that batch is encoded, ranked
        and answered. Nothing without a pool."""
        for retriever in self._retrievers.values():
            if retriever.entities is not None:
                retriever.entities.parse_ahead(docs, retriever.languages.language)
                return

    def give_up_entities_ahead(self, docs: Sequence[DocumentInput]) -> None:
        """What `parse_entities_ahead` started for `docs` is given up: a request that will never run (withdrawn,
        past its deadline, refused). A chunk of the pool that also holds other documents' texts is kept."""
        for retriever in self._retrievers.values():
            if retriever.entities is not None:
                retriever.entities.give_up_ahead(docs)
                return

    def warm_up(self, warm: Callable[[str], object] | None = None, summary_cache: int = 0) -> None:
        """Readies every open method before a service says it is ready: `warm(method)` runs the shapes it will send
        (`cfir_jax.serve.resident.warm_up`, through this index's verbs), then the methods that summarise keep up to
        `summary_cache` summaries by document hash, then the default method's vision tower is made and run once (no
        request makes it)."""
        for method, retriever in self._retrievers.items():
            if warm is not None:
                warm(method)  # before the summary cache, so each batch size's rows are generated
            if retriever.methods.uses_summary():
                retriever.cache_summaries(summary_cache)
        image_query.warm(self._retriever())

    def image_bytes(self, image_id: str) -> bytes:
        """The encoded bytes of an indexed image (b"" when the corpus has none): the HTML page's images."""
        corpus = self._retriever().corpus
        if self._image_rows is None:
            self._image_rows = {i: n for n, i in enumerate(corpus.image_ids)}
        n = self._image_rows.get(image_id)
        return corpus.image(n).image if n is not None else b""

    def corpus_documents(self, split: str, method: str | None = None) -> list[DocumentInput]:
        """The documents of a qrels split, with the entities and summaries the index computed (`--evaluate`)."""
        return self._retriever(method).corpus_documents(split)

    # ------------------------------------------------------------------------------------------------ searching
    def search(self, text: str | os.PathLike | Query | None = None, *, image: bytes | str | os.PathLike | None = None,
               image_id: str | None = None, top_k: int = 20, id: str | None = None, lang: str | None = None,
               where: Sequence[Any] | None = None, facets: Sequence[str] | None = None) -> Result:  # noqa: A002
        """The images of one document: `text` (a string; or a path, read as `retrieve.py --query` reads it, its
        stem the id; `lang` its language, None: found, docs/languages.md), or of one image: `image` (its bytes, or
        an image file: a path) or `image_id` (the id of an indexed image: never read as a file); or of a `Query`
        (`cfir_jax.core.query_rule`), which also says the method and whether near-duplicates are folded (`fold`,
        on here: each group shows its best-ranked image, the others listed under it, `Hit.duplicates`;
        docs/duplicates.md). where: filters on the images' fields, joined by AND: lines
        (`["date<=2020-06-30", "license in cc-by,cc0"]`, parsed) or `(field, op, value | [values])` triples (taken
        as they are: a value's commas, spaces and quotes are its own; docs/filters.md). id: the query's id in the
        answer (default: a path's stem, else "query"); top_k counts the shown hits; facets: fields whose values are
        counted over every image the query ranked (`Result.facets`, `.ranked`; docs/filters.md). An image search
        with a deadline (a service's) is `search_image`."""
        if isinstance(text, Query):
            query = text  # checked when it was made, whoever made it
        elif isinstance(text, os.PathLike):  # read at this door: its text, its stem the id, its language
            doc = read_documents(text, int(self.config.serve.max_text_bytes), lang=lang)[0]
            query = Query(doc.text, id=id or doc.doc_id, top_k=top_k, lang=doc.lang, where=where, facets=facets)
        else:  # the text, then the rest: the service's order
            text = check_text(text, "text", int(self.config.serve.max_text_bytes)) if text is not None else None
            query = Query(text, image=image, image_id=image_id, id=id, top_k=top_k, lang=lang, where=where,
                          facets=facets)
        self.check(query)
        if query.text is None:
            return self.search_image(query)
        text = check_text(query.text, "text", int(self.config.serve.max_text_bytes))  # a Query made by hand too
        doc = DocumentInput(text, check_id(query.id or "query", "id"), lang=query.lang, where=query.where,
                            fold=query.fold, facets=query.facets)
        return self._answer([doc], [query.top_k], query.method, False)[0]

    def check(self, query: Query) -> None:
        """Every refusal `search(query)` can meet before it runs, against the version this index answers from:
        top_k's range (retrieval.top_k), the method, the language, the filter's size (serve.max_filter_*), its
        fields and their values' types (its mask is kept: the search applies it without reading it again), the
        facets' fields. One line, a `QueryRefused` (its HTTP status), never a traceback."""
        self._check(query.method, query.top_k, query.lang, query.where, query.facets)

    def admit(self, docs: Sequence[DocumentInput], top_k: int, method: str | None = None) -> None:
        """`check` for the documents of one request of `search_documents` (one top_k and method; each document its
        own language, conditions and facets): what a service's batcher asks before the request joins a batch, so
        that a refusal answers that request alone."""
        for doc in docs:
            self._check(method, top_k, doc.lang, doc.where, doc.facets)

    def _check(self, method: str | None, top_k: int, lang: str | None, where: tuple[Condition, ...],
               facets: tuple[str, ...] = ()) -> None:
        self._top(top_k)
        check_lang(lang)
        if where:
            FilterLimits.of(self.config.serve).check(where)
        engine = self._retriever(method)  # an unknown method: one line (retrieve.methods)
        if where:
            engine.filters.check(where)
        if facets:
            engine.filters.facets().check(facets)

    def search_file(self, path: str | os.PathLike, *, jsonl: bool = False, top_k: int = 20,
                    described: int | None = None, lang: str | None = None, where: Sequence[Any] | None = None,
                    fold: bool = True, facets: Sequence[str] | None = None) -> list[Result]:
        """The images of the documents of a file (read before any store opens), by the index's method: one
        plain-text document, its stem the id (`retrieve.py --query`), or JSON lines {"id", "text", "lang"} with
        `jsonl` (`--queries`). described: read the caption and url of the first `described` hits only (the rest feed
        a run file: ids and scores); lang: the language of a document that states none (None: found,
        docs/languages.md); where, facets: as `search`'s; fold: near-duplicates folded (`Query.fold`). A file of
        several documents shows its progress (a bar on a terminal, `cfir_jax.core.progress`)."""
        docs = read_documents(path, int(self.config.serve.max_text_bytes), jsonl=jsonl, lang=lang)
        top = self._top(top_k)  # the texts, then top_k and the filter: the service's order
        conds, counted = conditions(where), check_facets(facets)
        docs = [dataclasses.replace(d, where=conds, fold=fold, facets=counted) for d in docs]
        self.admit(docs[:1], top)  # one filter for all: the first document's check is theirs
        return self._answer(docs, [top] * len(docs), None, len(docs) > 1, described)

    def search_many(self, texts: Sequence[str | os.PathLike], *, top_k: int = 20, method: str | None = None,
                    ids: Sequence[str] | None = None, lang: str | None = None, where: Sequence[Any] | None = None,
                    fold: bool = True, facets: Sequence[str] | None = None) -> list[Result]:
        """The images of each document, retrieved in batches of retrieval.batch_size (entities, summaries, encoding
        and SR batched; several show their progress, a bar on a terminal); ids: the documents' ids (default "0",
        "1", ...; a path's stem for a path); lang: their language (None: each found, docs/languages.md); where,
        fold, facets: as `search`'s."""
        if isinstance(texts, (str, os.PathLike)):
            raise CfirError("search_many takes a list of documents; search takes one")
        ids = [str(n) for n in range(len(texts))] if ids is None else list(ids)
        if len(ids) != len(texts):
            raise CfirError(f"{len(ids)} ids for {len(texts)} documents")
        limit, lang, conds = int(self.config.serve.max_text_bytes), check_lang(lang), conditions(where)
        counted = check_facets(facets)
        docs = [dataclasses.replace(_document(t, i, limit, lang, conds, fold), facets=counted)  # the texts, then top_k:
                for t, i in zip(texts, ids)]
        top = self._top(top_k)  # the service's order
        self.admit(docs[:1], top, method)  # one filter and method for all: the first document's check is theirs
        return self._answer(docs, [top] * len(docs), method, len(docs) > 1)

    def search_documents(self, docs: Sequence[DocumentInput], top_k: int | Sequence[int], method: str | None = None
                         ) -> list[Result]:
        """The images of documents a service's door read and checked (`DocumentInput`s, each with its own `lang`,
        `where` and `fold`; `admit` said their refusals), retrieved as one batch (entities, summaries, encoding and
        SR batched: the micro-batcher's requests together); top_k: the hits of every document, or of each (its
        request's)."""
        tops = [top_k] * len(docs) if isinstance(top_k, int) else list(top_k)
        if len(tops) != len(docs):
            raise CfirError(f"{len(tops)} top_k for {len(docs)} documents")
        return self._answer(docs, [self._top(t) for t in tops], method, False)

    def _answer(self, docs: Sequence[DocumentInput], tops: Sequence[int], method: str | None, progress: bool,
                described: int | None = None) -> list[Result]:
        """The one place a checked query of text is retrieved and made records: every search of text ends here (the
        commands', the library's, the services' batches). Each document carries its query's options (language,
        conditions, folding: `DocumentInput`), applied once, down the pipeline. tops: each document's hits; near-
        duplicates are folded over the whole ranking the pipeline returned, before the cut to its top."""
        retriever = self._retriever(method)
        results = duplicates.retrieve_folded(retriever, docs, [d.fold for d in docs], tops, progress)
        own = _own_fields(retriever)
        return [Result.of(d.doc_id, r, retriever.describe_image, top, self._version, described, own)
                for d, r, top in zip(docs, results, tops)]

    def retrieve(self, docs: Sequence[DocumentInput], method: str | None = None, progress: bool = False,
                 where: Sequence[Any] | None = None, fold: bool = False) -> list[Result]:
        """The records of `docs` with every hit the pipeline ranked (ids, scores, `Result.rows`; SR's agreement, the
        re-ranker's features where collected; no captions read), for evaluation (`retrieve.py --evaluate`), which
        scores every hit and shows none, the fits and a service's warm-up; where: as `search`'s, for every
        document; fold: near-duplicates folded (off: evaluation counts every image, as the paper does)."""
        retriever = self._retriever(method)
        conds = conditions(where)
        if conds:
            docs = [dataclasses.replace(d, where=conds) for d in docs]
            self.admit(docs[:1], 1, method)  # one filter for all: the first document's check is theirs
        found = duplicates.folded(retriever, retriever.retrieve_many(docs, progress=progress), fold)
        return self._records(docs, found, retriever)

    def _records(self, docs: Sequence[DocumentInput], found: Sequence[Retrieval], retriever: Retriever
                 ) -> list[Result]:
        """Every hit of each answer as a record, no caption read (what is measured, not shown)."""
        return [Result.of(d.doc_id, r, retriever.describe_image, len(r.hits), self._version, described=0)
                for d, r in zip(docs, found)]

    def _top(self, top_k: int) -> int:
        return check_top_k(top_k, self.max_top_k)  # the one rule of a query, in the service's words

    def search_image(self, query: Query, deadline: float | None = None) -> Result:
        """Search by image (`cfir_jax.retrieve.image_query.search_image`) over the live rows passing the query's
        conditions: `query.image` is an image's bytes or an image file (within serve.max_image_bytes),
        `query.image_id` the id of an indexed image; the answer's id: the query's, else the indexed image's id,
        the file's stem, or "query". deadline: a time.monotonic() past which the search stops before its next stage
        (a service's). `search` checks the query first; a caller of this checks it with `check`."""
        serve = self.config.serve
        if query.image_id is not None:
            asked, what = {"image_id": query.image_id}, query.image_id
        elif isinstance(query.image, Path):
            asked = {"image": image_query.read_image(query.image, int(serve.max_image_bytes))}
            what = query.image.stem or "query"
        else:
            asked, what = {"image": query.image}, "query"
        retriever = self._retriever(query.method)
        top, fold = query.top_k, query.fold
        stores = getattr(retriever, "stores", None)  # folding shows fewer: fetch enough to fill top after it
        fetched = self.max_top_k if query.facets or (fold and stores is not None and duplicates.store_of(stores)) \
            else top  # facets count what it ranked up to retrieval.top_k
        found = image_query.search_image(retriever, **asked, top_k=fetched, max_pixels=int(serve.max_image_pixels),
                                         deadline=deadline, where=query.where)
        duplicates.faceted(retriever, [found], [query.facets], fold)
        found = duplicates.folded(retriever, [found], fold)[0]
        return Result.of(query.id or what, found, retriever.describe_image, top, self._version,
                         fields=_own_fields(retriever))

    # -------------------------------------------------------------------------------------- changing, checking
    def add(self, path: str | os.PathLike) -> dict[str, int]:
        """Appends the documents and images of `path` (as `index.py --add PATH`) as one new version."""
        return self._changed(ops.add(self.config, self.workdir, path))

    def remove(self, ids: Iterable[str] | str | os.PathLike) -> dict[str, int]:
        """Masks the images and documents `ids` names (the ids; or a file of them, one a line: `index.py
        --remove`) as one new version: no method returns them again."""
        return self._changed(ops.remove(self.config, self.workdir, ids))

    def add_entities(self, path: str | os.PathLike) -> int:
        """Appends the entity texts of `path` (one a line; as `index.py --add-entities PATH`) to the entity index;
        returns how many were new. The next search opens the index again, with them."""
        added = ops.add_entities(self.config, self.workdir, path)
        self.close()
        return added

    def compact(self) -> dict[str, int]:
        """Rewrites the stores without the removed image rows (`index.py --compact`) as one new version."""
        return self._changed(ops.compact(self.config, self.workdir))

    def verify(self) -> ops.Verification:
        """Every store re-read against its recorded checksums (`index.py --verify`)."""
        return ops.verify(self.workdir)

    def _changed(self, change: dict[str, int]) -> dict[str, int]:
        if change.get("version", self._version) != self._version:  # the next search opens the new version
            self.close()
        return change

    # ------------------------------------------------ what the services, the fits and evaluation ask of the pipeline
    def reads_entities(self, method: str | None = None) -> bool:
        """Whether `method` reads a document's entities (a service's entity pool may parse them ahead for it)."""
        return self._retriever(method).entities is not None

    def sample_text(self) -> str | None:
        """The text of the corpus' first document (a warm-up's query that finds entities), None without one."""
        corpus = getattr(self._retriever(), "corpus", None)
        return corpus.document(0).text if corpus is not None and len(corpus.doc_ids) else None

    def warm_scoring(self, max_batch: int, method: str | None = None) -> None:
        """Compiles what SR runs for batches of up to max_batch documents (on the device backend: every bucket)."""
        self._retriever(method).sr.warm_up(max_batch)

    @property
    def model_used(self) -> str:
        """The model that scores the default method's queries, in the evaluation table's words."""
        return self._retriever().model_used

    def trained_by(self) -> Path | None:
        """The training run whose model embeds the default method's queries (its timing log is evaluation's train
        time); None where no trained model does (entity_only, bm25, an untrained index's encoder)."""
        retriever = self._retriever()
        stores, layout = retriever.stores, retriever.layout
        if retriever.method in ("entity_only", "bm25") or stores.untrained:
            return None
        return layout.train_full if stores.full else layout.train_document if stores.document_model else layout.train

    def entity_index_note(self) -> str:
        """How ER searches the entity index as built (exact, or ScaNN with its measured recall); '' without one."""
        entity_index = self._retriever().stores.entity_index
        return entity_index.with_k(0).er_note() if entity_index is not None else ""

    def qrels(self, split: str) -> dict[str, dict[str, int]]:
        """The corpus' relevance judgements of `split` ({document id: {image id: grade}}; one line when it has none)."""
        return self._retriever().corpus.qrels(split)

    def topic_languages(self, topics: Sequence[str]) -> dict[str, str]:
        """Each topic's (a corpus document's) language (`cfir_jax.eval.languages.topic_languages`)."""
        return languages.topic_languages(self._retriever().corpus, topics)

    @property
    def image_ids(self) -> Sequence[str]:
        """The image id of each cache row (a ranking's rows, named)."""
        return self._retriever().image_ids

    def reranker_inputs(self) -> dict[str, Any]:
        """What a fitted re-ranker records of the default method: its feature names (`features`), what they are
        computed from (`sources`), and SR's fusion weights (`sr_fusion`)."""
        retriever = self._retriever()
        return {"features": retriever.rerank_feature_names, "sources": retriever.rerank_sources(),
                "sr_fusion": list(retriever.fusion if retriever.fused else (1.0, 0.0))}

    def bm25_lists(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """BM25's ranking (scores, cache rows) of each text over the live images' own text (W/lexical): what the
        convex fusion of SR and BM25 is fitted against."""
        retriever = self._retriever()
        search = LexicalSearch(retriever.rcfg, lexical.READER.open_for(retriever.stores), retriever.stores.live)
        return search.search_many(list(texts))

    def retrieve_with_unions(self, docs: Sequence[DocumentInput], progress: bool = False
                             ) -> tuple[list[Result], list]:
        """The default method's answers of `docs` (`retrieve`'s records) and what its scorer kept of each document's
        union: (rows, image scores, text scores), None without a usable entity; the image-text fusion's fit re-fuses
        it."""
        retriever = self._retriever()
        scorer = retriever.methods.scorer(retriever.stores)
        scorer.kept = []
        results = retriever.retrieve_many(docs, progress=progress)
        return self._records(docs, results, retriever), scorer.kept


def _document(text: str | os.PathLike, doc_id: str, limit: int, lang: str | None, where: tuple[Condition, ...],
              fold: bool) -> DocumentInput:
    """A query document from a string or a file (read as `retrieve.py --query` reads it), held to the one rule of a
    query's text (`cfir_jax.core.query_rule`, at most serve.max_text_bytes), with its query's language, conditions
    and folding."""
    if isinstance(text, os.PathLike):
        return dataclasses.replace(read_documents(text, limit, lang=lang)[0], where=where, fold=fold)
    return DocumentInput(check_text(text, "text", limit), check_id(doc_id, "id"), lang=lang, where=where, fold=fold)


def _own_fields(retriever) -> Callable[[str], dict[str, Any]] | None:
    """An image's own fields by id (`Hit.fields`), where the engine reads them (the Retriever's `shown`)."""
    return (lambda image_id: retriever.shown(image_id)[2]) if hasattr(retriever, "shown") else None
