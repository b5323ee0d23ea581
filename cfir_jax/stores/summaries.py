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
Builds are resumable in chunks, like the entity store (`cfir_jax.builders.chunks.iter_chunks`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.stores import contract
from cfir_jax.stores.contract import Store, read_lines

SUMMARY_FORMAT_VERSION = 1
SUMMARY_KIND = "summaries"






@dataclasses.dataclass
class SummaryStore(Store):
    """A complete summary store opened for reading: doc_ids [num_docs], summaries [num_docs]."""

    KIND, VERSION = SUMMARY_KIND, SUMMARY_FORMAT_VERSION

    directory: Path
    manifest: dict
    doc_ids: list[str]
    summaries: list[str]

    @classmethod
    def check(cls, manifest: dict, directory: Path, summarizer: str | None = None,
              corpus_fingerprint: str | None = None) -> None:
        """Refuses a store made by another `summarizer` or from other documents."""
        if summarizer is not None:
            contract.check_manifest(manifest, directory, summarizer=summarizer)
        if corpus_fingerprint is not None:
            contract.check_derived(manifest, directory, corpus_fingerprint=corpus_fingerprint)

    @classmethod
    def load(cls, directory: Path, manifest: dict) -> SummaryStore:
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


