"""Training the language expert: sharded symmetric contrastive training with orbax checkpoints.

Only the text tower (`model.TextTower`) goes on the accelerators; the frozen vision tower stays on the host since
its image embeddings come from the cache. Parameters are split by the config's rules into `params` (trained,
optimised, checkpointed) and `frozen` (the token embedding table; restored from the init model each run).

The step is a pure function `(state, batch) -> (state, metrics)` jitted once with donated state and explicit
shardings over a ('data', 'fsdp') mesh. Per-step randomness is `fold_in(rng, step)`. The data order is a function
of (seed, step) alone, so the data iterator position that a checkpoint stores is just the step: a run killed at any
point and resumed from its last checkpoint replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.experimental.multihost_utils
import ml_collections

from cfir_jax.core.errors import CfirError
from cfir_jax.eval import train_time
from cfir_jax.stores.atomic_write import write_json_atomic
from cfir_jax.train.data import TrainData
from cfir_jax.train.monitor import MetricsLog, _Preemption
from cfir_jax.train.state import export_model, init_state, make_setup, restore_tower
from cfir_jax.train.step import global_batch_arrays, make_encoder, make_train_step
from cfir_jax.train.validate import evaluate

# ---------------------------------------------------------------------------------------------------------- loop


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
        write_json_atomic(workdir / "config.json", _portable_config(config, workdir.parent))

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
    from cfir_jax.core.progress import shown

    show = (progress if progress is not None else shown()) and jax.process_index() == 0

    def save(step: int, force: bool = False):
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"step": step, "seed": tcfg.seed}),
            config=ocp.args.JsonSave(config.to_dict())), force=force)

    from cfir_jax.core.progress import bar as progress_bar

    # step n/N, steps/s and ETA from tqdm; the loss in the postfix at every log step.
    bar = progress_bar(total=steps, initial=start, show=show, unit="step", desc=desc)
    last_metrics: dict[str, float] = log.last() if start >= steps else {}
    # Training time per epoch (the paper's T-t): timing.jsonl beside the metrics log, written by process 0.
    timer = train_time.SegmentTimer(workdir, start, train_time.hardware_label(list(setup.mesh.devices.flat)),
                                    data.steps_per_epoch(tcfg.global_batch), jax.process_index() == 0 and start < steps)
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
                timer.log(done)
                last_metrics = values
                rate = seen / max(time.time() - t0, 1e-9)
                bar.set_postfix(loss=f"{values['loss']:.4f}", examples_s=f"{rate:.1f}")
            bar.update(1)
            preempt.checkpoint(done, steps, tcfg.checkpoint_every, save, (manager, log, bar))
    manager.wait_until_finished()
    manager.close()
    bar.close()
    log.close()
    if tcfg.export_model:
        export_model(config, setup, state["params"], frozen, workdir / "model", tcfg.export_model)
    return TrainResult(last_metrics, state["params"], frozen, start, steps)




def _portable_config(config, root: Path) -> dict:
    """The config as recorded in the run directory: model paths inside the workdir `root` relative to it, so a
    moved workdir's record still names its own stores."""
    from cfir_jax.stores.layout import Layout

    record = json.loads(json.dumps(config.to_dict(), default=str))
    for key in ("init_model", "export_model"):
        value = record["train"].get(key)
        if value and value != "scratch":
            record["train"][key] = Layout(root).portable(value)
    return record
