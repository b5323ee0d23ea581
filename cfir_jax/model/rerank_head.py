"""The re-ranker's head (the third retrieval stage, beyond the paper): a small list-wise MLP over each candidate's
features of SR's top-N, and the list-wise softmax loss it is fitted with (`cfir_jax.rerank.fit`). Retrieval opens a
fitted head from W/reranker (`cfir_jax.retrieve.reranker`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Standardisation(nnx.Variable):
    """Per-feature shift and scale, set from the training lists before fitting and never trained."""


class RerankHead(nnx.Module):
    """features [B, N, F], valid [B, N] -> logits [B, N]: an MLP over each candidate's standardised features, each
    also taken relative to its list's mean and maximum (over the valid candidates), so a score can depend on how the
    candidate compares with the others of its list."""

    def __init__(self, num_features: int, hidden: int, *, rngs: nnx.Rngs):
        self.shift = Standardisation(jnp.zeros(num_features, jnp.float32))
        self.scale = Standardisation(jnp.ones(num_features, jnp.float32))
        self.fc1 = nnx.Linear(3 * num_features, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, features: jax.Array, valid: jax.Array) -> jax.Array:
        z = (features - self.shift.value) * self.scale.value
        v = valid[..., None].astype(z.dtype)
        count = jnp.maximum(v.sum(axis=-2, keepdims=True), 1.0)
        list_mean = (z * v).sum(axis=-2, keepdims=True) / count
        list_max = jnp.where(v > 0, z, -1e9).max(axis=-2, keepdims=True)
        list_max = jnp.where(list_max > -1e8, list_max, 0.0)  # a list with no valid candidate (batch padding)
        h = jnp.concatenate([z, z - list_mean, z - list_max], axis=-1)
        h = jax.nn.gelu(self.fc1(h))
        h = jax.nn.gelu(self.fc2(h))
        return self.out(h)[..., 0]


def listwise_loss(logits: jax.Array, valid: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean over lists of -log(softmax mass on the list's positives), logits/valid/labels [B, N]; lists without a
    positive (batch padding) weigh 0."""
    neg = jnp.float32(-1e9)
    everything = jax.nn.logsumexp(jnp.where(valid, logits, neg), axis=-1)
    positives = jax.nn.logsumexp(jnp.where(valid & labels, logits, neg), axis=-1)
    weight = (valid & labels).any(axis=-1).astype(jnp.float32)
    return ((everything - positives) * weight).sum() / jnp.maximum(weight.sum(), 1.0)
