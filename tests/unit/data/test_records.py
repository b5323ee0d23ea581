"""A corpus's records read without tensorflow-datasets (cfir_jax.data.records) are tfds' own, field by field."""

import pickle

import numpy as np
import pytest
import tensorflow_datasets as tfds

from cfir_jax.data.corpus import RECORD_SPLIT, RECORD_VERSION, Corpus
from cfir_jax.data.records import RecordError, RecordSource, parse_example


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert type(a[k]) is type(b[k]), k
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and (a[k] == b[k]).all(), k
        else:
            assert a[k] == b[k], k


def test_every_row_is_what_tfds_reads(world_corpus):
    corpus, _, _ = world_corpus
    for name in ("documents", "images"):
        version_dir = corpus.path / name / RECORD_VERSION
        theirs = tfds.builder_from_directory(str(version_dir)).as_data_source(split=RECORD_SPLIT)
        ours = RecordSource(version_dir, RECORD_SPLIT)
        assert len(ours) == len(theirs) > 0
        for i in range(len(ours)):
            _same(theirs[i], ours[i])
        copy = pickle.loads(pickle.dumps(ours))  # a training worker's copy opens its own readers
        _same(theirs[len(ours) - 1], copy[len(ours) - 1])
        with pytest.raises(IndexError):
            ours[len(ours)]
    assert isinstance(Corpus.open(corpus.path)._doc_source, RecordSource)


def test_a_damaged_record_set_is_refused(tmp_path, world_corpus):
    corpus, _, _ = world_corpus
    version_dir = corpus.path / "documents" / RECORD_VERSION
    for f in ("dataset_info.json", "features.json"):
        (tmp_path / f).write_bytes((version_dir / f).read_bytes())
    with pytest.raises(RecordError, match="missing shard"):
        RecordSource(tmp_path, RECORD_SPLIT)
    (tmp_path / "features.json").write_text("{")
    with pytest.raises(RecordError, match="unreadable"):
        RecordSource(tmp_path, RECORD_SPLIT)
    with pytest.raises(RecordError, match="truncated"):
        parse_example(b"\n\x10\n\x03")
