"""Writing a corpus: documents and images as tfds array_record records (no TensorFlow), id lists, qrels, manifest."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.core.image_field_types import FieldTypes
from cfir_jax.core.languages import REFERENCE
from cfir_jax.data.corpus import (
    FORMAT_VERSION,
    KIND,
    SPLITS,
    Corpus,
    Document,
    Image,
    own_text,
)
from cfir_jax.data.corpus_languages import Detect, language_of, write_languages
from cfir_jax.data.record_writer import document_features, image_features, write_records
from cfir_jax.stores.contract import atomic_dir, read_manifest, write_manifest


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


def _document_examples(documents: Iterable[Document], ids: list[str], digest, langs: list[str],
                       detect: Detect | None = None) -> Iterator[dict]:
    """Record dicts of the documents; `digest` (a hashlib object) absorbs every record, in order, and each language
    but English (so an English corpus keeps the digest it had before languages existed); `langs` collects them."""
    seen: set[str] = set()
    for row, doc in enumerate(documents):
        doc_id = _add_id("document", doc.doc_id, row, ids, seen)
        metadata = json.dumps({k: list(v) for k, v in doc.metadata.items()}, ensure_ascii=False, sort_keys=True)
        example = {"doc_id": doc_id, "text": doc.text, "title": doc.title, "entities": list(doc.entities),
                   "metadata": metadata}
        digest.update(json.dumps(example, sort_keys=True, ensure_ascii=False).encode())
        digest.update(b"\0")
        langs.append(language_of(doc.lang, doc.text, detect and detect.document) or REFERENCE)
        if langs[-1] != REFERENCE:
            digest.update(f"lang={langs[-1]}\0".encode())
        yield example


def _image_examples(
    images: Iterable[Image], ids: list[str], embedding_dim: int | None, embeddings: list[np.ndarray],
    with_text: list[int], langs: list[str], detect: Detect | None = None, among: Collection[str] = (),
    types: FieldTypes | None = None,
) -> Iterator[dict]:
    """Record dicts of the images; `with_text` collects the rows that have any non-empty text field, `langs` the
    language of each row's own text ('' without text), detected among the languages `among` (the documents'), `types`
    the type of each of the images' own fields (a conflicting one is refused, naming the image)."""
    seen: set[str] = set()
    among = frozenset(among)
    types = types if types is not None else FieldTypes()
    caption = (lambda text: detect.caption(text, among)) if detect is not None else None
    for row, img in enumerate(images):
        image_id = _add_id("image", img.image_id, row, ids, seen)
        langs.append(language_of(img.lang, own_text(img), caption))
        fields = types.check(f"image {image_id!r}", img.fields)
        if any(t.strip() for v in img.texts.values() for t in v):
            with_text.append(row)
        example = {
            "image_id": image_id,
            "caption": img.caption,
            "url": img.url,
            "image": bytes(img.image or b""),
            "entities": list(img.entities),
            "texts": json.dumps({k: list(v) for k, v in img.texts.items()}, ensure_ascii=False, sort_keys=True),
            "fields": json.dumps(fields, ensure_ascii=False, sort_keys=True),
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


def write_split_qrels(path: Path, split: str, qrels: Mapping[str, Mapping[str, int]], doc_ids, image_ids, drop: bool,
                 label: str):
    """Writes one split's qrels in TREC format; returns (topics, judgements, dropped judgements). `label` names the
    judgements in an error (the source's qrels file, or qrels['split'])."""
    lines, dropped = [], 0
    for doc_id in sorted(qrels):
        if doc_id not in doc_ids:
            if not drop:
                raise CfirError(f"{label}: doc_id {doc_id!r} is not a document of the corpus")
            dropped += len(qrels[doc_id])
            continue
        for image_id in sorted(qrels[doc_id]):
            if image_id not in image_ids:
                if not drop:
                    raise CfirError(f"{label}: image_id {image_id!r} (doc {doc_id!r}) is not in the corpus")
                dropped += 1
                continue
            lines.append(f"{doc_id} 0 {image_id} {int(qrels[doc_id][image_id])}\n")
    path.write_text("".join(lines), encoding="utf-8")
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


def _check_arguments(qrels: Mapping[str, Any], tokenizer_spm: str | os.PathLike | None) -> None:
    """One-line errors for an unknown qrels split or a missing tokenizer file."""
    for split in qrels:
        if split not in SPLITS:
            raise CfirError(f"qrels split {split!r} is unknown; use one of {', '.join(SPLITS)}")
    if tokenizer_spm is not None and not Path(tokenizer_spm).is_file():
        raise CfirError(f"{tokenizer_spm}: tokenizer model not found; pass an existing sentencepiece .spm file")


def _first_items(
    out_dir: Path, documents: Iterable[Document], images: Iterable[Image]
) -> tuple[Iterator[Document], Iterator[Image], int | None]:
    """(documents, images, embedding dim or None), after checking that neither is empty."""
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
    return doc_iter, image_iter, embedding_dim


@dataclasses.dataclass
class _Written:
    """What `_write_items` wrote: the ids in order, the rows of images with text, the digest of the documents."""

    doc_ids: list[str]
    image_ids: list[str]
    with_text: list[int]
    documents_sha: str
    doc_langs: list[str] = dataclasses.field(default_factory=list)
    image_langs: list[str] = dataclasses.field(default_factory=list)
    field_types: dict[str, str] = dataclasses.field(default_factory=dict)


def _write_items(
    tmp: Path, doc_iter: Iterator[Document], image_iter: Iterator[Image], embedding_dim: int | None,
    detect: Detect | None = None,
) -> _Written:
    """Streams the documents and images into their records, then writes the id lists and embeddings.npy."""
    w = _Written([], [], [], "")
    embeddings: list[np.ndarray] = []
    documents_sha = hashlib.sha256()
    write_records(tmp, "documents", document_features(),
                   _document_examples(doc_iter, w.doc_ids, documents_sha, w.doc_langs, detect))
    types = FieldTypes()
    examples = _image_examples(image_iter, w.image_ids, embedding_dim, embeddings, w.with_text, w.image_langs, detect,
                               set(w.doc_langs), types)
    write_records(tmp, "images", image_features(embedding_dim), examples)
    (tmp / "doc_ids.txt").write_text("".join(f"{i}\n" for i in w.doc_ids), encoding="utf-8")
    (tmp / "image_ids.txt").write_text("".join(f"{i}\n" for i in w.image_ids), encoding="utf-8")
    if embedding_dim is not None:
        np.save(tmp / "embeddings.npy", np.stack(embeddings).astype(np.float32))
    w.documents_sha, w.field_types = documents_sha.hexdigest(), types.kinds
    return w


def _write_all_qrels(
    tmp: Path, qrels: Mapping[str, Mapping[str, Mapping[str, int]]], written: _Written, drop: bool,
    qrels_files: Mapping[str, str],
) -> dict[str, dict[str, int]]:
    """Writes qrels/<split>.txt for every split; returns {split: {topics, judgements, dropped}} for the manifest."""
    (tmp / "qrels").mkdir()
    doc_set, image_set = set(written.doc_ids), set(written.image_ids)
    splits = {}
    for split, split_qrels in qrels.items():
        topics, judgements, dropped = write_split_qrels(
            tmp / "qrels" / f"{split}.txt", split, split_qrels, doc_set, image_set, drop,
            qrels_files.get(split, f"qrels[{split!r}]"),
        )
        splits[split] = {"topics": topics, "judgements": judgements, "dropped": dropped}
    return splits


@dataclasses.dataclass(frozen=True)
class Qrels:
    """A collection's judgements as it gives them: `judged` maps a split ("train", "validation", "test") to
    {doc_id: {image_id: rel}}; a judgement naming an id that is not in the corpus raises CfirError, or is dropped
    and counted when `drop_unknown` (real collections miss a few items); `files` names each split's source file in
    that error."""

    judged: Mapping[str, Mapping[str, Mapping[str, int]]]
    drop_unknown: bool = False
    files: Mapping[str, str] | None = None


def write_corpus(
    out_dir: str | os.PathLike,
    name: str,
    documents: Iterable[Document],
    images: Iterable[Image],
    qrels: Qrels | Mapping[str, Mapping[str, Mapping[str, int]]],
    tokenizer_spm: str | os.PathLike | None = None,
    *,
    detect: Detect | None = None,
    **manifest_fields: Any,
) -> Corpus:
    """Writes a corpus directory atomically and opens it; does nothing when a complete one with the same
    `name` and `manifest_fields` is already there.

    `documents` and `images` are streamed once (they may be generators over files far larger than memory).
    `qrels`: the judgements (`Qrels`, or its `judged` mapping alone: an unknown id refused). `manifest_fields`
    (JSON-able: the generator config, the source files) are stored in the manifest and decide whether an existing
    corpus is reused. `detect` finds the language of each document and caption that states none
    (`cfir_jax.nlp.language_detect`; None: English).
    """
    out_dir = Path(out_dir)
    qrels = qrels if isinstance(qrels, Qrels) else Qrels(qrels)
    _check_arguments(qrels.judged, tokenizer_spm)
    if corpus_is_complete(out_dir, name, manifest_fields):
        return Corpus.open(out_dir)
    doc_iter, image_iter, embedding_dim = _first_items(out_dir, documents, images)

    with atomic_dir(out_dir) as tmp:
        written = _write_items(tmp, doc_iter, image_iter, embedding_dim, detect)
        languages = write_languages(tmp, written.doc_langs, written.image_langs, detect)
        splits = _write_all_qrels(tmp, qrels.judged, written, qrels.drop_unknown, qrels.files or {})
        if tokenizer_spm is not None:
            shutil.copyfile(tokenizer_spm, tmp / "tokenizer.spm")
        write_manifest(
            tmp,
            KIND,
            FORMAT_VERSION,
            name=name,
            num_documents=len(written.doc_ids),
            num_images=len(written.image_ids),
            documents_sha=written.documents_sha[:16],
            splits=splits,
            embedding_dim=embedding_dim,
            has_tokenizer=tokenizer_spm is not None,
            images_with_text=len(written.with_text),
            **({"image_fields": written.field_types} if written.field_types else {}),
            records="tfds array_record",
            **languages,
            **{k: _jsonable(v) for k, v in manifest_fields.items()},
        )
    return Corpus.open(out_dir)


def write_corpus_part(
    out_dir: str | os.PathLike, documents: Iterable[Document], images: Iterable[Image], embedding_dim: int | None,
    source: str | os.PathLike = "", detect: Detect | None = None, among: Collection[str] = (),
    known_fields: Mapping[str, str] | None = None,
) -> tuple[dict, _Written]:
    """Writes the rows of an addition as a corpus part (`out_dir`, a new directory; see cfir_jax.data.corpus): its
    records, id lists, embeddings.npy and manifest; a side without rows has no records. `embedding_dim` is the
    corpus' (every image then carries one embedding of that dim, else none); `source` names the addition in an
    error; `detect` finds the languages, as for `write_corpus` (`among`: the collection's documents' languages, where
    a caption's is looked for); `known_fields` the collection's field types, which the new images' fields must keep.
    Returns the part's manifest (with `image_fields`, the union's field types, when any image has fields) and what
    it wrote (its ids and languages, which the union's lists extend: the union alone records languages)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    w = _Written([], [], [], "")
    embeddings: list[np.ndarray] = []
    types = FieldTypes(known_fields)
    digest = hashlib.sha256()
    first_doc, doc_iter = _peek(documents)
    if first_doc is not None:
        write_records(out_dir, "documents", document_features(),
                       _document_examples(doc_iter, w.doc_ids, digest, w.doc_langs, detect))
    first_image, image_iter = _peek(images)
    if first_image is not None:
        examples = _image_examples(image_iter, w.image_ids, embedding_dim, embeddings, w.with_text, w.image_langs,
                                   detect, set(w.doc_langs) | set(among), types)
        write_records(out_dir, "images", image_features(embedding_dim), examples)
    if not w.doc_ids and not w.image_ids:
        raise CfirError(f"{source or out_dir}: the addition holds no documents and no images")
    (out_dir / "doc_ids.txt").write_text("".join(f"{i}\n" for i in w.doc_ids), encoding="utf-8")
    (out_dir / "image_ids.txt").write_text("".join(f"{i}\n" for i in w.image_ids), encoding="utf-8")
    if embedding_dim is not None and w.image_ids:
        np.save(out_dir / "embeddings.npy", np.stack(embeddings).astype(np.float32))
    w.documents_sha = digest.hexdigest()[:16] if w.doc_ids else ""
    manifest = write_manifest(out_dir, KIND, FORMAT_VERSION, name="part", num_documents=len(w.doc_ids),
                              num_images=len(w.image_ids), documents_sha=w.documents_sha or None,
                              splits={}, embedding_dim=embedding_dim, has_tokenizer=False,
                              images_with_text=len(w.with_text), records="tfds array_record",
                              **({"image_fields": types.kinds} if types.kinds else {}))
    return manifest, w
