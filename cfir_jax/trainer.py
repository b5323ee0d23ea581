"""Training the language expert: sharded symmetric contrastive training with orbax checkpoints.

Only the text tower (`model.TextTower`) goes on the accelerators; the frozen vision tower stays on the host since
its image embeddings come from the cache. Parameters are split by the config's rules into `params` (trained,
optimised, checkpointed) and `frozen` (the token embedding table; restored from the init model each run).

The step is a pure function `(state, batch) -> (state, metrics)` jitted once with donated state and explicit
shardings over a ('data', 'fsdp') mesh. Per-step randomness is `fold_in(rng, step)`. The data order is a function
of (seed, step) alone, so the data iterator position that a checkpoint stores is just the step: a run killed at any
point and resumed from its last checkpoint replays exactly the batches an uninterrupted run would have seen.

With `grad_accum_steps > 1` the gradient is the exact full-batch contrastive gradient (gradient caching): all
micro-batches are first encoded without gradients, the loss gradient w.r.t. the embeddings is taken over the
whole batch, then each micro-batch is re-encoded and back-propagated with its slice of that gradient. Memory is one
micro-batch of activations, the result equals one big batch; the price is one extra forward pass.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.experimental.multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from cfir_jax import model as model_lib
from cfir_jax import partition
from cfir_jax.errors import CfirError
from cfir_jax.loss import contrastive_loss


# ----------------------------------------------------------------------------------------------------------- data


@dataclasses.dataclass
class EvalData:
    """Validation queries against the validation images, scored by exact search."""

    ids: np.ndarray  # [Q, L] int32 tokens of the query texts
    padding_mask: np.ndarray  # [Q, L] bool
    query_ids: list[str]  # doc id of each query
    image_embeddings: np.ndarray  # [M, D] the candidate images
    image_ids: list[str]
    qrels: dict[str, dict[str, int]]


@dataclasses.dataclass
class TrainData:
    """Host-side training pairs: text `pair_text[i]` goes with cache row `pair_image[i]`.

    `ids`/`padding_mask` [T, L] are the tokenised texts (summaries, documents or captions); `image_embeddings`
    [N, D] is the image cache (memory-mapped). `hard_offsets`/`hard_rows` (CSR over texts) list hard negative
    image rows per text, e.g. the entity candidates of its document.
    """

    ids: np.ndarray
    padding_mask: np.ndarray
    pair_text: np.ndarray
    pair_image: np.ndarray
    image_embeddings: np.ndarray
    eval: EvalData | None = None
    hard_offsets: np.ndarray | None = None
    hard_rows: np.ndarray | None = None

    def __post_init__(self):
        if len(self.pair_text) != len(self.pair_image):
            raise CfirError("training pairs: texts and images differ in count")
        if len(self.pair_text) == 0:
            raise CfirError("no training pairs: the train qrels share no (text, cached image) pair")

    @property
    def num_pairs(self) -> int:
        return len(self.pair_text)

    def steps_per_epoch(self, global_batch: int) -> int:
        return max(self.num_pairs // global_batch, 1)

    def batch_rows(self, step: int, global_batch: int, seed: int) -> np.ndarray:
        """Pair indices of the global batch at `step`: epoch e is a seeded permutation, batches drop the tail."""
        per_epoch = self.steps_per_epoch(global_batch)
        epoch, offset = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(self.num_pairs)
        if self.num_pairs < global_batch:  # tiny corpora: sample with wrap-around
            order = np.resize(order, global_batch)
        return order[offset * global_batch : (offset + 1) * global_batch]

    def negatives(self, step: int, rows: np.ndarray, count: int, kind: str, seed: int) -> np.ndarray:
        """[count, D] extra negative image embeddings for the batch at `step` (same on every process)."""
        rng = np.random.default_rng([seed, step, 7])
        n = len(self.image_embeddings)
        if kind == "hard" and self.hard_offsets is not None:
            pool = np.concatenate([self.hard_rows[self.hard_offsets[t] : self.hard_offsets[t + 1]]
                                   for t in self.pair_text[rows]] + [np.zeros(0, np.int64)])
            pool = np.setdiff1d(pool, self.pair_image[rows])
            picked = rng.choice(pool, min(count, len(pool)), replace=False) if len(pool) else np.zeros(0, np.int64)
            picked = np.concatenate([picked, rng.integers(0, n, count - len(picked))])
        elif kind in ("random", "hard"):
            picked = rng.integers(0, n, count)
        else:
            raise CfirError(f"unknown negatives kind {kind!r}: use 'random' or 'hard'")
        return np.asarray(self.image_embeddings[np.sort(picked)], np.float32)


# ------------------------------------------------------------------------------------------------ optimiser/state


def warmup_steps(cfg: ml_collections.ConfigDict, steps_per_epoch: int | None) -> int:
    """The warmup length in steps: `warmup_steps` when > 0, else `warmup_epochs` epochs of `steps_per_epoch`."""
    if cfg.warmup_steps > 0:
        return int(cfg.warmup_steps)
    if not cfg.warmup_epochs:
        return 0
    if steps_per_epoch is None:
        raise ValueError("train.warmup_epochs needs the number of steps per epoch (pass steps_per_epoch)")
    return int(round(cfg.warmup_epochs * steps_per_epoch))


def make_schedule(cfg: ml_collections.ConfigDict, total_steps: int, steps_per_epoch: int | None = None
                  ) -> optax.Schedule:
    """Linear warmup from 0 to lr, then cosine to min_lr (the reference's schedule)."""
    warmup = min(warmup_steps(cfg, steps_per_epoch), max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(total_steps, warmup + 1), cfg.min_lr)


def make_optimizer(cfg: ml_collections.ConfigDict, params: Any, num_layers: int, total_steps: int,
                   steps_per_epoch: int | None = None):
    """AdamW with the weight-decay mask and layer-wise lr decay of the config; returns (optimizer, schedule)."""
    schedule = make_schedule(cfg, total_steps, steps_per_epoch)
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    decay_mask = jax.tree.map(lambda no_decay: not no_decay, partition.tree_mask(params, cfg.no_weight_decay))
    parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
    if cfg.layer_decay != 1.0:
        scales = partition.layer_lr_scales(params, num_layers, cfg.layer_decay)
        parts.append(optax.stateless(lambda updates, _: jax.tree.map(lambda u, s: u * s, updates, scales)))
    parts.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*parts), schedule


def trainable_filter(rules) -> Callable:
    """An nnx filter: True for parameters whose first matching rule is 'train'."""

    def pred(path, _value) -> bool:
        rule = partition.first_match("/".join(str(p) for p in path), rules, "trainable")
        if rule not in ("train", "frozen"):
            raise CfirError(f"trainable rule must be 'train' or 'frozen', got {rule!r}")
        return rule == "train"

    return pred


@dataclasses.dataclass
class Setup:
    """Everything derived once from the config: the mesh, the tower's graph, shardings, optimizer, schedule."""

    mesh: jax.sharding.Mesh
    graphdef: Any
    abstract_params: Any
    abstract_frozen: Any
    param_shardings: Any
    frozen_shardings: Any
    state_shardings: Any
    abstract_state: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule


def _tower(model_cfg, seed: int = 0) -> model_lib.TextTower:
    return model_lib.create_model(model_cfg, seed).text_tower()


def make_setup(config: ml_collections.ConfigDict, total_steps: int, devices=None,
               steps_per_epoch: int | None = None) -> Setup:
    """`steps_per_epoch` turns `train.warmup_epochs` into steps (needed unless `train.warmup_steps` > 0)."""
    mesh = partition.make_mesh(config.mesh.data, config.mesh.fsdp, devices)
    pred = trainable_filter(config.train.trainable)
    abstract_tower = nnx.eval_shape(lambda: _tower(config.model))
    graphdef, abs_params, abs_frozen = nnx.split(abstract_tower, pred, ...)
    # The logical axis names the model declares on each Variable, as PartitionSpecs of names.
    names_params, names_frozen = (nnx.to_pure_dict(nnx.get_partition_spec(s)) for s in (abs_params, abs_frozen))
    abs_params, abs_frozen = nnx.to_pure_dict(abs_params), nnx.to_pure_dict(abs_frozen)
    rules = config.mesh.logical_axis_rules
    param_sh = partition.tree_shardings(abs_params, names_params, mesh, rules)
    frozen_sh = partition.tree_shardings(abs_frozen, names_frozen, mesh, rules)
    tx, schedule = make_optimizer(config.train, abs_params, config.model.num_layers, total_steps, steps_per_epoch)
    abs_opt = jax.eval_shape(tx.init, abs_params)
    # Every parameter-shaped tree in the optimizer state (Adam's moments) takes the parameters' shardings; the
    # rest (step counts) is replicated.
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, abs_opt, param_sh,
                                   transform_non_params=lambda _: partition.replicated(mesh))
    rep = partition.replicated(mesh)
    state_sh = {"step": rep, "rng": rep, "params": param_sh, "opt_state": opt_sh}
    abstract_state = {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
        "params": abs_params,
        "opt_state": abs_opt,
    }
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abstract_state, state_sh)
    return Setup(mesh, graphdef, abs_params, abs_frozen, param_sh, frozen_sh, state_sh, abstract_state, tx, schedule)


def init_state(config, setup: Setup, init_model: str | None) -> tuple[dict, dict]:
    """(state, frozen) created directly with their shardings: from the init model directory when given (partial
    orbax restore of the text tower only), else from the seed."""
    pred = trainable_filter(config.train.trainable)
    rep = partition.replicated(setup.mesh)
    if init_model:
        params, frozen = restore_tower(init_model, setup, config.model)
    else:

        def make():
            tower = _tower(config.model, config.train.seed)
            _, p, f = nnx.split(tower, pred, ...)
            return nnx.to_pure_dict(p), nnx.to_pure_dict(f)

        params, frozen = jax.jit(make, out_shardings=(setup.param_shardings, setup.frozen_shardings))()
    opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings["opt_state"])(params)
    rng = jax.device_put(np.asarray(jax.random.key_data(jax.random.key(config.train.seed)), np.uint32), rep)
    state = {"step": jax.device_put(np.int32(0), rep), "rng": rng, "params": params, "opt_state": opt_state}
    return state, frozen


def restore_tower(model_dir: str, setup: Setup, model_config) -> tuple[dict, dict]:
    """Restores only the text tower's parameters from a model directory, straight into their shardings."""
    import orbax.checkpoint as ocp

    from cfir_jax import checkpoint

    stored = checkpoint.read_model_manifest(model_dir)["model_config"]  # one-line error if missing/incomplete
    for key in ("embed_dim", "num_layers", "num_heads", "ffn_dim", "vocab_size", "max_text_positions"):
        if stored.get(key) != model_config[key]:
            raise CfirError(f"{model_dir}: init model has {key}={stored.get(key)} but the config has "
                            f"{model_config[key]}: it is a model of another size")
    target = _nest(_flat(setup.abstract_params) | _flat(setup.abstract_frozen))
    shardings = _nest(_flat(setup.param_shardings) | _flat(setup.frozen_shardings))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
    with ocp.PyTreeCheckpointer() as ckptr:
        restored = ckptr.restore(Path(model_dir).absolute() / "params", args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    flat = _flat(restored)
    params = _nest({k: flat[k] for k in _flat(setup.abstract_params)})
    frozen = _nest({k: flat[k] for k in _flat(setup.abstract_frozen)})
    return params, frozen


def _flat(tree) -> dict[str, Any]:
    return {model_lib.param_path(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _nest(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


# ---------------------------------------------------------------------------------------------------------- step


def make_train_step(config, setup: Setup) -> Callable:
    """The jitted step `(state, frozen, batch) -> (state, metrics)`; state is donated."""
    tcfg = config.train
    graphdef = setup.graphdef
    accum = int(tcfg.grad_accum_steps)

    def encode(params, frozen, ids, mask, rng):
        return nnx.merge(graphdef, params, frozen).encode_text(ids, mask, rng)

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

    grads_fn = cached_grads if accum > 1 else full_batch_grads

    def step(state, frozen, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        (loss, aux), grads = grads_fn(state["params"], frozen, batch, rng)
        updates, opt_state = setup.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {
            "loss": loss,
            "accuracy": aux["accuracy"],
            "lr": setup.schedule(state["step"]),
            "temperature": 1.0 / jnp.exp(params["logit_scale"]),
            "logit_scale": params["logit_scale"],
            "grad_norm": optax.global_norm(grads),
            "param_norm": optax.global_norm(params),
            "update_norm": optax.global_norm(updates),
        }
        new_state = {"step": state["step"] + 1, "rng": state["rng"], "params": params, "opt_state": opt_state}
        return new_state, metrics

    bsh = partition.batch_sharding(setup.mesh)
    rep = partition.replicated(setup.mesh)
    batch_sh = {"ids": bsh, "mask": bsh, "image": bsh}
    if tcfg.extra_negatives > 0:
        batch_sh["negatives"] = rep
    return jax.jit(
        step,
        in_shardings=(setup.state_shardings, setup.frozen_shardings, batch_sh),
        out_shardings=(setup.state_shardings, rep),
        donate_argnums=(0,),
    )


def make_encoder(config, setup: Setup) -> Callable:
    """Jitted deterministic text encoder `(params, frozen, ids, mask) -> [B, D]` (evaluation, export checks)."""
    graphdef = setup.graphdef
    bsh = partition.batch_sharding(setup.mesh)

    def encode(params, frozen, ids, mask):
        return nnx.merge(graphdef, params, frozen).encode_text(ids, mask)

    return jax.jit(encode, in_shardings=(setup.param_shardings, setup.frozen_shardings, bsh, bsh),
                   out_shardings=partition.replicated(setup.mesh))


# ------------------------------------------------------------------------------------------------------ batches


def global_batch_arrays(data: TrainData, step: int, config, mesh) -> dict:
    """This process's rows of the global batch at `step`, assembled into global jax.Arrays."""
    tcfg = config.train
    rows = data.batch_rows(step, tcfg.global_batch, tcfg.seed)
    n_proc, pid = jax.process_count(), jax.process_index()
    per = tcfg.global_batch // n_proc
    local = rows[pid * per : (pid + 1) * per]
    texts = data.pair_text[local]
    order = np.argsort(data.pair_image[local], kind="stable")  # sorted reads from the memory map
    images = np.empty((len(local), data.image_embeddings.shape[1]), np.float32)
    images[order] = data.image_embeddings[data.pair_image[local][order]]
    bsh = partition.batch_sharding(mesh)
    batch = {
        "ids": jax.make_array_from_process_local_data(bsh, data.ids[texts]),
        "mask": jax.make_array_from_process_local_data(bsh, data.padding_mask[texts]),
        "image": jax.make_array_from_process_local_data(bsh, images),
    }
    if tcfg.extra_negatives > 0:
        neg = data.negatives(step, rows, tcfg.extra_negatives, tcfg.negatives, tcfg.seed)
        batch["negatives"] = jax.device_put(neg, partition.replicated(mesh))
    return batch


# ---------------------------------------------------------------------------------------------------- evaluation


def evaluate(encoder, params, frozen, eval_data: EvalData, batch_size: int, mesh) -> dict[str, float]:
    """R@1/5/10 and MRR@10 of the validation queries by exact search over the validation images."""
    from cfir_jax.metrics import evaluate as trec_evaluate

    q = len(eval_data.query_ids)
    n_dev = mesh.size
    batch_size = max(n_dev, (batch_size // n_dev) * n_dev)
    embs = []
    for start in range(0, q, batch_size):
        ids = eval_data.ids[start : start + batch_size]
        mask = eval_data.padding_mask[start : start + batch_size]
        pad = batch_size - len(ids)
        if pad:
            ids = np.concatenate([ids, np.repeat(ids[-1:], pad, 0)])
            mask = np.concatenate([mask, np.repeat(mask[-1:], pad, 0)])
        out = encoder(params, frozen, ids, mask)
        embs.append(np.asarray(jax.device_get(out))[: batch_size - pad])
    text = np.concatenate(embs)
    scores = text @ np.asarray(eval_data.image_embeddings, np.float32).T
    k = min(10, scores.shape[1])
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    run = {}
    for qi, qid in enumerate(eval_data.query_ids):
        run[qid] = {eval_data.image_ids[j]: float(scores[qi, j]) for j in top[qi]}
    result = trec_evaluate(run, eval_data.qrels, measures=("recall@1", "recall@5", "recall@10", "mrr@10"))
    return {f"val/{k.replace('@', '_at_')}": v for k, v in result.aggregate.items()}


# ---------------------------------------------------------------------------------------------------------- loop


class MetricsLog:
    """metrics.jsonl (process 0) and TensorBoard; on resume, entries after the restored step are dropped.

    Not clu.metric_writers: importing it imports TensorFlow (its TensorBoard writer is tf.summary), which the
    project does not install."""

    def __init__(self, workdir: Path, resume_step: int, tensorboard: bool):
        self.path = workdir / "metrics.jsonl"
        self.enabled = jax.process_index() == 0
        self.writer = None
        if not self.enabled:
            return
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self.writer = SummaryWriter(str(workdir / "tensorboard"))
            except ImportError:
                self.writer = None

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **{k: float(v) for k, v in values.items()}}, sort_keys=True) + "\n")
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, float(v), step)

    def last(self) -> dict[str, float]:
        """The last entry of metrics.jsonl (what a finished run logged), without its step; {} when none."""
        if not self.enabled or not self.path.exists():
            return {}
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        return {k: v for k, v in json.loads(lines[-1]).items() if k != "step"} if lines else {}

    def close(self):
        if self.writer is not None:
            self.writer.close()


class _Preemption:
    """Where to save and stop after a preemption notice (SIGTERM), the same step on every process.

    Under jax.distributed, JAX's preemption sync manager catches SIGTERM on whichever host gets it and tells the
    others through the coordination service; the hosts then agree on a step (the largest step any of them has
    reached, plus one) and orbax's `CheckpointManager.reached_preemption(step)`, asked at every step, is True at that
    step on all of them, so all save the same step. A per-process flag would let the signalled host save and leave
    while the others block in the next step's collectives. In a single process, a SIGTERM handler sets the flag.
    """

    def __init__(self, manager):
        self.manager = manager
        self.distributed = jax.distributed.is_initialized()
        self.requested = False
        self._old = None

    def __enter__(self):
        # Under jax.distributed the sync manager's own SIGTERM handler must stay the one installed.
        if not self.distributed and hasattr(signal, "SIGTERM") and _is_main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, *_):
        self.requested = True

    def reached(self, step: int) -> bool:
        """True at the step to save and stop at; every process must ask at every step."""
        if self.distributed:
            return self.manager.reached_preemption(step)
        return self.requested

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def total_steps(config, data: TrainData) -> int:
    if config.train.num_steps > 0:
        return int(config.train.num_steps)
    return int(math.ceil(config.train.num_epochs * data.steps_per_epoch(config.train.global_batch)))


@dataclasses.dataclass
class TrainResult:
    metrics: dict[str, float]  # the last logged metrics
    params: Any  # trained parameters (sharded jax.Arrays)
    frozen: Any  # frozen text-tower parameters
    start_step: int = 0  # the step this run resumed from (0: from scratch)
    num_steps: int = 0  # the run's total steps; start_step == num_steps: it was already trained

    @property
    def already_trained(self) -> bool:
        return self.start_step >= self.num_steps


def train(config: ml_collections.ConfigDict, workdir: str | os.PathLike, data: TrainData,
          devices=None, progress: bool | None = None, desc: str = "train") -> TrainResult:
    """Runs (or resumes) training in `workdir`. Exports the trained model to `workdir/model` when
    `config.train.export_model` says where its vision tower comes from (a model directory, or 'scratch')."""
    import orbax.checkpoint as ocp

    tcfg = config.train
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    if tcfg.global_batch % tcfg.grad_accum_steps:
        raise CfirError(f"global_batch {tcfg.global_batch} is not divisible by grad_accum_steps "
                        f"{tcfg.grad_accum_steps}")
    steps = total_steps(config, data)
    setup = make_setup(config, steps, devices, data.steps_per_epoch(tcfg.global_batch))
    # The batch (and each gradient-caching micro-batch) is split evenly over every device of the mesh.
    per_step = tcfg.global_batch // tcfg.grad_accum_steps
    if per_step % setup.mesh.size:
        raise CfirError(f"global_batch / grad_accum_steps = {per_step} is not divisible by the {setup.mesh.size} "
                        "devices of the mesh; choose a multiple")
    if jax.process_index() == 0:
        (workdir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True, default=str))

    options = ocp.CheckpointManagerOptions(max_to_keep=tcfg.keep_checkpoints, create=True,
                                           enable_async_checkpointing=tcfg.async_checkpoints)
    manager = ocp.CheckpointManager(workdir / "checkpoints", options=options,
                                    item_names=("state", "data", "config"))
    latest = manager.latest_step()
    state, frozen = init_state(config, setup, None if latest is not None else (tcfg.init_model or None))
    if latest is not None:
        if tcfg.init_model:
            # The frozen table comes from the init model on every (re)start; trained params from the checkpoint.
            _, frozen = restore_tower(tcfg.init_model, setup, config.model)
        restored = manager.restore(latest, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(setup.abstract_state), data=ocp.args.JsonRestore()))
        state = restored["state"]
        if restored["data"]["step"] != int(jax.device_get(state["step"])):
            raise CfirError(f"{workdir}: checkpoint {latest} is inconsistent (data step != state step)")
    start = int(jax.device_get(state["step"]))
    log = MetricsLog(workdir, start, tcfg.tensorboard)
    step_fn = make_train_step(config, setup)
    encoder = make_encoder(config, setup) if data.eval is not None else None
    from cfir_jax.progress import shown

    show = (progress if progress is not None else shown()) and jax.process_index() == 0

    def save(step: int, force: bool = False):
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"step": step, "seed": tcfg.seed}),
            config=ocp.args.JsonSave(config.to_dict())), force=force)

    from cfir_jax.progress import bar as progress_bar

    # step n/N, steps/s and ETA from tqdm; the loss in the postfix at every log step.
    bar = progress_bar(total=steps, initial=start, show=show, unit="step", desc=desc)
    last_metrics: dict[str, float] = log.last() if start >= steps else {}
    t0, seen = time.time(), 0
    with _Preemption(manager) as preempt:
        for step in range(start, steps):
            batch = global_batch_arrays(data, step, config, setup.mesh)
            state, metrics = step_fn(state, frozen, batch)
            seen += tcfg.global_batch
            done = step + 1
            if done % tcfg.log_every == 0 or done == steps:
                values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                if not math.isfinite(values["loss"]):
                    raise FloatingPointError(f"non-finite loss {values['loss']} at step {done}")
                if encoder is not None and (done % tcfg.eval_every == 0 or done == steps):
                    values |= evaluate(encoder, state["params"], frozen, data.eval, tcfg.eval_batch, setup.mesh)
                log.write(done, values)
                last_metrics = values
                rate = seen / max(time.time() - t0, 1e-9)
                bar.set_postfix(loss=f"{values['loss']:.4f}", examples_s=f"{rate:.1f}")
            bar.update(1)
            preempted = preempt.reached(done)
            if preempted or done % tcfg.checkpoint_every == 0 or done == steps:
                save(done, force=preempted)
            if preempted:
                manager.close()  # waits for the (async) save on every process
                log.close()
                bar.close()
                print(f"preemption (SIGTERM): saved checkpoint at step {done}, exiting", file=sys.stderr)
                sys.exit(0)
    manager.wait_until_finished()
    manager.close()
    bar.close()
    log.close()
    if tcfg.export_model:
        export_model(config, setup, state["params"], frozen, workdir / "model", tcfg.export_model)
    return TrainResult(last_metrics, state["params"], frozen, start, steps)


def export_model(config, setup: Setup, params, frozen, out_dir: Path, vision_from: str) -> None:
    """Writes the full model (vision tower from `vision_from`, trained text tower) as a model directory."""
    from cfir_jax import checkpoint

    gather = (functools.partial(jax.experimental.multihost_utils.process_allgather, tiled=True)
              if jax.process_count() > 1 else jax.device_get)
    text = _flat(gather(params)) | _flat(gather(frozen))
    if vision_from == "scratch":
        model = model_lib.create_model(config.model, config.train.seed)
    else:
        model = checkpoint.load_model(vision_from)
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    flat = _flat(pure)
    for name, value in text.items():
        flat[name] = np.asarray(value)
    nnx.replace_by_pure_dict(state, _nest(flat))
    nnx.update(model, state)
    if jax.process_index() == 0:
        checkpoint.save_model(model, out_dir, trained_from=str(vision_from), train_text=config.train.text,
                              train_max_text_len=config.train.max_text_len)

