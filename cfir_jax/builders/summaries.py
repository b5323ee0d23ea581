"""The summaries stage's build: every document summarised (`cfir_jax.nlp.summarizer`) in resumable chunks owned
round-robin by the processes (`cfir_jax.builders.chunks`), assembled by process 0 into the summary store that
`cfir_jax.stores.summaries` reads. Declared here (`cfir_jax.builders.descriptor`): the summaries stage of index.py
(`build_summaries`), and under an add of the collection the new documents' summaries appended
(`stage_summaries_addition`, through the one recipe of `cfir_jax.builders.document_stores`)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from cfir_jax.builders.chunks import check_doc_id, commit_on_main, current, iter_chunks, write_lines
from cfir_jax.builders.descriptor import Build, Changes, Stage, declare
from cfir_jax.builders.document_stores import DocumentNLP, PerDocumentStore, after_add, append_documents
from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import REFERENCE, by_language
from cfir_jax.data.corpus import Corpus
from cfir_jax.nlp.summarizer import Summarizer, make_summarizer, summary_input
from cfir_jax.nlp.summary_languages import LanguageSummaries, rules_of
from cfir_jax.stores import contract
from cfir_jax.stores.layout import Layout
from cfir_jax.stores.summaries import SUMMARY_FORMAT_VERSION, SUMMARY_KIND, SummaryStore

log = logging.getLogger(__name__)


def build_summary_store(
    out_dir: str | Path,
    docs: Iterable[tuple[str, str]],
    summarizer: Summarizer,
    num_docs: int | None = None,
    chunk_size: int = 1_000,
    input_fields: str = "paper",
    corpus_fingerprint: str | None = None,
) -> dict:
    """Summarises `docs` ((doc_id, text) pairs) into a summary store at `out_dir`; returns its manifest.

    Resumable: an interrupted build restarts after its last finished chunk of `chunk_size` documents (BART on
    millions of documents takes days; a chunk is minutes); with several processes each summarises its own chunks and
    process 0 writes the store (`iter_chunks`). `num_docs` only sizes the progress bar. `input_fields`
    names what the texts were made from (`summary_input`), recorded so that another choice is not resumed or reused;
    `corpus_fingerprint` (`Corpus.documents_fingerprint`) is recorded to tell a stale store from a current one.
    """
    out_dir = Path(out_dir)
    settings = summary_settings(summarizer, input_fields)
    chunks = iter_chunks(out_dir, docs, summarizer.summarize, settings, chunk_size, num_docs, desc="summaries")
    extra = getattr(summarizer, "manifest_fields", None)
    return commit_on_main(out_dir, SUMMARY_KIND, chunks,
                          lambda chunks: assemble_summary_store(out_dir, chunks, settings, corpus_fingerprint,
                                                                extra=extra))


def summary_settings(summarizer: Summarizer, input_fields: str) -> dict:
    """What a summary store records of how it was made (and what an addition to it must match)."""
    return {"summarizer": summarizer.name, **summarizer.settings, "input_fields": input_fields}


def document_summarizer(config, languages: dict[str, int] | None = None) -> Summarizer | LanguageSummaries:
    """The summarizer index.summaries configures; with `languages` (the documents per language of a collection not
    all in English) each language's (index.languages)."""
    english = make_summarizer(config)
    return LanguageSummaries.of(config, english, languages) if set(languages or ()) - {REFERENCE} else english


def _item(summarizer, doc, fields: str) -> str:
    """What the store streams for a corpus Document: its summary input (with its language, in several)."""
    text = summary_input(doc, fields)
    return summarizer.item(text, doc.lang) if isinstance(summarizer, LanguageSummaries) else text


def assemble_summary_store(out_dir: Path, chunks, settings: dict, corpus_fingerprint: str | None,
                           base: SummaryStore | None = None, extra: dict | None = None) -> None:
    """Writes the store from the finished chunks, in document order (process 0 of a multi-host build). `base`: a
    store whose documents come first (an addition of documents); `extra`: more manifest fields (the documents per
    language)."""
    doc_ids: list[str] = list(base.doc_ids) if base is not None else []
    seen: set[str] = set(doc_ids)
    num_empty = int(base.manifest.get("num_empty", 0)) if base is not None else 0
    with contract.atomic_dir(out_dir) as tmp:
        # Summaries stream to disk chunk by chunk: millions of them need not sit in memory.
        with open(tmp / "summaries.jsonl", "w", encoding="utf-8", newline="\n") as f:
            if base is not None:
                with open(base.directory / "summaries.jsonl", encoding="utf-8", newline="\n") as old:
                    for line in old:
                        f.write(line)
            for chunk_ids, summaries in chunks:
                for doc_id, summary in zip(chunk_ids, summaries):
                    check_doc_id(doc_id, seen, "summaries")
                    doc_ids.append(doc_id)
                    num_empty += not summary
                    f.write(json.dumps(summary, ensure_ascii=False))
                    f.write("\n")
        if not doc_ids:
            raise CfirError(f"{out_dir}: no documents to summarise; check the corpus path and split")
        write_lines(tmp / "doc_ids.txt", doc_ids)
        contract.write_manifest(
            tmp, SUMMARY_KIND, SUMMARY_FORMAT_VERSION, **settings, num_docs=len(doc_ids), num_empty=num_empty,
            corpus_fingerprint=corpus_fingerprint, **(extra or {}),
        )
    log.info("%s: %d summaries (%d empty)", out_dir, len(doc_ids), num_empty)


def build_summaries(config, layout: Layout, corpus: Corpus) -> SummaryStore:
    """The summaries stage: every document summarised as index.summaries says, unless current."""
    s = config.index.summaries
    summary_input(corpus.document(0), s.fields)  # an unknown choice, or fields the corpus lacks: one line, now
    if current(layout.summaries, "summaries", SUMMARY_FORMAT_VERSION, corpus_fingerprint=corpus.documents_fingerprint,
               summarizer=s.summarizer, input_fields=s.fields, languages=rules_of(config, corpus.languages)):
        return SummaryStore.open(layout.summaries)
    summarizer = document_summarizer(config, corpus.languages)
    docs = ((corpus.doc_ids[i], _item(summarizer, corpus.document(i), s.fields)) for i in range(corpus.num_documents))
    build_summary_store(layout.summaries, docs, summarizer, num_docs=corpus.num_documents, chunk_size=s.chunk_size,
                        input_fields=s.fields, corpus_fingerprint=corpus.documents_fingerprint)
    return SummaryStore.open(layout.summaries)


def stage_summaries_addition(config, store: SummaryStore, corpus: Corpus, first_new_doc: int,
                             out_dir: str | os.PathLike, work_dir: str | os.PathLike) -> dict:
    """The summary store with the summaries of the documents [first_new_doc, N) of the union `corpus` appended
    (chunks kept in `work_dir/summaries`), staged in `out_dir`: equal to a store built over the union in one go.
    Returns {documents_added}."""
    s = config.index.summaries

    def nlp() -> DocumentNLP:
        summarizer = document_summarizer(config, corpus.languages)
        settings = summary_settings(summarizer, s.fields)
        return DocumentNLP(settings, lambda i: _item(summarizer, corpus.document(i), s.fields), summarizer.summarize,
                           lambda out, chunks: assemble_summary_store(
                               out, chunks, settings, corpus.documents_fingerprint, base=store,
                               extra=getattr(summarizer, "manifest_fields", None)))

    append_documents(store, corpus, first_new_doc, out_dir, work_dir, PerDocumentStore("summaries", "summary",
                                                                                        s.chunk_size), nlp)
    return {"documents_added": corpus.num_documents - first_new_doc}


def stage_summary(store: SummaryStore) -> str:
    """The stage's line of index.py's closing table (each language's summarizer when not all in English)."""
    m = store.manifest
    return f"{store.num_docs:,} summaries ({m.get('summarizer')})" + \
        (f"; {by_language(m['language_documents'], m['languages'])}" if m.get("languages") else "")


declare(Stage("summaries", reader=SummaryStore.open,
              build=Build(lambda run: build_summaries(run.config, run.layout, run.opened["corpus"]), stage_summary),
              changes=Changes(add=after_add("summaries", stage_summaries_addition))))
