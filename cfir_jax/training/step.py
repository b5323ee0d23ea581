"""The jitted train step (symmetric contrastive loss over the global batch) and the eval encoder.

With `grad_accum_steps > 1` the gradient is the exact full-batch contrastive gradient (gradient caching): all
micro-batches are first encoded without gradients, the loss gradient w.r.t. the embeddings is taken over the
whole batch, then each micro-batch is re-encoded and back-propagated with its slice of that gradient. Memory is one
micro-batch of activations, the result equals one big batch; the price is one extra forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.experimental.multihost_utils
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cfir_jax.core.errors import CfirError
from cfir_jax.training import batch as batch_lib
from cfir_jax.training import partition
from cfir_jax.training.data import TrainData
from cfir_jax.training.loss import contrastive_loss
from cfir_jax.training.state import Setup

# The text task's batch: the texts' tokens and their images' cached embeddings, split over the batch axes; the extra
# negative images (train.extra_negatives > 0) are one set for the whole batch, on every device.
TEXT_BATCH: batch_lib.Schema = {
    "ids": batch_lib.Field("int32", ("batch", "tokens")),
    "mask": batch_lib.Field("bool", ("batch", "tokens")),
    "image": batch_lib.Field("float32", ("batch", "embed")),
    "negatives": batch_lib.Field("float32", ("negatives", "embed"), split=False),
}


def batch_schema(config) -> batch_lib.Schema:
    """The text step's batch for `config`: TEXT_BATCH, without "negatives" when train.extra_negatives is 0."""
    if config.train.extra_negatives > 0:
        return dict(TEXT_BATCH)
    return {k: v for k, v in TEXT_BATCH.items() if k != "negatives"}


def make_train_step(config, setup: Setup) -> Callable:
    """The jitted step `(state, frozen, batch) -> (state, metrics)`; state is donated."""
    if setup.tower != "text":
        raise CfirError("train.images='pixels' trains both towers: use cfir_jax.training.full_step.make_full_step")
    grads_fn = _make_grads(setup, int(config.train.grad_accum_steps))

    def step(state, frozen, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        (loss, aux), grads = grads_fn(state["params"], frozen, batch, rng)
        return apply_update(setup, state, frozen, loss, aux, grads)

    return jax.jit(
        step,
        in_shardings=(setup.state_shardings, setup.frozen_shardings,
                      batch_lib.shardings(batch_schema(config), setup.mesh)),
        out_shardings=(setup.state_shardings, partition.replicated(setup.mesh)),
        donate_argnums=(0,),
    )


def _make_grads(setup: Setup, accum: int) -> Callable:
    """`(params, frozen, batch, rng) -> ((loss, aux), grads)`: the exact full-batch gradient of the contrastive loss,
    in one pass or, for `accum` > 1, in micro-batches (gradient caching)."""
    graphdef = setup.graphdef
    activations = partition.activation_sharding(setup.mesh)

    def encode(params, frozen, ids, mask, rng):
        tower = nnx.merge(graphdef, params, frozen)
        tower.B.activation_sharding = activations
        return tower.encode_text(ids, mask, rng)

    def loss_of_embeddings(text_emb, logit_scale, batch):
        return contrastive_loss(text_emb, batch["image"], logit_scale, batch.get("negatives"), batch.get("valid"))

    def full_batch_grads(params, frozen, batch, rng):
        def loss_fn(params):
            emb = encode(params, frozen, batch["ids"], batch["mask"], rng)
            return loss_of_embeddings(emb, params["logit_scale"], batch)

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    def cached_grads(params, frozen, batch, rng):
        """Exact full-batch gradient in `accum` micro-batches (gradient caching)."""
        b = batch["ids"].shape[0]
        mb = b // accum
        split = lambda x: x.reshape((accum, mb) + x.shape[1:])  # noqa: E731
        ids, mask = split(batch["ids"]), split(batch["mask"])
        keys = jax.random.split(rng, accum)

        def embed(_, xs):
            i, m, k = xs
            return None, encode(params, frozen, i, m, k)

        _, emb = jax.lax.scan(embed, None, (ids, mask, keys))
        emb = jax.lax.stop_gradient(emb.reshape(b, -1))
        (loss, aux), (g_emb, g_scale) = jax.value_and_grad(loss_of_embeddings, argnums=(0, 1), has_aux=True)(
            emb, params["logit_scale"], batch)
        g_emb = split(g_emb)

        def backprop(grads, xs):
            i, m, k, g = xs
            _, vjp = jax.vjp(lambda p: encode(p, frozen, i, m, k), params)
            (gp,) = vjp(g)
            return jax.tree.map(jnp.add, grads, gp), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, _ = jax.lax.scan(backprop, zeros, (ids, mask, keys, g_emb))
        grads["logit_scale"] = grads["logit_scale"] + g_scale
        return (loss, aux), grads

    return cached_grads if accum > 1 else full_batch_grads


def apply_update(setup: Setup, state: dict, frozen: dict, loss, aux: dict, grads) -> tuple[dict, dict]:
    """One optimiser update of `state` with `grads`; returns (new state, metrics): loss, accuracy, lr, the
    temperature, and the l2 norms of grads, params and updates (the text step's and the Full step's alike)."""
    updates, opt_state = setup.tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    logit_scale = params["logit_scale"] if "logit_scale" in params else frozen["logit_scale"]
    metrics = {
        "loss": loss,
        "accuracy": aux["accuracy"],
        "lr": setup.schedule(state["step"]),
        "temperature": 1.0 / jnp.exp(logit_scale),
        "logit_scale": logit_scale,
        "grad_norm": optax.global_norm(grads),
        "param_norm": optax.global_norm(params),
        "update_norm": optax.global_norm(updates),
    }
    new_state = {"step": state["step"] + 1, "rng": state["rng"], "params": params, "opt_state": opt_state}
    return new_state, metrics


def make_encoder(config, setup: Setup) -> Callable:
    """Jitted deterministic text encoder `(params, frozen, ids, mask) -> [B, D]` (evaluation, export checks)."""
    graphdef = setup.graphdef
    bsh = partition.batch_sharding(setup.mesh)

    activations = partition.activation_sharding(setup.mesh)

    def encode(params, frozen, ids, mask):
        tower = nnx.merge(graphdef, params, frozen)
        tower.B.activation_sharding = activations
        return tower.encode_text(ids, mask)

    return jax.jit(encode, in_shardings=(setup.param_shardings, setup.frozen_shardings, bsh, bsh),
                   out_shardings=partition.replicated(setup.mesh))


def global_batch_arrays(data: TrainData, step: int, config, mesh) -> dict:
    """This process's rows of the global batch at `step`, assembled into global jax.Arrays (`batch_schema`)."""
    tcfg = config.train
    rows = data.batch_rows(step, tcfg.global_batch, tcfg.seed)
    n_proc, pid = jax.process_count(), jax.process_index()
    per = tcfg.global_batch // n_proc
    local = rows[pid * per : (pid + 1) * per]
    texts = data.pair_text[local]
    order = np.argsort(data.pair_image[local], kind="stable")  # sorted reads from the memory map
    images = np.empty((len(local), data.image_embeddings.shape[1]), np.float32)
    images[order] = data.image_embeddings[data.pair_image[local][order]]
    host = {"ids": data.ids[texts], "mask": data.padding_mask[texts], "image": images}
    if tcfg.extra_negatives > 0:
        host["negatives"] = data.negatives(step, rows, tcfg.extra_negatives, tcfg.negatives, tcfg.seed)
    return batch_lib.assemble(batch_schema(config), host, mesh)
