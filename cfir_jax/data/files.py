"""A collection from plain files (`index.corpus.source="files"`) into the corpus format: no AToMiC layout needed.

- Documents (`index.corpus.documents`): a JSONL file (one JSON object a line) or a parquet file, rows with `id` and
  `text`, optional `title` and `lang` (the document's language, "fr"; detected when not stated: docs/languages.md);
  any further string or list-of-strings field is kept as the document's metadata.
- Images (`index.corpus.images`): either a directory tree of image files (IMAGE_SUFFIXES), the id being the path
  relative to the directory without its suffix (`cats/tom.png` -> `cats/tom`; whitespace, control characters and
  `%` percent-encoded, `people/Grace Hopper.jpg` -> `people/Grace%20Hopper`: `image_id_of_path`, reversed by
  `path_of_image_id`; the relative path itself is kept as the image's `url`), or a JSONL/parquet file of rows with
  `id` and then `path` (relative to that file's directory) or `bytes` (parquet: binary; JSONL: base64), optional
  caption fields (`caption`, kept as AToMiC's `caption_reference_description`, or any of IMAGE_TEXT_FIELDS, read by
  the image-text stages), an optional `lang` (their language) and an optional precomputed `embedding` (a list of
  floats; all rows or none). A row with an embedding needs no `path` or `bytes` (the image itself is then not
  kept).
  Any other field of an image row is one of the image's own fields (`date`, `source`, `tags`, ...), typed on first
  sight (ISO date, number, string, boolean or list of strings; null is no value: `cfir_jax.core.image_field_types`) and
  filtered on at query time (docs/filters.md); a value of another type than the field's first, a nested object or a
  list of non-strings is one line naming the field and the row.
- Qrels (`index.corpus.qrels`, optional): a directory of TREC qrels `<split>.qrels` or `<split>.txt` for the splits
  train, validation and test, lines `doc_id 0 image_id rel`.

A bad row is one line naming the file and its line (JSONL) or row (parquet): a missing or empty field, a duplicate
id, an id with whitespace, text that is not UTF-8. A file name never is: an image file that is empty, missing or
does not decode is written with its bytes (or none), and the image cache skips and lists it, as for any corpus.

Ids are NFC-normalised (a name typed on one system and copied from another looks the same and is the same id), the
ids of rows and qrels as the names of files. In a folder, files are read in sorted order:
- the second of two files of one stem (`tom.JPG`, then `tom.png`) keeps its suffix in its id (`tom.png`);
- of two names that differ only in Unicode form (`Zu\u0308rich.png` in NFD, which sorts first, and `Z\u00fcrich.png` in
  NFC), the second is not read: it is written with no bytes under its name with every non-ASCII character
  percent-encoded (`Z%C3%BCrich.png`), so the image cache skips it and names it in skipped.tsv.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import unicodedata
from collections.abc import Container, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote

import numpy as np

from cfir_jax.core.config import IMAGE_TEXT_FIELDS
from cfir_jax.core.errors import CfirError, first_line
from cfir_jax.core.image_field_types import FieldTypes
from cfir_jax.core.jsonl import read_json_lines
from cfir_jax.core.languages import check_code
from cfir_jax.data.corpus import SPLITS, Corpus, Document, Image
from cfir_jax.data.corpus_languages import Detect
from cfir_jax.data.corpus_writer import Qrels, corpus_is_complete, write_corpus

NAME = "files"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
QRELS_SUFFIXES = (".qrels", ".txt")
ROW_FILE_SUFFIXES = (".jsonl", ".parquet")
# Fields of an image row that are not caption text.
IMAGE_ROW_FIELDS = ("id", "path", "bytes", "embedding", "url", "lang")
# Every other field of an image row is one of the image's own fields (date, source, ...: core.image_field_types).
_NOT_FIELDS = frozenset((*IMAGE_ROW_FIELDS, "caption", *IMAGE_TEXT_FIELDS))

Row = tuple[str, dict[str, Any]]  # (where: "file:line" or "file: row n", the row's fields)


def _parquet_rows(path: Path) -> Iterator[Row]:
    # why: pyarrow loads for a parquet collection only
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise CfirError(f"{path}: not a readable parquet file ({first_line(e)})") from None
    n = 0
    try:
        for batch in pf.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                n += 1
                yield f"{path}: row {n}", row
    except UnicodeDecodeError:
        raise CfirError(f"{path}: row {n + 1}: not UTF-8 text; re-encode the file as UTF-8") from None


def _rows(path: Path, what: str) -> Iterator[Row]:
    if not path.is_file():
        raise CfirError(f"{path}: {what} file not found (index.corpus.{what})")
    if path.suffix == ".jsonl":
        return read_json_lines(path)
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    raise CfirError(f"{path}: index.corpus.{what} must be a .jsonl or .parquet file")


def _string(where: str, row: dict, field: str, required: bool = True) -> str:
    value = row.get(field)
    if value is None or value == "":
        if required:
            raise CfirError(f"{where}: missing field {field!r}")
        return ""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise CfirError(f"{where}: field {field!r} is not UTF-8 text") from None
    if not isinstance(value, str):
        raise CfirError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    return value


def _row_id(where: str, row: dict, seen: dict[str, str], kind: str, existing: Container[str] = ()) -> str:
    value = row.get("id")
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    value = unicodedata.normalize("NFC", _string(where, {"id": value}, "id"))
    if any(c.isspace() for c in value):
        raise CfirError(f"{where}: {kind} id {value!r} has whitespace (TREC files split on it)")
    if value in seen:
        raise CfirError(f"{where}: duplicate {kind} id {value!r} (first at {seen[value]})")
    if value in existing:
        raise CfirError(f"{where}: {kind} id {value!r} is already in the collection; give new rows new ids")
    seen[value] = where
    return value


def _strings(where: str, field: str, value: Any) -> tuple[str, ...] | None:
    """A string or list-of-strings field as a tuple of its non-empty strings; None for any other type."""
    if isinstance(value, str):
        return (value,) if value.strip() else ()
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(v for v in value if v.strip())
    return None


def _lang(where: str, row: dict) -> str:
    """A row's stated language (`"lang": "fr"`), '' when it states none (the corpus writer detects it then)."""
    value = row.get("lang")
    return "" if value is None or value == "" else check_code(value, where)


def read_documents(path: str | os.PathLike, existing: Container[str] = ()) -> Iterator[Document]:
    """The documents of a JSONL or parquet file, in file order (module docstring); an id in `existing` (the
    collection an addition joins) is refused like a duplicate."""
    seen: dict[str, str] = {}
    for where, row in _rows(Path(path), "documents"):
        doc_id = _row_id(where, row, seen, "document", existing)
        text = _string(where, row, "text")
        title = _string(where, row, "title", required=False)
        metadata = {}
        for field, value in row.items():
            if field not in ("id", "text", "title", "lang") and (strings := _strings(where, field, value)) is not None:
                metadata[field] = strings
        yield Document(doc_id=doc_id, text=text, title=title, metadata=metadata, lang=_lang(where, row))


def _escaped(c: str) -> bool:
    """Whether an id cannot carry the character as it is: whitespace (TREC files split on it), control and format
    characters, and `%` itself (so that the encoding reverses)."""
    return c == "%" or c.isspace() or unicodedata.category(c) in ("Cc", "Cf", "Zs", "Zl", "Zp", "Cs")


def image_id_of_path(relative: str, ascii_only: bool = False) -> str:
    """The image id of an image at `relative` (a POSIX path under the images folder, its suffix removed): the path
    with every character an id cannot carry (`ascii_only`: and every non-ASCII one) percent-encoded as UTF-8
    (`Grace Hopper` -> `Grace%20Hopper`)."""
    return "".join("".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogateescape"))
                   if _escaped(c) or (ascii_only and not c.isascii()) else c for c in relative)


def path_of_image_id(image_id: str) -> str:
    """The relative path (without its suffix) an image id of a folder of images was made from."""
    return unquote(image_id, errors="surrogateescape")


def image_files(root: Path) -> list[Path]:
    """The image files (IMAGE_SUFFIXES, any case) under `root`, in path order."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _directory_images(root: Path, existing: Container[str], files: list[Path] | None = None) -> Iterator[Image]:
    seen: dict[str, str] = {}
    names: set[str] = set()  # the NFC relative paths read
    files = image_files(root) if files is None else sorted(files)
    if not files:
        raise CfirError(f"{root}: no image files ({', '.join(IMAGE_SUFFIXES)}) under index.corpus.images")
    for p in files:
        rel = p.relative_to(root).as_posix()
        name = unicodedata.normalize("NFC", rel)
        if name in names:  # an earlier file's name in another Unicode form: not read, skipped by the image cache
            image_id = _row_id(str(p), {"id": image_id_of_path(rel, ascii_only=True)}, seen, "image", existing)
            yield Image(image_id=image_id, url=rel)
            continue
        names.add(name)
        image_id = image_id_of_path(str(PurePosixPath(name).with_suffix("")))
        if image_id in seen:  # the second file of one stem keeps its suffix
            image_id = image_id_of_path(name)
        _row_id(str(p), {"id": image_id}, seen, "image", existing)
        yield Image(image_id=image_id, url=rel, image=p.read_bytes())


def _image_bytes(where: str, row: dict, base: Path, embedded: bool = False) -> bytes:
    """The encoded image of a row: its `bytes`, or the file its `path` names; b"" (skipped and listed by the image
    cache) when that file is missing, and for a row that carries its embedding alone (`embedded`)."""
    if row.get("bytes") is not None:
        data = row["bytes"]
        if isinstance(data, str):  # JSONL carries bytes as base64
            try:
                return base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise CfirError(f"{where}: field 'bytes' is not base64") from None
        return bytes(data)
    rel = _string(where, row, "path", required=False)
    if not rel and embedded:
        return b""
    if not rel:
        raise CfirError(f"{where}: missing field 'path' (or 'bytes')")
    file = base / rel
    return file.read_bytes() if file.is_file() else b""


def _image_embedding(where: str, row: dict, want: list[bool | None]) -> np.ndarray | None:
    """The row's precomputed embedding; the first row decides whether every row has one (`want`, a 1-cell box)."""
    value = row.get("embedding")
    has = value is not None
    if want[0] is None:
        want[0] = has
    if has != want[0]:
        first = "has" if want[0] else "has none"
        raise CfirError(f"{where}: {'no' if not has else 'an'} embedding, but the first row {first}; give all or none")
    if not has:
        return None
    try:
        emb = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise CfirError(f"{where}: field 'embedding' must be a list of numbers") from None
    if emb.ndim != 1 or not np.all(np.isfinite(emb)):
        raise CfirError(f"{where}: field 'embedding' must be a flat list of finite numbers")
    return emb


def _row_images(path: Path, existing: Container[str], known_fields: Mapping[str, str] | None = None
                ) -> Iterator[Image]:
    seen: dict[str, str] = {}
    types = FieldTypes(known_fields)
    want: list[bool | None] = [None]
    dim: list[int] = []
    for where, row in _rows(path, "images"):
        image_id = _row_id(where, row, seen, "image", existing)
        emb = _image_embedding(where, row, want)
        if emb is not None:
            dim = dim or [emb.shape[0]]
            if emb.shape[0] != dim[0]:
                raise CfirError(f"{where}: embedding of {emb.shape[0]} numbers, the first row's has {dim[0]}")
        texts = {}
        caption = _string(where, row, "caption", required=False)
        if caption:
            texts[IMAGE_TEXT_FIELDS[0]] = (caption,)
        for field in IMAGE_TEXT_FIELDS:
            if field in row and (strings := _strings(where, field, row[field])) is not None:
                texts[field] = strings
        first = next((t for f in IMAGE_TEXT_FIELDS for t in texts.get(f, ()) if t.strip()), "")
        fields = types.check(where, {k: v for k, v in row.items() if k not in _NOT_FIELDS})
        yield Image(image_id=image_id, caption=first, url=_string(where, row, "url", required=False),
                    image=_image_bytes(where, row, path.parent, emb is not None), embedding=emb, texts=texts,
                    lang=_lang(where, row) if first else "", fields=fields)


def read_images(path: str | os.PathLike, existing: Container[str] = (), files: list[Path] | None = None,
                known_fields: Mapping[str, str] | None = None) -> Iterator[Image]:
    """The images of a directory tree of image files (or of the image `files` under it) or of a JSONL/parquet file
    of rows (module docstring); an id in `existing` is refused like a duplicate."""
    path = Path(path)
    if path.is_dir():
        return _directory_images(path, existing, files)
    return _row_images(path, existing, known_fields)


def row_paths(path: str | os.PathLike) -> set[Path]:
    """The image files the rows of an images JSONL/parquet file name by `path` (resolved)."""
    path = Path(path)
    return {(path.parent / row["path"]).resolve() for _, row in _rows(path, "images")
            if isinstance(row.get("path"), str) and row["path"]}


def _qrels_file(root: Path, split: str) -> Path | None:
    found = [root / f"{split}{s}" for s in QRELS_SUFFIXES if (root / f"{split}{s}").is_file()]
    if len(found) > 1:
        raise CfirError(f"{root}: both {found[0].name} and {found[1].name}; keep one qrels file per split")
    return found[0] if found else None


def read_qrels(root: str | os.PathLike) -> dict[str, dict[str, dict[str, int]]]:
    """{split: {doc_id: {image_id: rel}}} of the qrels files `<split>.qrels` or `<split>.txt` in `root`."""
    root = Path(root)
    if not root.is_dir():
        raise CfirError(f"{root}: qrels directory not found (index.corpus.qrels)")
    out: dict[str, dict[str, dict[str, int]]] = {}
    for split in SPLITS:
        path = _qrels_file(root, split)
        if path is None:
            continue
        qrels: dict[str, dict[str, int]] = {}
        for where, line in _qrels_lines(path):
            fields = line.split()
            if len(fields) != 4 or not fields[3].lstrip("-").isdigit():
                raise CfirError(f"{where}: expected `doc_id 0 image_id rel`, got {line.strip()!r}")
            doc_id, image_id = (unicodedata.normalize("NFC", f) for f in (fields[0], fields[2]))
            qrels.setdefault(doc_id, {})[image_id] = int(fields[3])
        out[split] = qrels
    if not out:
        names = ", ".join(f"{s}{x}" for s in SPLITS for x in QRELS_SUFFIXES[:1])
        raise CfirError(f"{root}: no qrels files ({names}, or .txt); leave index.corpus.qrels empty for none")
    return out


def _qrels_lines(path: Path) -> Iterator[tuple[str, str]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CfirError(f"{path}:{n}: not UTF-8 text") from None
            if line.strip():
                yield f"{path}:{n}", line


def _stamp(path: Path) -> list:
    """What identifies an input's content cheaply: a file's size and mtime, a directory's file list and theirs."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for p in files:
        st = p.stat()
        digest.update(f"{p.relative_to(path) if path.is_dir() else p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return [os.fspath(path.absolute()), digest.hexdigest()[:16]]


def build_files_corpus(documents: str | os.PathLike, images: str | os.PathLike, qrels: str | os.PathLike | None,
                       out_dir: str | os.PathLike, tokenizer_spm: str | os.PathLike | None = None,
                       detect: Detect | None = None) -> Corpus:
    """Writes the collection of plain files into the corpus directory `out_dir` (reused when the same inputs,
    unchanged, made it). `tokenizer_spm`: a sentencepiece model the corpus ships (the tokenizer of a model trained
    elsewhere on a synthetic world); None: the config's `tokenizer` is used. `detect`: the language of each row that
    states none (`cfir_jax.data.corpus_writer.write_corpus`)."""
    if not documents or not images:
        raise CfirError("index.corpus.source='files': set --config.index.corpus.documents=FILE (.jsonl or .parquet) "
                        "and --config.index.corpus.images=DIR or FILE")
    documents, images = Path(documents), Path(images)
    if not images.exists():
        raise CfirError(f"{images}: images not found (index.corpus.images)")
    fields = {"source": "files", "documents_file": _stamp(documents), "images_from": _stamp(images),
              "qrels_dir": _stamp(Path(qrels)) if qrels else None,
              "tokenizer_from": _stamp(Path(tokenizer_spm)) if tokenizer_spm else None}
    if corpus_is_complete(out_dir, NAME, fields):
        return Corpus.open(out_dir)
    judged = read_qrels(qrels) if qrels else {}
    files = {split: os.fspath(_qrels_file(Path(qrels), split)) for split in judged}
    return write_corpus(out_dir, NAME, read_documents(documents), read_images(images), Qrels(judged, files=files),
                        tokenizer_spm, detect=detect, **fields)
