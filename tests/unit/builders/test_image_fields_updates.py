"""The image_fields store through a files collection as archives write it (lists, booleans, dates with times and
offsets, nulls), an --add and a --compact: each equal to the store built over the result in one go; a store of
another format, or built in another zone, is refused in one line or rebuilt."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import numpy as np
import pytest

from cfir_jax.builders.corpus_update import stage_corpus_addition
from cfir_jax.builders.image_fields import (
    build_image_fields,
    image_fields_after_add,
    image_fields_after_compaction,
    row_fields,
)
from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.data.corpus import Corpus
from cfir_jax.data.files import build_files_corpus
from cfir_jax.retrieve.filters import Filter
from cfir_jax.stores.contract import write_manifest
from cfir_jax.stores.image_fields import ImageFields

ROWS = [  # as newsroom archives export them; every one indexed before issue 53 (extra keys were ignored)
    {"date": "2020-06-30T14:05:30Z", "source": "reuters", "tags": ["news", "sport"], "featured": True},
    {"date": "2020-06-30T21:00-04:00", "source": "ap", "tags": "sport", "featured": False, "people": []},
    {"date": "2020-07-01", "source": None, "tags": None, "people": ["Ada Lovelace", None]},
    {"source": "afp", "tags": [], "featured": None, "width": 640},
]
MORE = [{"date": "2021-03-01T08:00", "tags": "weather", "featured": True, "credit": "desk"},
        {"source": "ap", "tags": ["sport", "weather"], "people": "Grace Hopper"}]


def _files(root: Path, rows: list[dict], start: int = 0) -> Path:
    root.mkdir(parents=True)
    (root / "documents.jsonl").write_text(json.dumps({"id": f"d{start}", "text": "a text"}) + "\n")
    (root / "images.jsonl").write_text("".join(json.dumps({"id": f"i{start + k}", "bytes": "", **row}) + "\n"
                                               for k, row in enumerate(rows)))
    return root


def _base(tmp_path: Path) -> Corpus:
    src = _files(tmp_path / "src", ROWS)
    return build_files_corpus(src / "documents.jsonl", src / "images.jsonl", None, tmp_path / "corpus")


def _cache(corpus: Corpus, ids: list[str] | None = None):
    """A stand-in for the image cache: the rows the store follows."""
    ids = corpus.image_ids if ids is None else ids
    return types.SimpleNamespace(ids=ids, num_images=len(ids), content_fingerprint=f"fp-{'-'.join(ids)}")


class _Change:
    """A stand-in for the change loop's ChangeRun: the store as the workdir holds it, the new corpus and cache."""

    def __init__(self, old: Path, corpus: Corpus, cache, row_map: np.ndarray | None = None):
        self._old, self._new, self._row_map = old, {"corpus": corpus, "image_cache": cache}, row_map

    def old(self, store: str):
        return ImageFields.open(self._old)

    def new(self, store: str):
        return self._new[store]

    def kept(self, name: str) -> np.ndarray:
        return self._row_map


LINES = ["tags=sport", "tags!=sport", "tags in weather,news", "featured=true", "featured!=true", "people=Grace Hopper",
         "date<=2020-06-30", "date=2020-06-30T14:05", "date=2021-03", "source in ap,afp", "width>=600", "credit=desk"]


def _masks(store: ImageFields) -> dict[str, list[bool]]:
    """Each filter's mask (a field the store does not have yet, as the base's credit, leaves its line out)."""
    lines = [line for line in LINES if re.split("[=<>! ]", line)[0] in store.columns]
    return {line: Filter([line]).mask(store).tolist() for line in lines}


@pytest.mark.parametrize("zone", ["UTC", "America/New_York"])
def test_an_add_and_a_compaction_equal_the_store_built_in_one_go(tmp_path, zone):
    base = _base(tmp_path)
    assert base.manifest["image_fields"] == {"date": "date", "source": "string", "tags": "list",
                                             "featured": "boolean", "people": "list", "width": "number"}
    store = build_image_fields(tmp_path / "fields", base, _cache(base), zone)
    assert store.zone == zone and _masks(store)["tags=sport"] == [True, True, False, False]
    assert _masks(store)["date<=2020-06-30"] == [True, zone != "UTC", False, False]  # the evening of June 30

    stage_corpus_addition(base, tmp_path / "grown", _files(tmp_path / "add", MORE, start=4))
    grown = Corpus.open(tmp_path / "grown")
    assert grown.manifest["image_fields"]["credit"] == "string"
    added = tmp_path / "added"
    info = image_fields_after_add(_Change(tmp_path / "fields", grown, _cache(grown)), added)
    assert info == {"rows": 6, "fields": 7}
    whole = build_image_fields(tmp_path / "whole", grown, _cache(grown), zone)
    assert _masks(ImageFields.open(added)) == _masks(whole)
    assert _masks(whole)["tags=sport"] == [True, True, False, False, False, True]
    assert _masks(whole)["people=Grace Hopper"] == [False] * 5 + [True]

    keep = np.array([0, 2, 3, 5])
    row_map = np.full(6, -1)
    row_map[keep] = np.arange(len(keep))
    kept_ids = [grown.image_ids[r] for r in keep]
    compacted = tmp_path / "compacted"
    image_fields_after_compaction(_Change(added, grown, _cache(grown, kept_ids), row_map), compacted)
    expected = {line: [m[r] for r in keep] for line, m in _masks(whole).items()}
    assert _masks(ImageFields.open(compacted)) == expected
    assert row_fields(grown, kept_ids)[1]["people"] == ["Ada Lovelace", None]


def test_a_row_whose_field_cannot_be_a_column_is_one_line_naming_file_and_line(tmp_path):
    src = _files(tmp_path / "src", [ROWS[0], {"tags": ["a", 3]}])
    with pytest.raises(CfirError) as e:
        build_files_corpus(src / "documents.jsonl", src / "images.jsonl", None, tmp_path / "corpus")
    assert str(e.value) == f"{src / 'images.jsonl'}:2: field 'tags': list ['a', 3] holds int 3; a list field holds " \
                           "strings (tags, people, keywords)"


def test_a_store_of_another_format_is_refused_and_a_changed_zone_rebuilds_it(tmp_path):
    base = _base(tmp_path)
    store = build_image_fields(tmp_path / "fields", base, _cache(base), "UTC")
    assert build_image_fields(tmp_path / "fields", base, _cache(base), "UTC").manifest == store.manifest  # reused
    paris = build_image_fields(tmp_path / "fields", base, _cache(base), "Europe/Paris")
    assert paris.zone == "Europe/Paris" and paris.columns["date"].values[2] == store.columns["date"].values[2] - 7200
    write_manifest(tmp_path / "fields", "image_fields", 1, columns=[], num_rows=4)
    with pytest.raises(StoreError, match="image_fields format version 1 but this code reads 2; rebuild it$"):
        ImageFields.open(tmp_path / "fields")
