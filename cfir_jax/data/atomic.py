"""AToMiC from local parquet files (the Hugging Face push_to_hub layout) into the corpus format.

Each of the three datasets (AToMiC-Texts, AToMiC-Images, AToMiC-Qrels) is a directory holding
`data/<split>-00000-of-000NN-<hash>.parquet` files, as `huggingface-cli download --repo-type dataset` leaves it; a
list of parquet paths works too. The real files are tens of GB, so everything is streamed with pyarrow in record
batches, and only the columns needed are read; image row groups without a wanted image are skipped whole.

Settings: documents are always the topics of the chosen qrels splits; images are
- small: the images judged in the chosen splits' qrels,
- base:  the images judged in any of train + validation + test qrels,
- large: the whole image collection.
A judgement whose text or image is missing from the collection is dropped and counted in the manifest.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cfir_jax.core.config import IMAGE_TEXT_FIELDS
from cfir_jax.core.errors import CfirError, first_line
from cfir_jax.core.progress import bar as progress_bar
from cfir_jax.data.corpus import SPLITS, Corpus, Document, Image
from cfir_jax.data.corpus_languages import Detect
from cfir_jax.data.corpus_writer import Qrels, corpus_is_complete, write_corpus

CAPTION_FIELDS = IMAGE_TEXT_FIELDS  # the image text columns
SETTINGS = ("small", "base", "large")
TEXT_FIELDS = ("page_title", "section_title", "context_page_description", "context_section_description")
# The section's list columns, kept in the document records' metadata (the authors' summariser input appends them).
LIST_FIELDS = ("category", "media", "hierachy")  # (sic) AToMiC's spelling
QRELS_COLUMNS = ("text_id", "image_id")  # plus "rel" when present (the published qrels are binary)
BATCH_ROWS = 1024
IMAGE_BATCH_ROWS = 128  # image rows carry WebP bytes; keep a batch to a few MB

ParquetSource = str | os.PathLike | Sequence[str | os.PathLike]


def parquet_files(source: ParquetSource, split: str | None = None, what: str = "dataset") -> list[Path]:
    """The parquet files of a dataset directory (HF layout `data/<split>-*.parquet`, or any `*.parquet` below
    it), optionally of one split, or the explicit list of files given."""
    if isinstance(source, (str, os.PathLike)):
        root = Path(source)
        if root.is_file():
            files = [root]
        elif root.is_dir():
            data = root / "data" if (root / "data").is_dir() else root
            files = sorted(p for p in data.rglob("*.parquet") if p.is_file())
            if split is not None:
                files = [p for p in files if re.match(rf"{re.escape(split)}(-|\.parquet$)", p.name)]
        else:
            raise CfirError(f"{root}: {what} directory not found; pass the downloaded {what} directory")
        if not files:
            which = f"{split} " if split else ""
            raise CfirError(f"{root}: no {which}parquet files found (expected data/{split or '<split>'}-*.parquet)")
        return files
    files = [Path(p) for p in source]
    if not files:
        raise CfirError(f"no parquet files given for the {what}")
    for p in files:
        if not p.is_file():
            raise CfirError(f"{p}: {what} parquet file not found")
    return files


def _open(path: Path, columns: Sequence[str]) -> pq.ParquetFile:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise CfirError(f"{path}: not a readable parquet file ({first_line(e)})") from None
    names = set(pf.schema_arrow.names)
    for column in columns:
        if column not in names:
            raise CfirError(f"{path}: missing column {column!r}; is this the right AToMiC dataset/version?")
    return pf


def _first_text(value) -> str:
    """The first non-empty string of a list field (or the string itself); "" if none."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    for item in value:
        if item is not None and str(item).strip():
            return str(item).strip()
    return ""


def assemble_text(row: Mapping[str, object]) -> str:
    """CFIR's document text: page title, section title, page and section descriptions, joined with spaces."""
    parts = [_first_text(row.get(field)) for field in TEXT_FIELDS]
    return " ".join(p for p in parts if p)


def _strings(value) -> tuple[str, ...]:
    """The non-empty strings of a list field (a lone string is a list of one), stripped."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    return tuple(str(item).strip() for item in items if item is not None and str(item).strip())


def image_caption(row: Mapping[str, object]) -> str:
    """The first non-empty reference caption, else the alt text, else the attribution."""
    for field in CAPTION_FIELDS:
        text = _first_text(row.get(field))
        if text:
            return text
    return ""


def _image_bytes(value) -> bytes:
    """Bytes of the datasets Image struct {bytes, path}, or of a plain binary column; b"" when absent."""
    if isinstance(value, Mapping):
        value = value.get("bytes")
    return bytes(value) if value else b""


def read_qrels(qrels_dir: ParquetSource, split: str) -> dict[str, dict[str, int]]:
    """{text_id: {image_id: rel}} of one split, streamed from its parquet files."""
    out: dict[str, dict[str, int]] = {}
    for path in parquet_files(qrels_dir, split, "qrels"):
        pf = _open(path, QRELS_COLUMNS)
        columns = list(QRELS_COLUMNS) + (["rel"] if "rel" in pf.schema_arrow.names else [])
        for batch in pf.iter_batches(batch_size=65536, columns=columns):
            text_ids = batch.column("text_id").to_pylist()
            image_ids = batch.column("image_id").to_pylist()
            rels = batch.column("rel").to_pylist() if "rel" in columns else [1] * len(text_ids)
            for t, i, r in zip(text_ids, image_ids, rels):
                if t is None or i is None:
                    raise CfirError(f"{path}: a qrels row has an empty text_id or image_id")
                out.setdefault(str(t), {})[str(i)] = int(r if r is not None else 1)
    return out


def _documents(files: list[Path], wanted: set[str]) -> Iterator[Document]:
    columns = ["text_id", *TEXT_FIELDS, *LIST_FIELDS]
    seen: set[str] = set()
    with progress_bar(total=len(wanted), desc="AToMiC texts", unit="doc") as bar:
        for path in files:
            pf = _open(path, columns)
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=columns):
                for row in batch.to_pylist():
                    text_id = row["text_id"]
                    if text_id not in wanted or text_id in seen:
                        continue
                    seen.add(text_id)
                    bar.update()
                    fields = {f: (t,) for f in TEXT_FIELDS if (t := _first_text(row.get(f)))}
                    yield Document(doc_id=str(text_id), text=assemble_text(row), title=_first_text(row["page_title"]),
                                   metadata={**{field: _strings(row[field]) for field in LIST_FIELDS}, **fields})


def _images(files: list[Path], wanted: set[str] | None) -> Iterator[Image]:
    columns = ["image_id", "image_url", *CAPTION_FIELDS, "image"]
    seen: set[str] = set()
    with progress_bar(total=len(wanted) if wanted is not None else None, desc="AToMiC images", unit="img") as bar:
        for path in files:
            pf = _open(path, columns)
            for group in range(pf.num_row_groups):
                if wanted is not None:
                    # Reading the id column alone is cheap; the bytes are read only where a wanted image lives.
                    ids = pf.read_row_group(group, columns=["image_id"]).column("image_id").to_pylist()
                    if not any(i in wanted for i in ids):
                        continue
                for batch in pf.iter_batches(batch_size=IMAGE_BATCH_ROWS, row_groups=[group], columns=columns):
                    for row in batch.to_pylist():
                        image_id = row["image_id"]
                        if image_id is None or image_id in seen or (wanted is not None and image_id not in wanted):
                            continue
                        seen.add(image_id)
                        bar.update()
                        yield Image(
                            image_id=str(image_id),
                            caption=image_caption(row),
                            url=row["image_url"] or "",
                            image=_image_bytes(row["image"]),
                            texts={field: _strings(row[field]) for field in CAPTION_FIELDS},
                        )


def build_atomic_corpus(
    texts_dir: ParquetSource,
    images_dir: ParquetSource,
    qrels_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    setting: str = "base",
    splits: Sequence[str] = SPLITS,
    detect: Detect | None = None,
) -> Corpus:
    """Writes the AToMiC corpus of `setting` ("small", "base", "large") for the qrels `splits` into `out_dir`.

    Documents are the topics of `splits`; images follow the setting (module docstring). Reuses `out_dir` when it
    already holds the same setting and splits built from the same files. `detect`: each text's language
    (`cfir_jax.data.corpus_writer.write_corpus`).
    """
    if setting not in SETTINGS:
        raise CfirError(f"unknown AToMiC setting {setting!r}; use one of {', '.join(SETTINGS)}")
    splits = tuple(splits)
    if not splits or any(s not in SPLITS for s in splits):
        raise CfirError(f"splits {splits!r}: choose among {', '.join(SPLITS)}")
    text_files = parquet_files(texts_dir, None, "AToMiC texts")
    image_files = parquet_files(images_dir, None, "AToMiC images")
    if not Path(qrels_dir).is_dir():
        raise CfirError(f"{qrels_dir}: AToMiC qrels directory not found; pass the downloaded qrels directory")
    name = f"atomic-{setting}"
    fields = {
        "source": "atomic",
        "setting": setting,
        "qrels_splits": list(splits),
        "text_files": [os.fspath(p) for p in text_files],
        "image_files": [os.fspath(p) for p in image_files],
    }
    if corpus_is_complete(out_dir, name, fields):
        return Corpus.open(out_dir)

    qrels = {s: read_qrels(qrels_dir, s) for s in splits}
    topics = {t for q in qrels.values() for t in q}
    if setting == "large":
        wanted_images = None
    else:
        image_splits = splits if setting == "small" else SPLITS
        judged = [qrels[s] if s in qrels else read_qrels(qrels_dir, s) for s in image_splits]
        wanted_images = {i for q in judged for images in q.values() for i in images}
    return write_corpus(
        out_dir,
        name,
        _documents(text_files, topics),
        _images(image_files, wanted_images),
        Qrels(qrels, drop_unknown=True),
        detect=detect,
        **fields,
    )
