"""The D-BEiT-3 Full train step: both towers fine-tuned from pixels and text (the paper's whole-model baseline).

The whole `DBeit3` is on the accelerators, split by `train.trainable` into trained `params` and `frozen` (the
"full" set trains everything retrieval uses). Each batch's images arrive as uint8 pixels, are normalised in the step
as BEiT-3's retrieval fine-tuning does ([0, 1], then mean 0.5, std 0.5: [-1, 1]) and encoded by the vision expert;
the documents by the language expert; the loss is the symmetric contrastive loss over the global batch
(`loss.contrastive_loss`), `valid` masking the pairs whose image could not be read (counted by the input pipeline).

With `train.grad_accum_steps` > 1 the gradient is still the exact full-batch one (gradient caching, for both towers):
every micro-batch is encoded without gradients, the loss gradient w.r.t. all image and text embeddings (and the
temperature) is taken over the whole batch, then each micro-batch is re-encoded and back-propagated through both
towers with its slice of that gradient. A micro-batch takes every `accum`-th row, so each device keeps its own rows
(the batch is split over the devices in contiguous blocks) and no micro-batch moves data between devices.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cfir_jax.core.errors import CfirError
from cfir_jax.training import batch as batch_lib
from cfir_jax.training import partition
from cfir_jax.training.loss import contrastive_loss
from cfir_jax.training.state import Setup
from cfir_jax.training.step import apply_update

# BEiT-3's retrieval preprocessing: pixels in [0, 1] normalised with mean 0.5 and std 0.5 per channel.
IMAGE_MEAN = 0.5
IMAGE_STD = 0.5
# The Full task's batch: uint8 pixels, the documents' tokens (mask True on padding), and `valid` (False where the
# pipeline could not read the image), every field split over the batch axes.
FULL_BATCH: batch_lib.Schema = {
    "pixels": batch_lib.Field("uint8", ("batch", "side", "side", "rgb")),
    "ids": batch_lib.Field("int32", ("batch", "tokens")),
    "mask": batch_lib.Field("bool", ("batch", "tokens")),
    "valid": batch_lib.Field("bool", ("batch",)),
}
BATCH_KEYS = tuple(FULL_BATCH)


def normalize_pixels(pixels: jax.Array) -> jax.Array:
    """uint8 [B, S, S, 3] in [0, 255] -> float32 in [-1, 1]."""
    return (pixels.astype(jnp.float32) / 255.0 - IMAGE_MEAN) / IMAGE_STD


def make_encode(setup: Setup) -> Callable:
    """`(params, frozen, batch, rng) -> (image [B, D], text [B, D])`, both L2-normalised float32; `rng` None is the
    deterministic pass, else it drives drop path and dropout in each tower."""
    if setup.tower != "dual":
        raise CfirError("the Full step needs the whole model: make_setup(..., tower='dual') (train.images='pixels')")
    graphdef = setup.graphdef
    activations = partition.activation_sharding(setup.mesh)

    def encode(params, frozen, batch, rng=None):
        model = nnx.merge(graphdef, params, frozen)
        model.A.activation_sharding = activations
        model.B.activation_sharding = activations
        k_image, k_text = jax.random.split(rng) if rng is not None else (None, None)
        image = model.encode_image(normalize_pixels(batch["pixels"]), k_image)
        text = model.encode_text(batch["ids"], batch["mask"], k_text)
        return image, text

    return encode


def _logit_scale(params: dict, frozen: dict) -> jax.Array:
    return params["logit_scale"] if "logit_scale" in params else frozen["logit_scale"]


def make_grads(config, setup: Setup) -> Callable:
    """`(params, frozen, batch, rng) -> ((loss, aux), grads)`: the exact full-batch gradient of the symmetric
    contrastive loss w.r.t. `params` (in one pass, or in `train.grad_accum_steps` micro-batches)."""
    encode = make_encode(setup)
    accum = int(config.train.grad_accum_steps)

    def loss_of(image, text, logit_scale, valid):
        return contrastive_loss(text, image, logit_scale, None, valid)

    def full_batch(params, frozen, batch, rng):
        def loss_fn(params):
            image, text = encode(params, frozen, batch, rng)
            return loss_of(image, text, _logit_scale(params, frozen), batch["valid"])

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    def cached(params, frozen, batch, rng):
        b = batch["ids"].shape[0]
        if b % accum:
            raise CfirError(f"global batch {b} is not divisible by train.grad_accum_steps {accum}")
        # Micro-batch i is rows i, i + accum, i + 2 accum, ...: [B, ...] -> [accum, B / accum, ...].
        split = lambda x: jnp.swapaxes(x.reshape((b // accum, accum) + x.shape[1:]), 0, 1)  # noqa: E731
        micro = {k: split(batch[k]) for k in ("pixels", "ids", "mask")}
        keys = jax.random.split(rng, accum)

        def embed(_, xs):
            return None, encode(params, frozen, *xs)

        _, (image, text) = jax.lax.scan(embed, None, (micro, keys))
        flat = lambda x: jax.lax.stop_gradient(x.reshape((b,) + x.shape[2:]))  # noqa: E731  (micro-batch order)
        valid = split(batch["valid"]).reshape(b)
        scale = _logit_scale(params, frozen)
        (loss, aux), (g_image, g_text, g_scale) = jax.value_and_grad(loss_of, argnums=(0, 1, 2), has_aux=True)(
            flat(image), flat(text), scale, valid
        )
        unflat = lambda g: g.reshape((accum, b // accum) + g.shape[1:])  # noqa: E731

        def backprop(grads, xs):
            m, k, gi, gt = xs
            _, vjp = jax.vjp(lambda p: encode(p, frozen, m, k), params)
            (gp,) = vjp((gi, gt))
            return jax.tree.map(jnp.add, grads, gp), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, _ = jax.lax.scan(backprop, zeros, (micro, keys, unflat(g_image), unflat(g_text)))
        if "logit_scale" in grads:
            grads["logit_scale"] = grads["logit_scale"] + g_scale
        return (loss, aux), grads

    return cached if accum > 1 else full_batch


def batch_shardings(mesh) -> dict:
    """The Full step's in_shardings for its batch: every field is split over the batch axes of the mesh."""
    return batch_lib.shardings(FULL_BATCH, mesh)


def make_full_step(config, setup: Setup) -> Callable:
    """The jitted step `(state, frozen, batch) -> (state, metrics)`, state donated; batch = {"pixels": uint8
    [B, S, S, 3], "ids": int32 [B, L], "mask": bool [B, L] (True on padding), "valid": bool [B]}."""
    grads_fn = make_grads(config, setup)

    def step(state, frozen, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        (loss, aux), grads = grads_fn(state["params"], frozen, batch, rng)
        state, metrics = apply_update(setup, state, frozen, loss, aux, grads)
        metrics["valid_pairs"] = batch["valid"].sum()
        return state, metrics

    rep = partition.replicated(setup.mesh)
    return jax.jit(
        step,
        in_shardings=(setup.state_shardings, setup.frozen_shardings, batch_shardings(setup.mesh)),
        out_shardings=(setup.state_shardings, rep),
        donate_argnums=(0,),
    )


def global_full_batch(local: dict, ids: np.ndarray, mask: np.ndarray, mesh) -> dict:
    """This process's rows from the image pipeline ({"pixels", "doc_rows", "valid"}) with the documents' tokens
    (`ids`, `mask`: [documents, L], indexed by doc_rows), assembled into the global batch's jax.Arrays."""
    rows = np.asarray(local["doc_rows"])
    host = {"pixels": local["pixels"], "ids": ids[rows], "mask": mask[rows], "valid": local["valid"]}
    return batch_lib.assemble(FULL_BATCH, host, mesh)
