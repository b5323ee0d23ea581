"""The base config's train step rematerialises its layers (model.remat with remat_policy='projections': each layer
keeps its six weight matmuls' outputs, recomputes the rest): the same loss and gradients as the step that stores
every activation, drop path included, in one pass and in gradient-cache micro-batches; and less memory."""

import jax
import numpy as np
import pytest
from train_fixtures import planted_data, tiny_config

from cfir_jax.training import step as step_lib
from cfir_jax.training.state import init_state, make_setup
from cfir_jax.training.step import global_batch_arrays
from configs.base import get_config


def _loss_and_grads(**model):
    cfg = tiny_config()
    cfg.model.update(model)
    data = planted_data(with_eval=False)
    setup = make_setup(cfg, total_steps=10, devices=jax.devices()[:1], steps_per_epoch=data.steps_per_epoch(8))
    state, frozen = init_state(cfg, setup, None)
    batch = global_batch_arrays(data, 0, cfg, setup.mesh)
    out = {}
    for accum in (1, 2):
        grads_fn = jax.jit(step_lib._make_grads(setup, accum))
        (loss, _), grads = grads_fn(state["params"], frozen, batch, jax.random.key(3))  # drop path is on
        out[accum] = float(loss), jax.tree.map(np.asarray, grads)
    return out


@pytest.mark.slow  # four compiles of the tiny step: about 30 s on the 2-core machine, minutes under load
def test_the_base_configs_remat_gives_the_stored_activations_loss_and_gradients():
    paper = get_config().model
    assert (paper.remat, paper.remat_policy) == (True, "projections")
    assert tiny_config().model.drop_path_rate > 0
    stored = _loss_and_grads(remat=False)
    remat = _loss_and_grads(remat=True, remat_policy=paper.remat_policy)
    for accum in (1, 2):
        assert remat[accum][0] == pytest.approx(stored[accum][0], rel=1e-6, abs=0)
        flat_stored = jax.tree_util.tree_leaves_with_path(stored[accum][1])
        flat_remat = dict(jax.tree_util.tree_leaves_with_path(remat[accum][1]))
        assert len(flat_stored) == len(flat_remat) > 10
        # Relative to the largest gradient: k_proj's bias has an exactly zero gradient, float noise in both steps.
        scale = max(float(np.abs(g).max()) for _, g in flat_stored)
        for path, g in flat_stored:
            np.testing.assert_allclose(flat_remat[path], g, rtol=1e-5, atol=1e-6 * scale, err_msg=str(path))
