"""The corpus's records as tensorflow-datasets writes them: the documents' and images' features, and one iterable of
example dicts written as a single array_record split (no TensorFlow). Only the corpus writer loads tfds; a query
reads the records without it (`cfir_jax.data.records`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from cfir_jax.data.corpus import RECORD_SPLIT, RECORD_VERSION


def document_features() -> tfds.features.FeaturesDict:
    return tfds.features.FeaturesDict(
        {
            "doc_id": tfds.features.Text(),
            "text": tfds.features.Text(),
            "title": tfds.features.Text(),
            "entities": tfds.features.Sequence(tfds.features.Text()),
            "metadata": tfds.features.Text(),  # JSON {column: [strings]}
        }
    )


def image_features(embedding_dim: int | None) -> tfds.features.FeaturesDict:
    spec: dict[str, Any] = {
        "image_id": tfds.features.Text(),
        "caption": tfds.features.Text(),
        "url": tfds.features.Text(),
        # Raw bytes, not tfds.features.Image: decoding is the image-cache stage's job, and corrupt bytes must survive.
        "image": tfds.features.Tensor(shape=(), dtype=np.object_),
        "entities": tfds.features.Sequence(tfds.features.Text()),
        "texts": tfds.features.Text(),  # JSON {column: [strings]}
        "fields": tfds.features.Text(),  # JSON {field: value}: the image's own flat fields
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
        return {RECORD_SPLIT: self._generate_examples()}

    def _generate_examples(self):
        yield from enumerate(self._examples)

    # tfds prints these two lines to stdout unconditionally; a library must stay quiet.
    def _log_download_bytes(self) -> None:
        pass

    def _log_download_done(self) -> None:
        pass


def write_records(root: Path, name: str, features: tfds.features.FeaturesDict, examples: Iterable[dict]) -> None:
    """Writes `examples` (in order) as the records `name` under `root`, tfds' array_record layout."""
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
