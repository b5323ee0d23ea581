"""Named entities of each document (spaCy NER), and the entity store the entity index and retrieval read.

CFIR's coarse stage starts from the named entities of a document: each entity text is encoded by the frozen text
path and its top-K images form a candidate list; the union of the lists of a document's entities is what the
summary embedding scores. This module finds the entities (spaCy NER, only the labels of things an image can show)
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
import re
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.stores import contract
from cfir_jax.stores.contract import Store, read_lines
from cfir_jax.stores.integrity import check_csr

_WHITESPACE = re.compile(r"\s+")


def normalize_entity(text: str) -> str:
    """The surface form of an entity mention as spaCy gives it, whitespace collapsed: what the encoder reads.

    Nothing else is removed: a leading "The" or a trailing "'s" is part of many names ("The Who", "McDonald's").
    Returns "" for a blank mention.
    """
    return _WHITESPACE.sub(" ", text).strip()


def entity_key(text: str) -> str:
    """The lookup key of an entity: its surface form case-folded ("The Hague" and "the Hague" share one key)."""
    return normalize_entity(text).casefold()


ENTITY_FORMAT_VERSION = 2  # 1 stored names with 'the' and "'s" stripped
ENTITY_KIND = "entities"






@dataclasses.dataclass
class EntityStore(Store):
    """A complete entity store opened for reading; arrays are memory-mapped.

    vocab [num_entities], doc_ids [num_docs], offsets int64 [num_docs + 1], entity_ids int32 [num_mentions],
    doc_freq int32 [num_entities].
    """

    KIND, VERSION = ENTITY_KIND, ENTITY_FORMAT_VERSION

    directory: Path
    manifest: dict
    vocab: list[str]
    doc_ids: list[str]
    offsets: np.ndarray
    entity_ids: np.ndarray
    doc_freq: np.ndarray
    _index: dict[str, int] | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def check(cls, manifest: dict, directory: Path, spacy_model: str | None = None,
              corpus_fingerprint: str | None = None) -> None:
        """Refuses a store built by another `spacy_model` or from other documents."""
        if spacy_model is not None:
            contract.check_manifest(manifest, directory, spacy_model=spacy_model)
        if corpus_fingerprint is not None:
            contract.check_derived(manifest, directory, corpus_fingerprint=corpus_fingerprint)

    @classmethod
    def load(cls, directory: Path, manifest: dict) -> EntityStore:
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
