"""index.py's entity stage over entity_workers.index processes (`cfir_jax.nlp.entity_workers`, the one way spaCy runs
elsewhere): one per usable core by default, the same store as parsed in the command's own process, and its workers
gone with the stage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cfir_jax.builders import entities
from cfir_jax.data.synthetic import SyntheticConfig, generate
from cfir_jax.nlp.entity_workers import DOCUMENTS_PER_WORKER, EntityWorkers
from cfir_jax.stores.layout import Layout


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("world") / "corpus", SyntheticConfig.tiny())


def _children() -> list[int]:
    """This process's living child processes."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(os.getpid()) and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _config(workers: int | None):
    from configs.demo import get_config

    config = get_config("tiny")
    if workers is not None:  # None: the config's default
        config.entity_workers.index = workers
    config.index.entities.batch_size = 7  # several chunks per worker
    return config


def test_the_entity_stage_with_workers_writes_the_store_the_process_alone_writes(corpus, tmp_path):
    alone = entities.build_entities(_config(1), Layout.of(tmp_path / "alone"), corpus)
    extractor = entities.entity_extractor(_config(2), corpus.num_documents).extractor
    assert isinstance(extractor.workers, EntityWorkers) and extractor.workers.workers == 2
    extractor.workers.close()
    before = _children()
    pooled = entities.build_entities(_config(2), Layout.of(tmp_path / "pooled"), corpus)
    assert _children() == before  # the stage's workers ended with it
    assert [pooled.entities_of(i) for i in range(pooled.num_docs)] == \
        [alone.entities_of(i) for i in range(alone.num_docs)]
    assert any(alone.entities_of(i) for i in range(alone.num_docs))
    assert pooled.manifest["labels"] == alone.manifest["labels"]
    assert entities.entity_extractor(_config(1), 10_000).extractor.workers is None


def test_the_entity_stage_runs_a_worker_per_usable_core_by_default(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 3})  # the cores this process may use
    pool = entities.entity_extractor(_config(None), 3 * DOCUMENTS_PER_WORKER).extractor.workers
    try:
        assert isinstance(pool, EntityWorkers) and pool.workers == 3 and len(pool.describe()["pids"]) == 3
    finally:
        pool.close()


def test_a_default_pool_starts_no_worker_that_its_documents_do_not_pay_for(monkeypatch, corpus):
    """A worker per DOCUMENTS_PER_WORKER documents to parse, up to the usable cores: the tiny world's 40 parse in the
    command's own process, and so does an addition of a few documents to a large collection."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 3})
    before = _children()
    assert entities.entity_extractor(_config(None), corpus.num_documents).extractor.workers is None
    assert entities.entity_extractor(_config(None), 2 * DOCUMENTS_PER_WORKER - 1, {"en": 10_000}).extractor \
        .workers is None  # one worker's worth: the main thread
    assert _children() == before
