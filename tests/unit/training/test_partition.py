"""Sharding declared by logical axis names: the config's rules -> PartitionSpecs of parameters and optimizer state."""

import jax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from cfir_jax.core.errors import CfirError
from cfir_jax.training import partition
from cfir_jax.training.state import make_setup


def _large_setup():
    from configs.large import get_config

    # One device: the 'fsdp' axis has size 1, but the specs are what 8 devices would get (only sizes change).
    return make_setup(get_config(), total_steps=10, devices=jax.devices()[:1], steps_per_epoch=10)


def test_large_config_fsdp_rules_give_expected_specs():
    setup = _large_setup()
    params, frozen = setup.param_shardings, setup.frozen_shardings
    expected = {
        ("B", "layers", "fc1", "kernel"): P(None, None, "fsdp"),  # [layers, embed, mlp]: 'mlp' ranks first
        ("B", "layers", "fc2", "kernel"): P(None, "fsdp", None),  # [layers, mlp, embed]
        ("B", "layers", "q_proj", "kernel"): P(None, "fsdp", None),  # [layers, embed, heads]
        ("B", "layers", "q_proj", "bias"): P(None, None),  # [layers, heads]
        ("B", "layers", "ffn_layernorm", "scale"): P(None, "fsdp"),  # [layers, mlp]
        ("B", "layers", "out_proj", "kernel"): P(None, None, "fsdp"),  # [layers, heads, embed]
        ("B", "embed_positions"): P(None, "fsdp"),  # [positions, embed]
        ("language_head", "kernel"): P("fsdp", None),  # [embed, joint]
        ("logit_scale",): P(),
    }
    for path, spec in expected.items():
        node = params
        for key in path:
            node = node[key]
        assert node.spec == spec, path
    assert frozen["text_embed"]["embedding"].spec == P(None, "fsdp")  # [vocab 64010, embed]: vocab not divisible


def test_adam_moments_take_the_parameter_shardings():
    """optax.tree_map_params: mu and nu mirror the parameter shardings; the step counts are replicated."""
    setup = _large_setup()
    opt = setup.state_shardings["opt_state"]
    moments = [s for s in jax.tree.leaves(opt, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")]
    assert len(moments) == 1
    for tree in (moments[0].mu, moments[0].nu):
        assert jax.tree.map(lambda s: s.spec, tree) == jax.tree.map(lambda s: s.spec, setup.param_shardings)
    assert moments[0].count.spec == P()


def test_logical_spec_uses_a_mesh_axis_once_and_checks_divisibility():
    mesh = AbstractMesh((2, 4), ("data", "fsdp"))
    rules = [("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "data"), ("layers", None)]
    # 'mlp' falls back to its second rule because 'fsdp' already shards 'embed' in this spec.
    assert partition.logical_spec(("layers", "embed", "mlp"), (3, 8, 6), rules, mesh) == P(None, "fsdp", "data")
    # Rules are priorities, not the array's axis order: the earlier rule takes 'fsdp' wherever its axis is.
    priority = [("mlp", "fsdp"), ("embed", "fsdp")]
    assert partition.logical_spec(("embed", "mlp"), (8, 8), priority, mesh) == P(None, "fsdp")
    with pytest.raises(CfirError, match="'embed' of size 6 is not divisible by mesh axis 'fsdp' of size 4"):
        partition.logical_spec(("embed",), (6,), rules, mesh, "x/kernel")
    with pytest.raises(CfirError, match="no logical_axis_rules entry for axis 'vocab'"):
        partition.logical_spec(("vocab", "embed"), (8, 8), rules, mesh, "text_embed/embedding")
    with pytest.raises(CfirError, match="names no axis of the mesh"):
        partition.logical_spec(("embed",), (8,), [("embed", "model")], mesh)
