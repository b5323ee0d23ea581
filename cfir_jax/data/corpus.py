"""The one on-disk corpus format every stage reads: documents, images, qrels, optionally a tokenizer.

A corpus directory `C/` holds

    C/manifest.json              kind "corpus": name, counts, splits, embedding_dim, extra fields of the source
    C/documents/1.0.0/...        tfds array_record dataset, one record per document, in row order
    C/images/1.0.0/...           tfds array_record dataset, one record per image, in row order
    C/doc_ids.txt, image_ids.txt one id per line, line i = row i (so opening a corpus never scans the records)
    C/embeddings.npy             [num_images, D] float32, only when the images carry precomputed embeddings
    C/qrels/<split>.txt          TREC qrels, `doc_id 0 image_id rel`
    C/tokenizer.spm              optional sentencepiece model shipped with the corpus (synthetic corpora)
    C/parts/0001/ ...            rows added later (`index.py --add`), each a corpus directory of its own records, id
                                 lists and embeddings.npy (a side with no rows has no records); the top manifest's
                                 `parts` lists them ({path, num_documents, num_images}), and its counts, id lists,
                                 qrels and documents_sha are of the union: row r of the union is the base's rows, then
                                 each part's, in order
    C/doc_langs.txt, image_langs.txt   the language of each row (line i = row i; '' for an image without text), only
                                 when some text is not English (manifest `languages`: counts, the detector's settings);
                                 without them every row is English (cfir_jax.core.languages)
    C/removed_images.txt, removed_documents.txt   ids removed by `index.py --remove` (one a line; manifest counts
                                 `removed_images` / `removed_documents`): rows never move, later stages mask them

Records are written by tensorflow-datasets (`cfir_jax.data.record_writer`, array_record) and read back without it
(`cfir_jax.data.records.RecordSource`, as tfds' `as_data_source()` would) in a `grain.MapDataset`: random access by
row, in row order, which the id lists, the embedding matrix and every downstream store index by position.

`embeddings.npy` duplicates the records' `embedding`: stages want the whole [num_images, D] matrix memory-mapped
(with parts, `embeddings()` concatenates the base's and the parts' matrices into memory).

`documents_sha` digests the documents in order; an addition chains the digests (sha256 of the previous and the
part's), so a grown corpus differs from one written at once (its stores rebuilt once); images alone keep it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import REFERENCE
from cfir_jax.data.records import RecordSource
from cfir_jax.stores.contract import manifest_digest, read_manifest

KIND = "corpus"
FORMAT_VERSION = 1
SPLITS = ("train", "validation", "test")
RECORD_VERSION = "1.0.0"
# tfds reserves "all" and friends; every record set is stored as its one split under this name.
RECORD_SPLIT = "train"
DOC_LANGS, IMAGE_LANGS = "doc_langs.txt", "image_langs.txt"

Qrels = dict[str, dict[str, int]]


@dataclasses.dataclass(frozen=True)
class Document:
    """A document to illustrate: `text` is the assembled text the entity and summary stages read."""

    doc_id: str
    text: str
    title: str = ""
    entities: tuple[str, ...] = ()  # planted entity names (synthetic ground truth); empty for real corpora
    # The source's list-valued fields of the document by column name (AToMiC: category, media, hierachy), kept for
    # stages that may read them (the summariser's input, `nlp.summarizer.summary_input`; the category names of
    # `index.entities.sources`); a synthetic world's documents hold their categories alone.
    metadata: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, hash=False)
    # Its language (cfir_jax.core.languages): stated by the collection ('' when not: the corpus writer detects it);
    # a corpus read back gives every document its own ("en" where the corpus recorded none).
    lang: str = ""


@dataclasses.dataclass(frozen=True)
class Image:
    """A candidate image: `image` holds the encoded bytes (may be empty or corrupt), `embedding` is [D] or None."""

    image_id: str
    caption: str = ""
    url: str = ""
    image: bytes = b""
    # Left out of ==: comparing arrays with == is elementwise and would make Image equality raise.
    embedding: np.ndarray | None = dataclasses.field(default=None, compare=False)
    entities: tuple[str, ...] = ()  # entities the image depicts (synthetic ground truth)
    # The image's own text fields by column name (AToMiC: caption_reference_description, caption_alt_text_description,
    # caption_attribution_description, each a list of strings), embedded by the image-text stage (index.image_text).
    texts: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, hash=False)
    lang: str = ""  # the language of its own text, as Document.lang ('' for an image without text)
    # The image's own fields (date, source, tags, ...: cfir_jax.core.image_field_types), raw as given; the
    # image_fields stage keeps them as typed columns for the filters.
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


def own_text(image: Image) -> str:
    """What an image says about itself, its language's evidence: its caption and every text field, each once."""
    seen = dict.fromkeys(t.strip() for t in (image.caption, *(t for f in sorted(image.texts)
                                                               for t in image.texts[f])) if t and t.strip())
    return " ".join(seen)


# AToMiC's text fields of a document, kept one string each in the document's metadata by the AToMiC reader; what
# `document_text` can select (the names are cfir_jax.data.atomic.TEXT_FIELDS', repeated to keep the import order).
DOCUMENT_FIELDS = ("page_title", "section_title", "context_page_description", "context_section_description")


def document_text(doc: Document, fields: Sequence[str] | str | None) -> str:
    """The text of `doc` the dense baselines encode: its `fields` joined with spaces, in the order given.

    'all', None (configs written before the choice existed) or an empty selection: the whole assembled text. A
    corpus without per-field text (synthetic worlds) gives the whole text; an AToMiC corpus written before the
    fields were kept is one error line (rebuild W/corpus).
    """
    if fields is None or isinstance(fields, str):
        fields = () if fields in (None, "all") else (fields,)
    unknown = [f for f in fields if f not in DOCUMENT_FIELDS]
    if unknown:
        raise CfirError(f"document fields {unknown}: use 'all' or a tuple of {', '.join(DOCUMENT_FIELDS)}")
    if not fields:
        return doc.text
    if not any(f in doc.metadata for f in DOCUMENT_FIELDS):
        # An AToMiC document (it has the list fields) of a corpus without the text fields; a synthetic document's
        # metadata holds its categories alone.
        if set(doc.metadata) - {"category"}:
            raise CfirError(f"document {doc.doc_id!r} has no per-field text (a corpus written before the fields were "
                            "kept): delete W/corpus and rerun index.py")
        return doc.text
    return " ".join(t for f in fields for t in doc.metadata.get(f, ()) if t)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _to_document(record: Mapping[str, Any]) -> Document:
    return Document(
        doc_id=_text(record["doc_id"]),
        text=_text(record["text"]),
        title=_text(record["title"]),
        entities=tuple(_text(e) for e in record["entities"]),
        # Corpora written before documents kept their metadata have no such field.
        metadata={k: tuple(v) for k, v in json.loads(_text(record.get("metadata") or "{}")).items()},
    )


def _to_image(record: Mapping[str, Any]) -> Image:
    embedding = record.get("embedding")
    return Image(
        image_id=_text(record["image_id"]),
        caption=_text(record["caption"]),
        url=_text(record["url"]),
        image=bytes(record["image"]),
        embedding=None if embedding is None else np.asarray(embedding, dtype=np.float32),
        entities=tuple(_text(e) for e in record["entities"]),
        # Corpora written before images kept their text fields have no such field.
        texts={k: tuple(v) for k, v in json.loads(_text(record.get("texts") or "{}")).items()},
        # Corpora written before images kept their own fields have no such field.
        fields=json.loads(_text(record.get("fields") or "{}")),
    )


def _document_at(langs: Sequence[str], i: int, record: Mapping[str, Any]) -> Document:
    """The document of row `i`, with its language (`langs`: the corpus's, empty when it recorded none: English)."""
    return dataclasses.replace(_to_document(record), lang=langs[i] if langs else REFERENCE)


def _image_at(langs: Sequence[str], i: int, record: Mapping[str, Any]) -> Image:
    """The image of row `i`, with its own text's language ('' without text), as `_document_at`."""
    img = _to_image(record)
    return dataclasses.replace(img, lang=langs[i] if langs else (REFERENCE if own_text(img) else ""))


def _open_records(path: Path, name: str, expected: int):
    version_dir = path / name / RECORD_VERSION
    if not (version_dir / "dataset_info.json").is_file():
        raise CfirError(f"{path}: incomplete corpus ({name} records missing); rebuild the corpus")
    try:
        source = RecordSource(version_dir, RECORD_SPLIT)
    except Exception as e:  # a damaged dataset_info/features/shard (array_record raises its own types): "rebuild"
        raise CfirError(f"{version_dir}: unreadable {name} records ({e.__class__.__name__}); rebuild the corpus"
                        ) from None
    if len(source) != expected:
        raise CfirError(f"{version_dir}: {len(source)} {name} records but the manifest says {expected}; rebuild it")
    return source


def _read_ids(path: Path, expected: int) -> list[str]:
    if not path.is_file():
        raise CfirError(f"{path}: missing; the corpus is incomplete, rebuild it")
    ids = path.read_text(encoding="utf-8").split("\n")[:-1]
    if len(ids) != expected:
        raise CfirError(f"{path}: {len(ids)} ids but the manifest says {expected}; rebuild the corpus")
    return ids


class ConcatSource:
    """Random access over several record sources as one (the base's rows, then each part's): picklable, as the
    worker processes of the training input pipeline need."""

    def __init__(self, sources: Sequence[Any]):
        self.sources = list(sources)
        self.starts = np.cumsum([0] + [len(s) for s in self.sources])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int):
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range [0, {len(self)})")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.sources[k][i - int(self.starts[k])]


def _segments(path: Path, manifest: dict) -> list[tuple[Path, int, int]]:
    """(directory, documents, images) of the base and of each part, in row order."""
    parts = manifest.get("parts") or []
    try:
        rows = [(path / p["path"], int(p["num_documents"]), int(p["num_images"])) for p in parts]
    except (KeyError, TypeError, ValueError):
        raise CfirError(f"{path}/manifest.json: malformed 'parts' entry; rebuild the corpus") from None
    base = (path, int(manifest["num_documents"]) - sum(r[1] for r in rows),
            int(manifest["num_images"]) - sum(r[2] for r in rows))
    if base[1] < 0 or base[2] < 0:
        raise CfirError(f"{path}/manifest.json: its parts hold more rows than the corpus; rebuild the corpus")
    return [base, *rows]


def _concat(path: Path, segments: list[tuple[Path, int, int]], name: str):
    """One record source over every segment's records of `name` (the base's own when there are no parts)."""
    column = 1 if name == "documents" else 2
    sources = [_open_records(seg[0], name, seg[column]) for seg in segments if seg[column]]
    return sources[0] if len(sources) == 1 else ConcatSource(sources)


def _read_id_set(path: Path) -> frozenset[str]:
    return frozenset(path.read_text(encoding="utf-8").split("\n")[:-1]) if path.is_file() else frozenset()


class Corpus:
    """A corpus directory opened for random access; rows are addressed by index (the order of the id lists)."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        self.name: str = manifest["name"]
        self.num_documents: int = int(manifest["num_documents"])
        self.num_images: int = int(manifest["num_images"])
        self.embedding_dim: int | None = manifest.get("embedding_dim")
        self.doc_ids: list[str] = _read_ids(path / "doc_ids.txt", self.num_documents)
        self.image_ids: list[str] = _read_ids(path / "image_ids.txt", self.num_images)
        self.segments = _segments(path, manifest)
        self._doc_source = _concat(path, self.segments, "documents")
        self._image_source = _concat(path, self.segments, "images")
        self._removed: dict[str, frozenset[str]] = {}

    @functools.cached_property
    def documents(self):
        """The documents as a grain.MapDataset (random access by row)."""
        # why: grain's import takes seconds; a query's start (retrieve.py, the service) never needs it
        import grain

        return grain.MapDataset.source(self._doc_source).map_with_index(
            functools.partial(_document_at, tuple(self.doc_langs)))

    @functools.cached_property
    def images(self):
        """The images as a grain.MapDataset (random access by row)."""
        # why: as for `documents`
        import grain

        return grain.MapDataset.source(self._image_source).map_with_index(
            functools.partial(_image_at, tuple(self.image_langs)))

    @property
    def removed_image_ids(self) -> frozenset[str]:
        """Image ids removed by `index.py --remove` (removed_images.txt; empty when none)."""
        if "images" not in self._removed:
            self._removed["images"] = _read_id_set(self.path / "removed_images.txt")
        return self._removed["images"]

    @property
    def removed_doc_ids(self) -> frozenset[str]:
        """Document ids removed by `index.py --remove` (removed_documents.txt; empty when none)."""
        if "documents" not in self._removed:
            self._removed["documents"] = _read_id_set(self.path / "removed_documents.txt")
        return self._removed["documents"]

    @property
    def embedding_files(self) -> list[Path]:
        """The embeddings.npy of the base and of each part holding images, in row order (empty without them)."""
        if self.embedding_dim is None:
            return []
        return [seg / "embeddings.npy" for seg, _, images in self.segments if images]

    @property
    def documents_fingerprint(self) -> str:
        """Identifies the documents' content (ids, texts, titles, in order): entities and summaries record it."""
        # Corpora written before the digest existed: their manifest (counts, sources, build time) stands in.
        return f"docs-{self.manifest.get('documents_sha') or manifest_digest(self.manifest)}"

    @classmethod
    def open(cls, path: str | os.PathLike) -> Corpus:
        """Opens a complete corpus directory; CfirError if it is missing, incomplete or of another format."""
        path = Path(path)
        manifest = read_manifest(path, KIND, FORMAT_VERSION)
        for key in ("name", "num_documents", "num_images", "splits"):
            if key not in manifest:
                raise CfirError(f"{path}: corpus manifest has no {key!r}; rebuild the corpus")
        return cls(path, manifest)

    def __repr__(self) -> str:
        return f"Corpus({self.name!r}, {self.num_documents} documents, {self.num_images} images, {self.path})"

    @property
    def splits(self) -> tuple[str, ...]:
        """The qrels splits this corpus has, in the canonical order."""
        return tuple(s for s in SPLITS if s in self.manifest["splits"])

    @property
    def tokenizer_path(self) -> Path | None:
        """The sentencepiece model shipped with the corpus, or None (use the model's own tokenizer)."""
        path = self.path / "tokenizer.spm"
        return path if self.manifest.get("has_tokenizer") and path.is_file() else None

    @property
    def image_records(self):
        """The raw image records (random access by row, each a dict with the encoded `image` bytes): the picklable
        source a worker process reads without the id lists (the training input pipeline's)."""
        return self._image_source

    def document(self, i: int) -> Document:
        """Document at row `i` (0 <= i < num_documents), with its language."""
        if not 0 <= i < self.num_documents:
            raise CfirError(f"{self.path}: document row {i} out of range [0, {self.num_documents})")
        return _document_at(self.doc_langs, i, self._doc_source[i])  # as `documents[i]`, without grain's import

    def image(self, i: int) -> Image:
        """Image at row `i` (0 <= i < num_images), with the language of its own text."""
        if not 0 <= i < self.num_images:
            raise CfirError(f"{self.path}: image row {i} out of range [0, {self.num_images})")
        return _image_at(self.image_langs, i, self._image_source[i])  # as `images[i]`, without grain's import

    @functools.cached_property
    def doc_langs(self) -> list[str]:
        """Each document's language (row order), or [] when the corpus recorded none: every document is English."""
        return self._langs(DOC_LANGS, self.num_documents)

    @functools.cached_property
    def image_langs(self) -> list[str]:
        """The language of each image's own text ('' without text), or [] when the corpus recorded none (English)."""
        return self._langs(IMAGE_LANGS, self.num_images)

    def _langs(self, name: str, expected: int) -> list[str]:
        if not self.manifest.get("languages"):
            return []
        return _read_ids(self.path / name, expected)

    @property
    def languages(self) -> dict[str, int]:
        """Documents per language ({"en": N} for a corpus that recorded none)."""
        return dict(self.manifest.get("languages", {}).get("documents") or {REFERENCE: self.num_documents})

    def qrels(self, split: str) -> Qrels:
        """{doc_id: {image_id: rel}} of one split."""
        if split not in self.manifest["splits"]:
            available = ", ".join(self.splits) or "none"
            raise CfirError(f"{self.path}: corpus has no {split!r} qrels; available: {available}")
        path = self.path / "qrels" / f"{split}.txt"
        if not path.is_file():
            raise CfirError(f"{path}: missing; the corpus is incomplete, rebuild it")
        out: Qrels = {}
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            fields = line.split()
            if len(fields) != 4:
                raise CfirError(f"{path}:{n}: expected `doc_id 0 image_id rel`, got {line!r}")
            out.setdefault(fields[0], {})[fields[2]] = int(fields[3])
        return out

    def embeddings(self, mmap: bool = True) -> np.ndarray | None:
        """Precomputed image embeddings [num_images, D] float32 (synthetic corpora), else None; memory-mapped
        (`mmap`) unless the corpus has parts."""
        if self.embedding_dim is None:
            return None
        parts = []
        rows_of = [images for _, _, images in self.segments if images]
        for rows, path in zip(rows_of, self.embedding_files):
            if not path.is_file():
                raise CfirError(f"{path}: missing; the corpus is incomplete, rebuild it")
            emb = np.load(path, mmap_mode="r" if mmap else None)
            if emb.shape != (rows, self.embedding_dim) or emb.dtype != np.float32:
                raise CfirError(f"{path}: shape {emb.shape} {emb.dtype}, expected ({rows}, {self.embedding_dim}) "
                                "float32")
            parts.append(emb)
        # Parts: one matrix in memory (a grown corpus with precomputed embeddings is a synthetic or small one).
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
