"""What the service asks of a workdir before it loads it (`cfir_jax.serve.resident`), read from the declarations of
its directories: the training runs hold no manifest and are no stores, a build under way beside a store is named,
and the index's fingerprint leaves out what the Retriever derives."""

from __future__ import annotations

import pytest
from workdirs import full_trained, write_store

from cfir_jax.core.errors import CfirError
from cfir_jax.serve.resident import check_complete, check_intact, index_fingerprint
from cfir_jax.stores.atomic_write import partial_dir, work_dir


def test_the_service_takes_a_workdir_where_full_training_ran(tmp_path):
    w = full_trained(tmp_path / "W")
    check_complete(w)
    check_intact(w)


@pytest.mark.parametrize("in_progress", [work_dir, partial_dir])
def test_a_build_under_way_beside_a_store_is_named(tmp_path, in_progress):
    w = full_trained(tmp_path / "W")
    busy = in_progress(w / "summaries")
    busy.mkdir()
    with pytest.raises(CfirError, match=rf"summaries: a build is in progress or was interrupted \({busy.name}\)"):
        check_complete(w)


def test_the_fingerprint_follows_the_stores_and_not_what_the_retriever_derives(tmp_path):
    w = full_trained(tmp_path / "W")
    before = index_fingerprint(w)
    write_store(w, "sr_compact")  # made again by the Retriever whenever missing or stale
    assert index_fingerprint(w) == before
    write_store(w, "entities")
    assert index_fingerprint(w) != before
