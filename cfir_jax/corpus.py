"""The one on-disk corpus format every stage reads: documents, images, qrels, optionally a tokenizer.

A corpus directory `C/` holds

    C/manifest.json              kind "corpus": name, counts, splits, embedding_dim, extra fields of the source
    C/documents/1.0.0/...        tfds array_record dataset, one record per document, in row order
    C/images/1.0.0/...           tfds array_record dataset, one record per image, in row order
    C/doc_ids.txt, image_ids.txt one id per line, line i = row i (so opening a corpus never scans the records)
    C/embeddings.npy             [num_images, D] float32, only when the images carry precomputed embeddings
    C/qrels/<split>.txt          TREC qrels, `doc_id 0 image_id rel`
    C/tokenizer.spm              optional sentencepiece model shipped with the corpus (synthetic corpora)

Records are written by a tensorflow-datasets `GeneratorBasedBuilder` with `file_format="array_record"` and read back
through `builder.as_data_source()` (tfds' TF-free example parser) wrapped in a `grain.MapDataset`, so a stage gets
random access by row index. TensorFlow is never imported. Row order is kept (`disable_shuffling=True`) because the
id lists, the embedding matrix and every downstream store index rows by position.

`embeddings.npy` duplicates the `embedding` field of the image records: downstream stages want the whole
[num_images, D] matrix memory-mapped, which decoding millions of records one by one cannot give them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import grain
import numpy as np
import tensorflow_datasets as tfds

from cfir_jax.errors import CfirError
from cfir_jax.store import atomic_dir, manifest_digest, read_manifest, write_manifest

KIND = "corpus"
FORMAT_VERSION = 1
SPLITS = ("train", "validation", "test")
RECORD_VERSION = "1.0.0"
# tfds reserves "all" and friends; every record set is stored as its one split under this name.
_RECORD_SPLIT = "train"

Qrels = dict[str, dict[str, int]]


@dataclasses.dataclass(frozen=True)
class Document:
    """A document to illustrate: `text` is the assembled text the entity and summary stages read."""

    doc_id: str
    text: str
    title: str = ""
    entities: tuple[str, ...] = ()  # planted entity names (synthetic ground truth); empty for real corpora
    # The source's list-valued fields of the document by column name (AToMiC: category, media, hierachy), kept for
    # stages that may read them (the summariser's input, `summaries.summary_input`); empty for synthetic worlds.
    metadata: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, hash=False)


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
    # caption_attribution_description, each a list of strings), embedded by the image-text stage (cfir_jax.image_text).
    texts: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict, hash=False)


def _document_features() -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict(
        {
            "doc_id": tfds.features.Text(),
            "text": tfds.features.Text(),
            "title": tfds.features.Text(),
            "entities": tfds.features.Sequence(tfds.features.Text()),
            "metadata": tfds.features.Text(),  # JSON {column: [strings]}
        }
    )


def _image_features(embedding_dim: int | None) -> tfds.features.FeaturesDict:
    spec: dict[str, Any] = {
        "image_id": tfds.features.Text(),
        "caption": tfds.features.Text(),
        "url": tfds.features.Text(),
        # Raw bytes, not tfds.features.Image: decoding is the image-cache stage's job, and corrupt bytes must survive.
        "image": tfds.features.Tensor(shape=(), dtype=np.object_),
        "entities": tfds.features.Sequence(tfds.features.Text()),
        "texts": tfds.features.Text(),  # JSON {column: [strings]}
    }
    if embedding_dim is not None:
        spec["embedding"] = tfds.features.Tensor(shape=(embedding_dim,), dtype=np.float32)
    return tfds.features.FeaturesDict(spec)


class _RecordBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Writes one iterable of example dicts as a single array_record split, in the order given."""

    VERSION = tfds.core.Version(RECORD_VERSION)
    # tfds looks for checksum files next to a builder's source, through `importlib_resources` (not installed);
    # this builder downloads nothing, so there is no source directory to look in.
    code_path = None

    def __init__(self, *, name: str, features: tfds.features.FeaturesDict, examples: Iterable[dict], **kwargs):
        self.name = name
        self._features = features
        self._examples = examples
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, features=self._features, disable_shuffling=True)

    def _split_generators(self, dl_manager):
        del dl_manager
        return {_RECORD_SPLIT: self._generate_examples()}

    def _generate_examples(self):
        yield from enumerate(self._examples)

    # tfds prints these two lines to stdout unconditionally; a library must stay quiet.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass


def _write_records(root: Path, name: str, features: tfds.features.FeaturesDict, examples: Iterable[dict]) -> None:
    scratch = root / ".tfds_scratch"
    scratch.mkdir()
    # A fresh builder makes an (unused) temporary directory for dataset infos it would fetch from GCS and never
    # removes it; pointing `tempfile` at our scratch directory keeps /tmp clean.
    saved_tempdir, tempfile.tempdir = tempfile.tempdir, os.fspath(scratch)
    try:
        builder = _RecordBuilder(
            name=name, features=features, examples=examples, data_dir=os.fspath(root), file_format="array_record"
        )
    finally:
        tempfile.tempdir = saved_tempdir
    tfds.display_progress_bar(False)
    builder.download_and_prepare(download_dir=os.fspath(scratch / "downloads"))
    shutil.rmtree(scratch, ignore_errors=True)


def _add_id(kind: str, value: Any, row: int, ids: list[str], seen: set[str]) -> str:
    """Checks a record id (TREC-safe, unique) and appends it to `ids`."""
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise CfirError(
            f"{kind} row {row}: id {value!r} must be a non-empty string without whitespace (TREC files split on it)"
        )
    if value in seen:
        raise CfirError(f"{kind} row {row}: duplicate {kind} id {value!r}; ids must be unique")
    seen.add(value)
    ids.append(value)
    return value


def _document_examples(documents: Iterable[Document], ids: list[str], digest) -> Iterator[dict]:
    """Record dicts of the documents; `digest` (a hashlib object) absorbs every record, in order."""
    seen: set[str] = set()
    for row, doc in enumerate(documents):
        doc_id = _add_id("document", doc.doc_id, row, ids, seen)
        metadata = json.dumps({k: list(v) for k, v in doc.metadata.items()}, ensure_ascii=False, sort_keys=True)
        example = {"doc_id": doc_id, "text": doc.text, "title": doc.title, "entities": list(doc.entities),
                   "metadata": metadata}
        digest.update(json.dumps(example, sort_keys=True, ensure_ascii=False).encode())
        digest.update(b"\0")
        yield example


def _image_examples(
    images: Iterable[Image], ids: list[str], embedding_dim: int | None, embeddings: list[np.ndarray],
    with_text: list[int],
) -> Iterator[dict]:
    """Record dicts of the images; `with_text` collects the rows that have any non-empty text field."""
    seen: set[str] = set()
    for row, img in enumerate(images):
        image_id = _add_id("image", img.image_id, row, ids, seen)
        if any(t.strip() for v in img.texts.values() for t in v):
            with_text.append(row)
        example = {
            "image_id": image_id,
            "caption": img.caption,
            "url": img.url,
            "image": bytes(img.image or b""),
            "entities": list(img.entities),
            "texts": json.dumps({k: list(v) for k, v in img.texts.items()}, ensure_ascii=False, sort_keys=True),
        }
        if embedding_dim is not None:
            if img.embedding is None:
                raise CfirError(f"image {image_id!r}: no embedding, but the first image has one; give all or none")
            emb = np.asarray(img.embedding, dtype=np.float32)
            if emb.shape != (embedding_dim,):
                raise CfirError(f"image {image_id!r}: embedding shape {emb.shape}, expected ({embedding_dim},)")
            example["embedding"] = emb
            embeddings.append(emb)
        elif img.embedding is not None:
            raise CfirError(f"image {image_id!r}: has an embedding, but the first image has none; give all or none")
        yield example


def _write_qrels(path: Path, split: str, qrels: Mapping[str, Mapping[str, int]], doc_ids, image_ids, drop: bool):
    """Writes one split's qrels in TREC format; returns (topics, judgements, dropped judgements)."""
    lines, dropped = [], 0
    for doc_id in sorted(qrels):
        if doc_id not in doc_ids:
            if not drop:
                raise CfirError(f"qrels[{split!r}]: doc_id {doc_id!r} is not a document of the corpus")
            dropped += len(qrels[doc_id])
            continue
        for image_id in sorted(qrels[doc_id]):
            if image_id not in image_ids:
                if not drop:
                    raise CfirError(f"qrels[{split!r}]: image_id {image_id!r} (doc {doc_id!r}) is not in the corpus")
                dropped += 1
                continue
            lines.append(f"{doc_id} 0 {image_id} {int(qrels[doc_id][image_id])}\n")
    path.write_text("".join(lines))
    topics = len({line.split(" ", 1)[0] for line in lines})
    return topics, len(lines), dropped


def _peek(items: Iterable[Any]) -> tuple[Any, Iterator[Any]]:
    """(first item or None, an iterator over all items) without consuming the first one."""
    it = iter(items)
    first = next(it, None)
    return first, (itertools.chain([first], it) if first is not None else it)


def corpus_is_complete(out_dir: str | os.PathLike, name: str, extra: Mapping[str, Any]) -> bool:
    """Whether `out_dir` holds a complete corpus `name` whose manifest has the fields `extra` (so it can be reused)."""
    try:
        manifest = read_manifest(out_dir, KIND, FORMAT_VERSION)
    except CfirError:
        return False
    return manifest.get("name") == name and all(manifest.get(k) == _jsonable(v) for k, v in extra.items())


def _jsonable(value: Any) -> Any:
    """What `value` reads back as from JSON, so a stored field compares equal to the one passed in."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def write_corpus(
    out_dir: str | os.PathLike,
    name: str,
    documents: Iterable[Document],
    images: Iterable[Image],
    qrels: Mapping[str, Mapping[str, Mapping[str, int]]],
    tokenizer_spm: str | os.PathLike | None = None,
    *,
    drop_unknown_qrels: bool = False,
    **manifest_fields: Any,
) -> "Corpus":
    """Writes a corpus directory atomically and opens it; does nothing when a complete one with the same
    `name` and `manifest_fields` is already there.

    `documents` and `images` are streamed once (they may be generators over files far larger than memory).
    `qrels` maps a split ("train", "validation", "test") to {doc_id: {image_id: rel}}. A judgement naming an id
    that is not in the corpus raises CfirError, or is dropped and counted when `drop_unknown_qrels` (real
    collections miss a few items). `manifest_fields` (JSON-able: the generator config, the source files) are
    stored in the manifest and decide whether an existing corpus is reused.
    """
    out_dir = Path(out_dir)
    for split in qrels:
        if split not in SPLITS:
            raise CfirError(f"qrels split {split!r} is unknown; use one of {', '.join(SPLITS)}")
    if tokenizer_spm is not None and not Path(tokenizer_spm).is_file():
        raise CfirError(f"{tokenizer_spm}: tokenizer model not found; pass an existing sentencepiece .spm file")
    if corpus_is_complete(out_dir, name, manifest_fields):
        return Corpus.open(out_dir)

    # Peek at the first items: tfds cannot write an empty split, and the first image fixes the record schema
    # (an embedding field of D floats, or none).
    first_doc, doc_iter = _peek(documents)
    if first_doc is None:
        raise CfirError(f"{out_dir}: no documents given; a corpus needs at least one document")
    first_image, image_iter = _peek(images)
    if first_image is None:
        raise CfirError(f"{out_dir}: no images given; a corpus needs at least one image")
    embedding_dim = None
    if first_image.embedding is not None:
        embedding_dim = int(np.asarray(first_image.embedding).shape[-1])

    with atomic_dir(out_dir) as tmp:
        doc_ids: list[str] = []
        image_ids: list[str] = []
        embeddings: list[np.ndarray] = []
        with_text: list[int] = []
        documents_sha = hashlib.sha256()
        _write_records(tmp, "documents", _document_features(), _document_examples(doc_iter, doc_ids, documents_sha))
        examples = _image_examples(image_iter, image_ids, embedding_dim, embeddings, with_text)
        _write_records(tmp, "images", _image_features(embedding_dim), examples)
        (tmp / "doc_ids.txt").write_text("".join(f"{i}\n" for i in doc_ids))
        (tmp / "image_ids.txt").write_text("".join(f"{i}\n" for i in image_ids))
        if embedding_dim is not None:
            np.save(tmp / "embeddings.npy", np.stack(embeddings).astype(np.float32))
        (tmp / "qrels").mkdir()
        doc_set, image_set = set(doc_ids), set(image_ids)
        splits = {}
        for split, split_qrels in qrels.items():
            topics, judgements, dropped = _write_qrels(
                tmp / "qrels" / f"{split}.txt", split, split_qrels, doc_set, image_set, drop_unknown_qrels
            )
            splits[split] = {"topics": topics, "judgements": judgements, "dropped": dropped}
        if tokenizer_spm is not None:
            shutil.copyfile(tokenizer_spm, tmp / "tokenizer.spm")
        write_manifest(
            tmp,
            KIND,
            FORMAT_VERSION,
            name=name,
            num_documents=len(doc_ids),
            num_images=len(image_ids),
            documents_sha=documents_sha.hexdigest()[:16],
            splits=splits,
            embedding_dim=embedding_dim,
            has_tokenizer=tokenizer_spm is not None,
            images_with_text=len(with_text),
            records="tfds array_record",
            **{k: _jsonable(v) for k, v in manifest_fields.items()},
        )
    return Corpus.open(out_dir)


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
    )


def _open_records(path: Path, name: str, expected: int):
    version_dir = path / name / RECORD_VERSION
    if not (version_dir / "dataset_info.json").is_file():
        raise CfirError(f"{path}: incomplete corpus ({name} records missing); rebuild the corpus")
    try:
        source = tfds.builder_from_directory(os.fspath(version_dir)).as_data_source(split=_RECORD_SPLIT)
    except Exception as e:  # tfds raises a zoo of types for a damaged dataset_info/shard; all mean "rebuild"
        raise CfirError(f"{version_dir}: unreadable {name} records ({e.__class__.__name__}); rebuild the corpus") from None
    if len(source) != expected:
        raise CfirError(f"{version_dir}: {len(source)} {name} records but the manifest says {expected}; rebuild it")
    return source


def _read_ids(path: Path, expected: int) -> list[str]:
    if not path.is_file():
        raise CfirError(f"{path}: missing; the corpus is incomplete, rebuild it")
    ids = path.read_text().split("\n")[:-1]
    if len(ids) != expected:
        raise CfirError(f"{path}: {len(ids)} ids but the manifest says {expected}; rebuild the corpus")
    return ids


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
        self._doc_source = _open_records(path, "documents", self.num_documents)
        self._image_source = _open_records(path, "images", self.num_images)
        self.documents: grain.MapDataset = grain.MapDataset.source(self._doc_source).map(_to_document)
        self.images: grain.MapDataset = grain.MapDataset.source(self._image_source).map(_to_image)

    @property
    def documents_fingerprint(self) -> str:
        """Identifies the documents' content (ids, texts, titles, in order): entities and summaries record it."""
        # Corpora written before the digest existed: their manifest (counts, sources, build time) stands in.
        return f"docs-{self.manifest.get('documents_sha') or manifest_digest(self.manifest)}"

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Corpus":
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

    def document(self, i: int) -> Document:
        """Document at row `i` (0 <= i < num_documents)."""
        if not 0 <= i < self.num_documents:
            raise CfirError(f"{self.path}: document row {i} out of range [0, {self.num_documents})")
        return self.documents[i]

    def image(self, i: int) -> Image:
        """Image at row `i` (0 <= i < num_images)."""
        if not 0 <= i < self.num_images:
            raise CfirError(f"{self.path}: image row {i} out of range [0, {self.num_images})")
        return self.images[i]

    def qrels(self, split: str) -> Qrels:
        """{doc_id: {image_id: rel}} of one split."""
        if split not in self.manifest["splits"]:
            raise CfirError(f"{self.path}: corpus has no {split!r} qrels; available: {', '.join(self.splits) or 'none'}")
        path = self.path / "qrels" / f"{split}.txt"
        if not path.is_file():
            raise CfirError(f"{path}: missing; the corpus is incomplete, rebuild it")
        out: Qrels = {}
        for n, line in enumerate(path.read_text().splitlines(), 1):
            fields = line.split()
            if len(fields) != 4:
                raise CfirError(f"{path}:{n}: expected `doc_id 0 image_id rel`, got {line!r}")
            out.setdefault(fields[0], {})[fields[2]] = int(fields[3])
        return out

    def embeddings(self, mmap: bool = True) -> np.ndarray | None:
        """Precomputed image embeddings [num_images, D] float32 (synthetic corpora), else None."""
        if self.embedding_dim is None:
            return None
        path = self.path / "embeddings.npy"
        if not path.is_file():
            raise CfirError(f"{path}: missing; the corpus is incomplete, rebuild it")
        emb = np.load(path, mmap_mode="r" if mmap else None)
        if emb.shape != (self.num_images, self.embedding_dim) or emb.dtype != np.float32:
            raise CfirError(
                f"{path}: shape {emb.shape} {emb.dtype}, expected ({self.num_images}, {self.embedding_dim}) float32"
            )
        return emb
