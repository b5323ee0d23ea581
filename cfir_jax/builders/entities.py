"""The entities stage's build: spaCy NER (`cfir_jax.nlp.entities`) over every document, in resumable chunks owned
round-robin by the processes (`cfir_jax.builders.chunks`), assembled by process 0 into the entity store that
`cfir_jax.stores.entities` reads. Declared here (`cfir_jax.builders.descriptor`): the entities stage of index.py
(`build_entities`), and under an add of the collection the new documents' NER appended (`stage_entities_addition`,
through the one recipe of `cfir_jax.builders.document_stores`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from cfir_jax.builders.chunks import check_doc_id, commit_on_main, current, iter_chunks, write_lines
from cfir_jax.builders.descriptor import Build, Changes, Stage, declare
from cfir_jax.builders.document_stores import DocumentNLP, PerDocumentStore, after_add, append_documents
from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import REFERENCE, by_language
from cfir_jax.data.corpus import Corpus
from cfir_jax.nlp.entities import EntityExtractor, load_spacy
from cfir_jax.nlp.entity_languages import LanguageEntities, index_workers
from cfir_jax.nlp.entity_sources import SourcedExtractor, categories_of, check_sources
from cfir_jax.stores import contract
from cfir_jax.stores.entities import ENTITY_FORMAT_VERSION, ENTITY_KIND, EntityStore, entity_key
from cfir_jax.stores.layout import Layout

log = logging.getLogger(__name__)


def build_entity_store(
    out_dir: str | Path,
    docs: Iterable[tuple[str, str]],
    extractor: EntityExtractor,
    num_docs: int | None = None,
    chunk_size: int = 10_000,
    corpus_fingerprint: str | None = None,
) -> dict:
    """Extracts the entities of `docs` ((doc_id, text) pairs) into an entity store at `out_dir`; returns its manifest.

    Resumable: an interrupted build restarts after its last finished chunk of `chunk_size` documents; with several
    processes each extracts its own chunks and process 0 writes the store (`iter_chunks`). Documents
    without entities get an empty row and are counted in the manifest (retrieval falls back to the summary there).
    `num_docs` only sizes the progress bar; `corpus_fingerprint` (`Corpus.documents_fingerprint`) is recorded so a
    store computed from other documents is never taken for current.
    """
    out_dir = Path(out_dir)
    chunks = iter_chunks(
        out_dir,
        docs,
        lambda texts: list(extractor.extract(texts)),
        extractor.settings,
        chunk_size,
        num_docs,
        desc="entities",
    )
    return commit_on_main(out_dir, ENTITY_KIND, chunks,
                          lambda chunks: assemble_entity_store(out_dir, chunks, extractor, corpus_fingerprint))


def assemble_entity_store(out_dir: Path, chunks, extractor: EntityExtractor, corpus_fingerprint: str | None,
                          base: EntityStore | None = None) -> None:
    """Writes the store from the finished chunks, in document order (process 0 of a multi-host build). `base`: a
    store whose documents come first (an addition of documents), its vocabulary extended in order of first mention,
    so the result equals a store built over base's documents and the chunks' in one go."""
    vocab: dict[str, int] = {}  # entity_key -> id
    surfaces: list[str] = []  # id -> surface form
    doc_ids: list[str] = []
    seen: set[str] = set()
    offsets = [0]
    ids: list[np.ndarray] = []
    if base is not None:
        surfaces = list(base.vocab)
        vocab = {entity_key(name): k for k, name in enumerate(surfaces)}
        doc_ids = list(base.doc_ids)
        seen = set(doc_ids)
        offsets = [int(o) for o in base.offsets]
        ids = [np.asarray(base.entity_ids, dtype=np.int64)]
    for chunk_ids, chunk_entities in chunks:
        flat: list[int] = []  # One array per chunk, not per document: 10M tiny arrays would cost gigabytes.
        for doc_id, entities in zip(chunk_ids, chunk_entities):
            check_doc_id(doc_id, seen, "entities")
            doc_ids.append(doc_id)
            for name in entities:
                key = entity_key(name)
                if key not in vocab:
                    vocab[key] = len(vocab)
                    surfaces.append(name)  # the first surface form seen names the entity
                flat.append(vocab[key])
            offsets.append(offsets[-1] + len(entities))
        ids.append(np.asarray(flat, dtype=np.int64))
    if not doc_ids:
        raise CfirError(f"{out_dir}: no documents to extract entities from; check the corpus path and split")
    if len(vocab) > np.iinfo(np.int32).max:
        raise CfirError(f"{out_dir}: {len(vocab)} distinct entities overflow int32 ids; shard the corpus")
    _write_entity_store(out_dir, doc_ids, surfaces, offsets, np.concatenate(ids).astype(np.int32), extractor,
                        corpus_fingerprint)


def _write_entity_store(out_dir: Path, doc_ids: list[str], surfaces: list[str], offsets: list[int],
                        entity_ids: np.ndarray, extractor: EntityExtractor, corpus_fingerprint: str | None) -> None:
    """The store's files from the assembled CSR (`entity_ids` int32 [mentions], `offsets` [documents + 1]) and the
    vocabulary's surface forms, written under a temporary name and renamed."""
    offsets_arr = np.asarray(offsets, dtype=np.int64)
    doc_freq = np.bincount(entity_ids, minlength=len(surfaces)).astype(np.int32)
    num_without = int(np.sum(np.diff(offsets_arr) == 0))
    with contract.atomic_dir(out_dir) as tmp:
        write_lines(tmp / "doc_ids.txt", doc_ids)
        write_lines(tmp / "vocab.txt", surfaces)
        np.save(tmp / "offsets.npy", offsets_arr)
        np.save(tmp / "entity_ids.npy", entity_ids)
        np.save(tmp / "doc_freq.npy", doc_freq)
        contract.write_manifest(
            tmp,
            ENTITY_KIND,
            ENTITY_FORMAT_VERSION,
            **extractor.settings,
            num_docs=len(doc_ids),
            num_entities=len(surfaces),
            num_mentions=int(entity_ids.size),
            num_without_entities=num_without,
            corpus_fingerprint=corpus_fingerprint,
            **getattr(extractor, "manifest_fields", {}),
        )
    log.info(
        "%s: %d documents, %d distinct entities, %d without entities",
        out_dir,
        len(doc_ids),
        len(surfaces),
        num_without,
    )


def entity_extractor(config, documents: int, languages: dict[str, int] | None = None) \
        -> SourcedExtractor | LanguageEntities:
    """The NER index.entities configures (spaCy, its labels, the entity sources) for parsing `documents` documents
    (the worker pool's size: entity_workers.index); with `languages` (the documents per language of a collection
    not all in English) each language's (index.languages)."""
    e = config.index.entities
    sources = check_sources(e.get("sources") or "spacy")
    nlp = load_spacy(e.spacy_model or None)
    in_english = documents if not languages else min(documents, int(languages.get(REFERENCE, 0)))
    workers = index_workers(config, e.spacy_model, e.labels, in_english)
    english = SourcedExtractor(EntityExtractor(nlp, e.labels, e.batch_size, workers=workers), sources)
    return LanguageEntities.of(config, english, languages) if set(languages or ()) - {REFERENCE} else english


def stop_workers(extractor: SourcedExtractor | LanguageEntities) -> None:
    """Stops the spaCy worker processes (entity_workers.index) of each language's extractor: the stage is done."""
    for sourced in [extractor, *getattr(extractor, "by_language", {}).values()]:
        workers = getattr(sourced.extractor, "workers", None)
        if workers is not None:
            workers.close()


def _item(extractor: SourcedExtractor | LanguageEntities, doc) -> str:
    """What the store streams for a corpus Document."""
    if isinstance(extractor, LanguageEntities):
        return extractor.item(doc.text, categories_of(doc), doc.lang)
    return extractor.item(doc.text, categories_of(doc))


def build_entities(config, layout: Layout, corpus: Corpus) -> EntityStore:
    """The entities stage: spaCy NER (and the configured entity sources) over every document, unless current."""
    e = config.index.entities
    sources = check_sources(e.get("sources") or "spacy")
    extractor = entity_extractor(config, corpus.num_documents, corpus.languages)
    # Current only when computed from these very documents (their content, not just their number) by this NER, from
    # these sources (a plain spaCy store records none), each language by its rule (an English store records none).
    if current(layout.entities, "entities", ENTITY_FORMAT_VERSION, corpus_fingerprint=corpus.documents_fingerprint,
               labels=list(extractor.extractor.labels), sources=extractor.settings.get("sources"),
               languages=extractor.settings.get("languages")):
        stop_workers(extractor)
        return EntityStore.open(layout.entities)
    if sources != "spacy" and corpus.num_documents and not any(
            categories_of(corpus.document(i)) for i in range(min(corpus.num_documents, 1000))):
        raise CfirError(f"{corpus.path}: its documents carry no category names (index.entities.sources={sources!r}); "
                        "use --config.index.entities.sources=spacy or a corpus with AToMiC's category field")
    docs = ((corpus.doc_ids[i], _item(extractor, corpus.document(i))) for i in range(corpus.num_documents))
    try:
        build_entity_store(layout.entities, docs, extractor, num_docs=corpus.num_documents, chunk_size=e.chunk_size,
                           corpus_fingerprint=corpus.documents_fingerprint)
    finally:
        stop_workers(extractor)
    return EntityStore.open(layout.entities)


def stage_entities_addition(config, store: EntityStore, corpus: Corpus, first_new_doc: int,
                            out_dir: str | os.PathLike, work_dir: str | os.PathLike) -> dict:
    """The entity store with the NER of the documents [first_new_doc, N) of the union `corpus` appended (chunks kept
    in `work_dir/entities` across a kill), staged in `out_dir`: equal to a store built over the union in one go,
    recorded with the union's documents fingerprint. Returns {documents_added, entities_added}."""
    made = []

    def nlp() -> DocumentNLP:
        extractor = entity_extractor(config, corpus.num_documents - first_new_doc, corpus.languages)
        made.append(extractor)
        return DocumentNLP(
            extractor.settings, lambda i: _item(extractor, corpus.document(i)),
            lambda texts: list(extractor.extract(texts)),
            lambda out, chunks: assemble_entity_store(out, chunks, extractor, corpus.documents_fingerprint, base=store))

    try:
        kind = PerDocumentStore("entities", "entity", config.index.entities.chunk_size)
        manifest = append_documents(store, corpus, first_new_doc, out_dir, work_dir, kind, nlp)
    finally:
        for extractor in made:
            stop_workers(extractor)
    return {"documents_added": corpus.num_documents - first_new_doc,
            "entities_added": 0 if manifest is None else int(manifest["num_entities"]) - len(store.vocab)}


def stage_summary(store: EntityStore | None) -> str:
    """The stage's line of index.py's closing table: with the documents of each language and the rule that read them
    when the collection is not all in English."""
    if store is None:
        return "-"
    m = store.manifest
    return f"{len(store.vocab):,} entities, {store.num_without_entities} docs without" + \
        (f"; {by_language(m['language_documents'], m['languages'])}" if m.get("languages") else "")


declare(Stage("entities", reader=EntityStore.open,
              build=Build(lambda run: build_entities(run.config, run.layout, run.opened["corpus"]),
                          stage_summary, unselected=lambda run: None),
              changes=Changes(add=after_add("entities", stage_entities_addition))))
