"""Bulk retrieval (batches of documents, spaCy workers, batched SR) and the SR backend switch, on the tiny world."""

import copy
import os

import numpy as np
import pytest

from cfir_jax.core import config_check
from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.pipeline import DocumentInput, Retriever


def _with(config, entity_workers: int | None = None, **retrieval):  # noqa: F811
    cfg = copy.deepcopy(config)
    cfg.retrieval.update(retrieval)
    if entity_workers is not None:
        cfg.entity_workers.bulk = entity_workers
    return cfg


def _same_results(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.entities, x.unknown_entities, x.summary, x.note, x.num_candidates) == \
            (y.entities, y.unknown_entities, y.summary, y.note, y.num_candidates)
        assert [h.row for h in x.hits] == [h.row for h in y.hits]
        assert [h.entities for h in x.hits] == [h.entities for h in y.hits]
        np.testing.assert_allclose([h.score for h in x.hits], [h.score for h in y.hits], rtol=1e-5, atol=1e-6)


def _fresh_documents(r: Retriever, n: int) -> list[DocumentInput]:
    """Test documents without the index's entities and summaries, so the bulk path computes them."""
    docs = [DocumentInput(d.text, d.doc_id) for d in r.corpus_documents("test")[:n]]
    docs.append(DocumentInput("Nothing named here at all.", "no-entity"))  # the whole-cache fallback
    return docs


def test_bulk_batches_with_entity_workers_equal_one_at_a_time(workdir, config):  # noqa: F811
    bulk = Retriever(_with(config, batch_size=3, entity_workers=2, sr_backend="cpu"), workdir)
    docs = _fresh_documents(bulk, 8)  # 9 documents >= 2 batches: spaCy runs in 2 worker processes
    forks = []
    os.register_at_fork(before=lambda: forks.append(os.getpid()))  # runs on every os.fork() of this process
    together = bulk.retrieve_many(docs, progress=True)
    assert forks == [], "spaCy's workers were forked from this (JAX, multithreaded) process"
    single = Retriever(_with(config, sr_backend="cpu"), workdir)
    _same_results(together, [single.retrieve(d) for d in docs])
    pool = bulk.entities.workers()  # persistent: a second bulk call reuses the started workers
    _same_results(bulk.retrieve_many(docs), together)
    assert bulk.entities.workers() is pool and forks == []
    assert together[-1].note and all(r.hits for r in together)


@pytest.mark.parametrize("method", ["cfir", "dense_summary"])
def test_device_backend_equals_cpu_backend(workdir, config, method):  # noqa: F811
    cpu = Retriever(_with(config, sr_backend="cpu"), workdir, method)
    device = Retriever(_with(config, sr_backend="device", sr_buckets=(64, 512), sr_query_batch=4), workdir, method)
    assert device.sr_backend() == "device" and cpu.sr_backend() == "cpu"
    docs = cpu.corpus_documents("test")[:6]
    docs.append(DocumentInput("Zorblax Quintavenor met Professor Hyllandrup.", "unseen"))  # unseen entities
    _same_results(device.retrieve_many(docs), cpu.retrieve_many(docs))
    if method == "cfir":
        assert device.device_cache().traces <= 2  # one compilation per bucket used, whatever the union sizes


def test_unknown_sr_backend_is_one_line_error(workdir, config):  # noqa: F811
    # The retrieval section is checked once, where a config is loaded (cli.load runs config_check.check).
    with pytest.raises(CfirError, match="sr_backend='gpu'"):
        config_check.check(_with(config, sr_backend="gpu"))
