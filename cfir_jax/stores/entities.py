"""Named entities of each document (spaCy NER), and the entity store the entity index and retrieval read.

CFIR's coarse stage starts from the named entities of a document: each entity text is encoded by the frozen text
path and its top-K images form a candidate list; the union of the lists of a document's entities is what the
summary embedding scores. This module finds the entities (spaCy NER, only the labels of things a picture can show)
and writes them as a compressed-sparse-row store: one shared entity vocabulary and, per document, the ids of its
entities. An entity keeps the surface form spaCy gives (whitespace collapsed), which is what gets encoded: "The Who",
"The Hague", "McDonald's" and "St. John's" are names, and stripping "The" or "'s" would encode another string. Only
the lookup key folds case (`entity_key`), so "The Hague" and "the Hague" share one candidate list.

Store layout (kind "entities", format `ENTITY_FORMAT_VERSION`):
  manifest.json          spaCy model name/version, labels, counts (num_docs, num_entities, num_mentions,
                         num_without_entities)
  doc_ids.txt            one document id per line, in input order                      [num_docs]
  vocab.txt              one entity surface form per line (id = line number), the first
                         form seen of each `entity_key`                                [num_entities]
  offsets.npy  int64     row i's ids are entity_ids[offsets[i]:offsets[i + 1]]         [num_docs + 1]
  entity_ids.npy int32   entity ids, per document in order of first mention            [num_mentions]
  doc_freq.npy int32     number of documents mentioning each entity                    [num_entities]

Large builds are resumable: chunks of finished documents are kept in `<out_dir>.partial/` (see `iter_chunks`), and
the store itself is assembled through `contract.atomic_dir`, so readers never see half a store.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.nlp.entities import EntityExtractor, entity_key
from cfir_jax.stores import contract
from cfir_jax.stores.contract import check_doc_id, commit_on_main, iter_chunks, read_lines, write_lines
from cfir_jax.stores.integrity import check_csr

log = logging.getLogger(__name__)

ENTITY_FORMAT_VERSION = 2  # 1 stored names with 'the' and "'s" stripped
ENTITY_KIND = "entities"


# -------------------------------------------------------------------------------------------------------------------
# Resumable chunked builds: `cfir_jax.stores.contract.iter_chunks` (shared with the summary store).


# -------------------------------------------------------------------------------------------------------------------
# The entity store.


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
                          lambda chunks: _assemble(out_dir, chunks, extractor, corpus_fingerprint))


def _assemble(out_dir: Path, chunks, extractor: EntityExtractor, corpus_fingerprint: str | None) -> None:
    """Writes the store from the finished chunks, in document order (process 0 of a multi-host build)."""
    vocab: dict[str, int] = {}  # entity_key -> id
    surfaces: list[str] = []  # id -> surface form
    doc_ids: list[str] = []
    seen: set[str] = set()
    offsets = [0]
    ids: list[np.ndarray] = []
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

    entity_ids = np.concatenate(ids).astype(np.int32)  # Checked above to fit.
    offsets_arr = np.asarray(offsets, dtype=np.int64)
    doc_freq = np.bincount(entity_ids, minlength=len(vocab)).astype(np.int32)
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
            num_entities=len(vocab),
            num_mentions=int(entity_ids.size),
            num_without_entities=num_without,
            corpus_fingerprint=corpus_fingerprint,
        )
    log.info(
        "%s: %d documents, %d distinct entities, %d without entities",
        out_dir,
        len(doc_ids),
        len(vocab),
        num_without,
    )


@dataclasses.dataclass
class EntityStore:
    """A complete entity store opened for reading; arrays are memory-mapped.

    vocab [num_entities], doc_ids [num_docs], offsets int64 [num_docs + 1], entity_ids int32 [num_mentions],
    doc_freq int32 [num_entities].
    """

    directory: Path
    manifest: dict
    vocab: list[str]
    doc_ids: list[str]
    offsets: np.ndarray
    entity_ids: np.ndarray
    doc_freq: np.ndarray
    _index: dict[str, int] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def open(
        cls, directory: str | Path, spacy_model: str | None = None, corpus_fingerprint: str | None = None
    ) -> EntityStore:
        """Opens and validates a store; refuses one built by another `spacy_model` or from other documents."""
        directory = Path(directory)
        manifest = contract.read_manifest(directory, ENTITY_KIND, ENTITY_FORMAT_VERSION)
        if spacy_model is not None:
            contract.check_manifest(manifest, directory, spacy_model=spacy_model)
        if corpus_fingerprint is not None:
            contract.check_derived(manifest, directory, corpus_fingerprint=corpus_fingerprint)
        try:
            num_docs = int(manifest["num_docs"])
            num_entities = int(manifest["num_entities"])
            num_mentions = int(manifest["num_mentions"])
        except (KeyError, TypeError, ValueError):
            raise StoreError(f"{directory}/manifest.json: missing counts; rebuild the entity store") from None
        arrays = {}
        for name, dtype, size in (
            ("offsets", np.int64, num_docs + 1),
            ("entity_ids", np.int32, num_mentions),
            ("doc_freq", np.int32, num_entities),
        ):
            path = directory / f"{name}.npy"
            try:
                arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
            except FileNotFoundError:
                raise StoreError(f"{path}: missing; the entity store is incomplete, rebuild it") from None
            except ValueError:
                raise StoreError(f"{path}: not a .npy array; the entity store is corrupt, rebuild it") from None
            if arrays[name].dtype != dtype or arrays[name].shape != (size,):
                raise StoreError(
                    f"{path}: {arrays[name].dtype}{list(arrays[name].shape)} but expected "
                    f"{np.dtype(dtype)}[{size}]; rebuild the entity store"
                )
        check_csr(arrays["offsets"], arrays["entity_ids"], num_entities, directory)
        return cls(
            directory=directory,
            manifest=manifest,
            vocab=read_lines(directory / "vocab.txt", num_entities, directory),
            doc_ids=read_lines(directory / "doc_ids.txt", num_docs, directory),
            **arrays,
        )

    @property
    def num_docs(self) -> int:
        return len(self.doc_ids)

    @property
    def num_without_entities(self) -> int:
        return int(self.manifest["num_without_entities"])

    def _check(self, doc_index: int) -> int:
        if not 0 <= doc_index < self.num_docs:
            raise CfirError(f"{self.directory}: document index {doc_index} out of range [0, {self.num_docs})")
        return int(doc_index)

    def entity_ids_of(self, doc_index: int) -> np.ndarray:
        """Entity ids of one document, in order of first mention: int32 [num_entities_of_doc]."""
        i = self._check(doc_index)
        return np.asarray(self.entity_ids[self.offsets[i] : self.offsets[i + 1]])

    def entities_of(self, doc_index: int) -> list[str]:
        """Normalised entity texts of one document, in order of first mention."""
        return [self.vocab[j] for j in self.entity_ids_of(doc_index)]

    def index_of(self, doc_id: str) -> int:
        """Row of a document id (the id -> row map is built on first use)."""
        if self._index is None:
            self._index = {d: i for i, d in enumerate(self.doc_ids)}
        try:
            return self._index[doc_id]
        except KeyError:
            raise CfirError(f"{self.directory}: unknown document id {doc_id!r}; was the store built on this split?"
                            ) from None
