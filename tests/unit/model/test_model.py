"""Numeric parity of the Flax DBeit3 with torchscale's BEiT3 + retrieval heads (random weights)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch_reference import random_reference, state_dict_numpy

from cfir_jax.core.config import model_config
from cfir_jax.model import beit3 as model_lib
from cfir_jax.model.convert import load_torch_checkpoint
from cfir_jax.training.state import make_setup

SHAPES = [
    # embed_dim, heads, layers, ffn, image size, patch
    dict(embed_dim=64, num_heads=4, num_layers=2, ffn_dim=256, image_size=32, patch_size=16),
    dict(embed_dim=96, num_heads=3, num_layers=3, ffn_dim=128, image_size=48, patch_size=8),
    dict(embed_dim=128, num_heads=2, num_layers=1, ffn_dim=512, image_size=64, patch_size=16),
]


def _config(shape, **kw):
    return model_config("tiny", **{**shape, "vocab_size": 500, "max_text_positions": 64, **kw})


def _text_batch(rng, batch=3, length=12):
    ids = rng.integers(3, 500, size=(batch, length)).astype(np.int32)
    ids[:, 0] = 0
    lengths = [length, length // 2, 3][:batch]
    mask = np.zeros((batch, length), bool)
    for i, n in enumerate(lengths):
        ids[i, n - 1] = 2
        ids[i, n:] = 1
        mask[i, n:] = True
    return ids, mask


def _pair(shape, seed=0, **kw):
    cfg = _config(shape, **kw)
    ref = random_reference(cfg, seed)
    return cfg, ref, load_torch_checkpoint(state_dict_numpy(ref), cfg)


@pytest.mark.parametrize("shape", SHAPES)
def test_text_embeddings_match_torchscale(shape):
    cfg, ref, ours = _pair(shape)
    ids, mask = _text_batch(np.random.default_rng(1))
    with torch.no_grad():
        want, _ = ref.encode_text(torch.from_numpy(ids).long(), torch.from_numpy(mask))
    got = ours.encode_text(jnp.asarray(ids), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_image_embeddings_match_torchscale(shape):
    cfg, ref, ours = _pair(shape)
    pixels = np.random.default_rng(2).uniform(-1, 1, (2, cfg.image_size, cfg.image_size, 3)).astype(np.float32)
    with torch.no_grad():
        want, _ = ref.encode_image(torch.from_numpy(pixels).permute(0, 3, 1, 2))
    got = ours.encode_image(jnp.asarray(pixels))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5, rtol=0)


def test_hidden_states_match_torchscale():
    shape = SHAPES[1]
    cfg, ref, ours = _pair(shape)
    ids, mask = _text_batch(np.random.default_rng(3))
    with torch.no_grad():
        want = ref.hidden_states(ids=torch.from_numpy(ids).long(), padding_mask=torch.from_numpy(mask))
    _, got = ours.text_features(jnp.asarray(ids), jnp.asarray(mask), return_hidden=True)
    assert len(got) == len(want) == cfg.num_layers + 1
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), atol=1e-4, rtol=0)
    pixels = np.random.default_rng(4).uniform(-1, 1, (2, cfg.image_size, cfg.image_size, 3)).astype(np.float32)
    with torch.no_grad():
        want = ref.hidden_states(pixels_nchw=torch.from_numpy(pixels).permute(0, 3, 1, 2))
    _, got = ours.image_features(jnp.asarray(pixels), return_hidden=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), atol=1e-4, rtol=0)


def test_scan_and_unrolled_layers_agree():
    cfg, _, scanned = _pair(SHAPES[1], scan_layers=True)
    _, _, unrolled = _pair(SHAPES[1], scan_layers=False)
    ids, mask = _text_batch(np.random.default_rng(5))
    np.testing.assert_allclose(np.asarray(scanned.encode_text(ids, mask)), np.asarray(unrolled.encode_text(ids, mask)),
                               atol=1e-6)


def test_bf16_compute_close_to_reference():
    """bf16 activations with fp32 params: embeddings within 3e-2 max abs (cosine > 0.999) of the fp32 reference."""
    cfg, ref, ours = _pair(SHAPES[0], dtype="bfloat16")
    ids, mask = _text_batch(np.random.default_rng(6))
    with torch.no_grad():
        want, _ = ref.encode_text(torch.from_numpy(ids).long(), torch.from_numpy(mask))
    got = np.asarray(ours.encode_text(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(got - want.numpy()).max() < 3e-2
    assert (got * want.numpy()).sum(-1).min() > 0.999


def test_text_padding_does_not_change_cls():
    cfg, _, ours = _pair(SHAPES[0])
    ids, mask = _text_batch(np.random.default_rng(7), batch=2, length=10)
    longer_ids = np.concatenate([ids, np.ones((2, 6), np.int32)], axis=1)
    longer_mask = np.concatenate([mask, np.ones((2, 6), bool)], axis=1)
    np.testing.assert_allclose(np.asarray(ours.encode_text(ids, mask)),
                               np.asarray(ours.encode_text(longer_ids, longer_mask)), atol=1e-6)


def test_dropout_only_with_rng():
    cfg, _, ours = _pair(SHAPES[0], dropout=0.3, drop_path_rate=0.5)
    ids, mask = _text_batch(np.random.default_rng(8))
    a = ours.encode_text(ids, mask)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(ours.encode_text(ids, mask)))
    b = ours.encode_text(ids, mask, rng=jax.random.key(0))
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-3


def test_reference_parameter_counts():
    """BEiT3ForRetrieval at 384 px, mask_token included; CFIR's trainable language expert is what
    the config's own trainable rule hands the trainer's optimizer."""
    from configs.base import get_config as base
    from configs.large import get_config as large

    for get, total, trainable in ((base, 222_458_881, 86_524_417), (large, 675_188_737, 304_654_337)):
        config = get("384")
        assert model_lib.count_params(model_lib.abstract_model(config.model)) == total
        setup = make_setup(config, total_steps=1, devices=jax.devices()[:1], steps_per_epoch=1)
        assert sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(setup.abstract_params)) == trainable


def test_authors_trainable_set_is_token_embeddings_and_the_language_ffn():
    """train.trainable=authors (their --tune_text_only): token table, FFN-B with its LayerNorms; 105.9M at base."""
    from cfir_jax.core.cli import apply_overrides
    from configs.base import get_config

    config = apply_overrides(get_config("384"), ["--config.train.trainable=authors"])
    setup = make_setup(config, total_steps=1, devices=jax.devices()[:1], steps_per_epoch=1)
    names = {model_lib.param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(setup.abstract_params)[0]}
    assert {"text_embed/embedding", "B/layers/fc1/kernel", "B/layers/final_layer_norm/scale"} <= names
    assert not any(n.startswith(("A/", "vision", "language_head", "logit_scale", "B/layers/q_proj")) for n in names)
    assert sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(setup.abstract_params)) == 105_921_024
    with pytest.raises(Exception, match="train.trainable='everything'"):
        make_setup(apply_overrides(get_config("384"), ["--config.train.trainable=everything"]), total_steps=1,
                   devices=jax.devices()[:1], steps_per_epoch=1)


@pytest.mark.slow  # out of the quick tier: 20-45 s each on the shared 2-core machine
def test_remat_changes_nothing_but_memory():
    """Activation checkpointing gives the same loss gradients as storing activations: scanned with the default
    policy, and unrolled with the base config's ("projections"); each variant is a compile of its own."""
    from flax import nnx

    ids, mask = _text_batch(np.random.default_rng(9))

    def grads(**kw):
        model = model_lib.create_model(_config(SHAPES[0], **kw), seed=1)

        def loss(m):
            return jnp.sum(m.encode_text(ids, mask) ** 3)

        return nnx.to_pure_dict(nnx.jit(nnx.grad(loss))(model))

    base = grads(remat=False)
    for kw in (dict(remat=True), dict(remat=True, scan_layers=False, remat_policy="projections")):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), base, grads(**kw))
