"""Tiny AToMiC-shaped parquet datasets in the Hugging Face layout, for the reader's tests."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image as PILImage

CORRUPT = b"RIFF\x00\x00\x00\x00WEBPnot really an image"


@dataclasses.dataclass
class AtomicFixture:
    texts_dir: Path
    images_dir: Path
    qrels_dir: Path
    texts: dict[str, dict]  # text_id -> row
    images: dict[str, dict]  # image_id -> row
    qrels: dict[str, list[tuple[str, str]]]  # split -> [(text_id, image_id)]


def webp_bytes(color: tuple[int, int, int], size: int = 8) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", (size, size), color).save(buf, format="WEBP")
    return buf.getvalue()


def _write(path: Path, rows: list[dict], schema: pa.Schema, row_group_size: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)


TEXT_SCHEMA = pa.schema(
    [
        ("text_id", pa.string()),
        ("page_url", pa.string()),
        ("page_title", pa.string()),
        ("section_title", pa.string()),
        ("context_page_description", pa.string()),
        ("context_section_description", pa.string()),
        ("media", pa.list_(pa.string())),
        ("hierachy", pa.list_(pa.string())),
        ("category", pa.list_(pa.string())),
        ("source_id", pa.string()),
    ]
)
IMAGE_SCHEMA = pa.schema(
    [
        ("image_url", pa.string()),
        ("image_id", pa.string()),
        ("language", pa.list_(pa.string())),
        ("caption_reference_description", pa.list_(pa.string())),
        ("caption_alt_text_description", pa.list_(pa.string())),
        ("caption_attribution_description", pa.list_(pa.string())),
        ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
    ]
)
QRELS_SCHEMA = pa.schema([("text_id", pa.string()), ("Q0", pa.string()), ("image_id", pa.string()),
                          ("rel", pa.int32())])


def _text(i: int, title, section, page_desc, section_desc) -> dict:
    return {
        "text_id": f"t{i}",
        "page_url": f"https://en.wikipedia.org/wiki/P{i}",
        "page_title": title,
        "section_title": section,
        "context_page_description": page_desc,
        "context_section_description": section_desc,
        "media": [f"i{i}"],
        "hierachy": ["Top", section or ""],
        "category": ["Cat"],
        "source_id": f"s{i}",
    }


def _image(i: int, ref, alt, attribution, data: bytes | None) -> dict:
    return {
        "image_url": f"https://upload.wikimedia.org/i{i}.webp",
        "image_id": f"i{i}",
        "language": ["en"],
        "caption_reference_description": ref,
        "caption_alt_text_description": alt,
        "caption_attribution_description": attribution,
        "image": {"bytes": data, "path": None},
    }


def write_atomic_fixture(root: Path) -> AtomicFixture:
    """Six texts, ten images (two corrupt, one without bytes), qrels over three splits with two dangling judgements.

    Judged: train t1->{i0,i1}, t2->i2, t_missing->i6 (text absent); validation t3->i3, t4->i4; test t5->i5,
    t6->i_missing (image absent). i7, i8, i9 are judged nowhere (only the large setting has them).
    """
    texts = [
        _text(1, "Alpha", "History", "Alpha is a town.", "It was founded in 1900."),
        _text(2, "Beta", None, "Beta is a river.", ""),
        _text(3, "Gamma", "Geography", None, "Mountains surround it."),
        _text(4, "Delta", "", "", None),
        _text(5, "Epsilon", "People", "Epsilon is a village.", "Famous residents."),
        _text(6, "Zeta", "Culture", "Zeta has a museum.", "The museum opened in 1950."),
    ]
    images = [
        _image(0, ["A red square"], ["alt 0"], ["attr 0"], webp_bytes((255, 0, 0))),
        _image(1, ["", "Second reference"], [], None, webp_bytes((0, 255, 0))),
        _image(2, [], ["Alt text only"], ["attr 2"], webp_bytes((0, 0, 255))),
        _image(3, None, None, ["Attribution only"], CORRUPT),
        _image(4, [None], [""], [], webp_bytes((9, 9, 9))),
        _image(5, ["Fifth"], None, None, None),
        _image(6, ["Sixth"], None, None, webp_bytes((1, 2, 3))),
        _image(7, ["Seventh"], None, None, webp_bytes((4, 5, 6))),
        _image(8, ["Eighth"], None, None, b"\x00\x01garbage"),
        _image(9, ["Ninth"], None, None, webp_bytes((7, 8, 9))),
    ]
    qrels = {
        "train": [("t1", "i0"), ("t1", "i1"), ("t2", "i2"), ("t_missing", "i6")],
        "validation": [("t3", "i3"), ("t4", "i4")],
        "test": [("t5", "i5"), ("t6", "i_missing")],
    }
    texts_dir, images_dir, qrels_dir = root / "AToMiC-Texts", root / "AToMiC-Images", root / "AToMiC-Qrels"
    _write(texts_dir / "data" / "train-00000-of-00002-aaaa.parquet", texts[:3], TEXT_SCHEMA)
    _write(texts_dir / "data" / "train-00001-of-00002-bbbb.parquet", texts[3:5], TEXT_SCHEMA)
    _write(texts_dir / "data" / "validation-00000-of-00001-cccc.parquet", texts[5:], TEXT_SCHEMA)
    # Small row groups, so that skipping groups without a wanted image is exercised.
    _write(images_dir / "data" / "train-00000-of-00002-dddd.parquet", images[:6], IMAGE_SCHEMA, row_group_size=2)
    _write(images_dir / "data" / "train-00001-of-00002-eeee.parquet", images[6:], IMAGE_SCHEMA, row_group_size=2)
    for split, pairs in qrels.items():
        rows = [{"text_id": t, "Q0": "Q0", "image_id": i, "rel": 1} for t, i in pairs]
        _write(qrels_dir / "data" / f"{split}-00000-of-00001-ffff.parquet", rows, QRELS_SCHEMA)
    return AtomicFixture(
        texts_dir=texts_dir,
        images_dir=images_dir,
        qrels_dir=qrels_dir,
        texts={t["text_id"]: t for t in texts},
        images={i["image_id"]: i for i in images},
        qrels=qrels,
    )
