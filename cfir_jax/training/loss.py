"""The symmetric contrastive (InfoNCE) loss of BEiT-3 retrieval fine-tuning and CFIR.

Written over the global batch: under `jax.jit` with the batch sharded over the mesh, XLA partitions the
[batch, batch] logits and inserts the all-gathers that the reference does by hand (`ClipLoss` with
`gather_with_grad`), with gradients flowing back to every shard's text embeddings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def contrastive_loss(
    text: jax.Array,
    image: jax.Array,
    logit_scale: jax.Array,
    extra_negatives: jax.Array | None = None,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean of the text->image and image->text cross-entropies; pair i of the batch is the positive.

    text [B, D] and image [B, D] are L2-normalised; `logit_scale` is the log temperature (used as exp(), no clamp,
    as the reference). `extra_negatives` [N, D] are additional images (from the cache, no encoding cost) that only
    the text->image direction sees. `valid` [B] bool masks padded pairs out of both directions.
    Returns (loss, metrics) with the in-batch text->image accuracy.
    """
    scale = jnp.exp(logit_scale.astype(jnp.float32))
    text = text.astype(jnp.float32)
    image = image.astype(jnp.float32)
    logits_t2i = scale * text @ image.T  # [B, B]
    logits_i2t = logits_t2i.T
    b = text.shape[0]
    labels = jnp.arange(b)
    if valid is not None:
        # A padded pair is neither a row (no loss) nor a column (no negative).
        col_mask = jnp.where(valid, 0.0, -jnp.inf)[None, :]
        logits_t2i = logits_t2i + col_mask
        logits_i2t = logits_i2t + col_mask
    if extra_negatives is not None:
        logits_t2i = jnp.concatenate([logits_t2i, scale * text @ extra_negatives.astype(jnp.float32).T], axis=1)
    ce_t2i = optax.softmax_cross_entropy_with_integer_labels(logits_t2i, labels)
    ce_i2t = optax.softmax_cross_entropy_with_integer_labels(logits_i2t, labels)
    weights = jnp.ones((b,), jnp.float32) if valid is None else valid.astype(jnp.float32)
    denom = jnp.maximum(weights.sum(), 1.0)
    loss = 0.5 * ((ce_t2i * weights).sum() + (ce_i2t * weights).sum()) / denom
    accuracy = ((jnp.argmax(logits_t2i, axis=1) == labels) * weights).sum() / denom
    return loss, {"accuracy": accuracy}
