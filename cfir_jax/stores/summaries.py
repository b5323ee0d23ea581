"""Document summaries: abstractive with Flax BART (CFIR's setting) or extractive (a fast CPU stand-in), and their store.

CFIR scores the entity candidates of a document with the embedding of its summary, not of the whole (long)
document: BEiT-3's text path reads 64 tokens. CFIR summarises with facebook/bart-large-cnn, max_length 64,
min_length 8, no sampling, and the model's own beam settings (4 beams, length_penalty 2.0, no_repeat_ngram_size 3),
over the document text truncated at 1024 tokens (the CFIR paper's); `BartSummarizer`'s defaults are exactly these.
What the summariser reads is a config choice (`index.summaries.fields`, `summary_input`): "paper", the document
text (page title, section title, page and section descriptions joined with spaces: the corpus' `text`), or
"authors", which appends the section's category, media and hierachy lists as the authors' released code does.

Store layout (kind "summaries", format `SUMMARY_FORMAT_VERSION`):
  manifest.json      summarizer name and settings, num_docs, num_empty
  doc_ids.txt        one document id per line, in input order      [num_docs]
  summaries.jsonl    one JSON string per line (a summary may hold line breaks)   [num_docs]
Builds are resumable in chunks, like the entity store (`cfir_jax.stores.contract.iter_chunks`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.nlp.summarizer import Summarizer
from cfir_jax.stores import contract
from cfir_jax.stores.contract import check_doc_id, commit_on_main, iter_chunks, read_lines, write_lines

if TYPE_CHECKING:  # the corpus module imports tfds and grain; summaries need only the record type
    pass

log = logging.getLogger(__name__)

SUMMARY_FORMAT_VERSION = 1
SUMMARY_KIND = "summaries"


# -------------------------------------------------------------------------------------------------------------------
# The summariser's input.


# -------------------------------------------------------------------------------------------------------------------
# Extractive.


# -------------------------------------------------------------------------------------------------------------------
# Abstractive (Flax BART).


# -------------------------------------------------------------------------------------------------------------------
# The summary store.


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
    settings = {"summarizer": summarizer.name, **summarizer.settings, "input_fields": input_fields}
    chunks = iter_chunks(out_dir, docs, summarizer.summarize, settings, chunk_size, num_docs, desc="summaries")
    return commit_on_main(out_dir, SUMMARY_KIND, chunks,
                          lambda chunks: _assemble(out_dir, chunks, settings, corpus_fingerprint))


def _assemble(out_dir: Path, chunks, settings: dict, corpus_fingerprint: str | None) -> None:
    """Writes the store from the finished chunks, in document order (process 0 of a multi-host build)."""
    doc_ids: list[str] = []
    seen: set[str] = set()
    num_empty = 0
    with contract.atomic_dir(out_dir) as tmp:
        # Summaries stream to disk chunk by chunk: millions of them need not sit in memory.
        with open(tmp / "summaries.jsonl", "w", encoding="utf-8", newline="\n") as f:
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
            corpus_fingerprint=corpus_fingerprint,
        )
    log.info("%s: %d summaries (%d empty)", out_dir, len(doc_ids), num_empty)


@dataclasses.dataclass
class SummaryStore:
    """A complete summary store opened for reading: doc_ids [num_docs], summaries [num_docs]."""

    directory: Path
    manifest: dict
    doc_ids: list[str]
    summaries: list[str]

    @classmethod
    def open(
        cls, directory: str | Path, summarizer: str | None = None, corpus_fingerprint: str | None = None
    ) -> SummaryStore:
        """Opens and validates a store; refuses one made by another `summarizer` or from other documents."""
        directory = Path(directory)
        manifest = contract.read_manifest(directory, SUMMARY_KIND, SUMMARY_FORMAT_VERSION)
        if summarizer is not None:
            contract.check_manifest(manifest, directory, summarizer=summarizer)
        if corpus_fingerprint is not None:
            contract.check_derived(manifest, directory, corpus_fingerprint=corpus_fingerprint)
        num_docs = manifest.get("num_docs")
        if not isinstance(num_docs, int):
            raise StoreError(f"{directory}/manifest.json: missing num_docs; rebuild the summary store")
        lines = read_lines(directory / "summaries.jsonl", num_docs, directory)
        try:
            summaries = [json.loads(line) for line in lines]
        except ValueError:
            raise StoreError(f"{directory}/summaries.jsonl: not JSON lines; rebuild the summary store") from None
        if not all(isinstance(s, str) for s in summaries):
            raise StoreError(f"{directory}/summaries.jsonl: a line is not a JSON string; rebuild the store")
        doc_ids = read_lines(directory / "doc_ids.txt", num_docs, directory)
        return cls(directory=directory, manifest=manifest, doc_ids=doc_ids, summaries=summaries)

    @property
    def num_docs(self) -> int:
        return len(self.doc_ids)

    def summary(self, doc_index: int) -> str:
        if not 0 <= doc_index < self.num_docs:
            raise CfirError(f"{self.directory}: document index {doc_index} out of range [0, {self.num_docs})")
        return self.summaries[doc_index]


