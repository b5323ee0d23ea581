"""The text encoder's jitted programs are shared by towers of one structure: a model opened again (a reload of the
service, an `Index` reopened after a change) traces nothing, and each encoder still encodes with its own weights; a
tower of another structure gets programs of its own."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cfir_jax.core.config import model_config
from cfir_jax.model.beit3 import DBeit3
from cfir_jax.model.text_encoder import TextEncoder
from cfir_jax.model.tokenizer import Beit3Tokenizer

TEXTS = ["The harbour at dawn.", "A bridge over the river, and the mill beside it.", "Paris."]


def _model(seed: int, layers: int = 2) -> DBeit3:
    cfg = model_config("tiny", embed_dim=64, num_heads=4, num_layers=layers, ffn_dim=128, image_size=32,
                       patch_size=16, vocab_size=1000, max_text_positions=64)
    return DBeit3(cfg, rngs=nnx.Rngs(seed))


def test_towers_of_one_structure_share_the_program_and_keep_their_own_weights(synthetic_spm):
    tokenizer = Beit3Tokenizer(synthetic_spm)
    first, again = _model(0), _model(1)  # the same architecture, other weights (a retrained model)
    a, b = TextEncoder(first, tokenizer, 16, 4), TextEncoder(again, tokenizer, 16, 4)
    got_a = a.encode(TEXTS)
    traced = a._encode.cache_size()
    got_b = b.encode(TEXTS)
    assert b._encode is a._encode and a._encode.cache_size() == traced  # the second tower traced nothing
    ids, mask = tokenizer(TEXTS, 16)
    for model, got in ((first, got_a), (again, got_b)):
        want = model.encode_text(jnp.asarray(ids), jnp.asarray(mask))
        np.testing.assert_allclose(got, np.asarray(want), atol=1e-5, rtol=0)
    assert not np.allclose(got_a, got_b, atol=1e-3)
    other = TextEncoder(_model(0, layers=3), tokenizer, 16, 4)
    assert other._encode is not a._encode and other.encode(TEXTS).shape == got_a.shape
