"""The one training loop over a task: each task's batch schema is what its step takes, what its batches are and what
compile-only lowers; the loop checkpoints the task's data state and hands it back on resume; a config of the other
tower is refused in one line before anything is written."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from train_fixtures import full_batch, full_config, planted_data, tiny_config

from cfir_jax.core.errors import CfirError
from cfir_jax.training import batch as batch_lib
from cfir_jax.training import loop
from cfir_jax.training.full_step import FULL_BATCH, global_full_batch
from cfir_jax.training.state import make_setup
from cfir_jax.training.step import batch_schema, global_batch_arrays
from cfir_jax.training.tasks import FullTask, TextTask


def _described(batch: dict) -> dict:
    return {k: (tuple(v.shape), np.dtype(v.dtype), v.sharding) for k, v in batch.items()}


@pytest.mark.parametrize("negatives", [0, 4])
def test_the_text_batch_is_its_schema(negatives):
    cfg = tiny_config(extra_negatives=negatives, negatives="random")
    setup = make_setup(cfg, total_steps=6, devices=jax.devices()[:1], steps_per_epoch=8)
    batch = global_batch_arrays(planted_data(), 3, cfg, setup.mesh)
    assert ("negatives" in batch_schema(cfg)) == (negatives > 0)
    assert _described(batch) == _described(batch_lib.abstract(batch_schema(cfg), cfg, setup.mesh))
    assert batch["ids"].shape == (8, 8) and batch["ids"].dtype == np.int32
    if negatives:
        assert batch["negatives"].shape == (4, 32) and batch["negatives"].sharding.is_fully_replicated


def test_the_full_batch_is_its_schema():
    cfg = full_config()
    setup = make_setup(cfg, total_steps=4, devices=jax.devices()[:1], steps_per_epoch=1, tower="dual")
    tokens = full_batch(seed=1)
    local = {"pixels": tokens["pixels"], "doc_rows": np.arange(8)[::-1], "valid": tokens["valid"]}
    batch = global_full_batch(local, tokens["ids"], tokens["mask"], setup.mesh)
    assert _described(batch) == _described(batch_lib.abstract(FULL_BATCH, cfg, setup.mesh))
    np.testing.assert_array_equal(np.asarray(batch["ids"]), tokens["ids"][::-1])


def test_a_batch_outside_the_schema_is_refused():
    cfg = tiny_config()
    setup = make_setup(cfg, total_steps=6, devices=jax.devices()[:1], steps_per_epoch=8)
    host = {"ids": np.zeros((8, 8), np.int32), "mask": np.zeros((8, 8), bool)}
    with pytest.raises(ValueError, match="not the schema's"):
        batch_lib.assemble(batch_schema(cfg), host, setup.mesh)


def test_a_task_of_the_other_tower_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(CfirError, match="does not train the 'text' tower"):
        loop.run(full_config(), tmp_path / "run", TextTask(planted_data(with_eval=False)), progress=False)
    with pytest.raises(CfirError, match="does not train the 'dual' tower"):
        loop.run(tiny_config(), tmp_path / "run", FullTask(None, np.zeros((1, 8)), np.zeros((1, 8))), progress=False)
    assert not (tmp_path / "run").exists()


class CountingTask(TextTask):
    """The text task with a data state of its own: how many batches it served, restored on resume."""

    served = 0
    restored: dict | None = None
    exports = 0

    def batch(self, index, config, mesh):
        self.served += 1
        return super().batch(index, config, mesh)

    def data_state(self, config):
        return super().data_state(config) | {"served": self.served}

    def restore_data(self, data):
        self.restored = data
        self.served = data["served"]

    def export(self, config, setup, result, workdir):
        self.exports += 1


def test_the_loop_keeps_the_tasks_data_state_and_hands_it_back(tmp_path):
    cfg = tiny_config(num_steps=2, checkpoint_every=2, eval_every=2)
    first = CountingTask(planted_data(with_eval=False))
    result = loop.run(cfg, tmp_path, first, devices=jax.devices()[:1], progress=False)
    assert first.served == 2 and first.exports == 1 and first.restored is None and not result.already_trained
    again = CountingTask(planted_data(with_eval=False))
    resumed = loop.run(cfg, tmp_path, again, devices=jax.devices()[:1], progress=False)
    assert again.restored == {"step": 2, "seed": 0, "served": 2} and again.served == 2
    assert resumed.already_trained and again.exports == 1
    assert resumed.metrics == result.metrics == {k: v for k, v in json.loads(
        (tmp_path / "metrics.jsonl").read_text().splitlines()[-1]).items() if k != "step"}
