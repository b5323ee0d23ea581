"""The one training loop: every training run (CFIR's text tower, its caption pretraining, D-BEiT-3 Full) is this loop
over a small `Task` that says what differs: the step, the batches, its data state to checkpoint, and its export.

The loop owns what every run shares: the mesh check, the config record (W/RUN/config.json), the orbax checkpoint
manager (items "state", "data", "config"), the resume order (the run's own latest checkpoint, else
`train.init_model`, else the seed), the check that a restored checkpoint is consistent, the metrics log, the progress
bar, the training-time segments (timing.jsonl), preemption (SIGTERM: save and exit 0), and closing in order. A run
killed at any point and resumed from its last checkpoint gives the model an uninterrupted run gives, because the
task's data state (the step for the text task, the image pipeline's position for Full) is saved beside the state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax
import ml_collections
import orbax.checkpoint as ocp

from cfir_jax.core.errors import CfirError
from cfir_jax.core.progress import bar as progress_bar
from cfir_jax.core.progress import shown
from cfir_jax.eval import train_time
from cfir_jax.stores.atomic_write import write_json_atomic
from cfir_jax.stores.layout import Layout
from cfir_jax.training.batch import Schema
from cfir_jax.training.monitor import MetricsLog, _Preemption
from cfir_jax.training.state import Setup, init_state, make_setup, restore_tower, tower_kind


class Task(Protocol):
    """What one kind of training run brings to the loop (`tasks.TextTask`, `tasks.FullTask`)."""

    tower: str  # what goes on the accelerators: 'text' (the text tower) or 'dual' (the whole model)
    desc: str  # the progress bar's label
    rate: str  # the progress bar's throughput label ('examples_s', 'images_s'): global_batch rows per second

    def steps_per_epoch(self, config: ml_collections.ConfigDict) -> int | None:
        """Global batches per epoch for the schedule and train.num_epochs (None: the data has no epochs)."""

    def timing_epoch(self, config: ml_collections.ConfigDict) -> int:
        """Steps per epoch as timing.jsonl records them (the paper's training time per epoch)."""

    def schema(self, config: ml_collections.ConfigDict) -> Schema:
        """The step's batch: fields, dtypes, shapes, shardings (it feeds the step, the batches and compile-only)."""

    def make_step(self, config: ml_collections.ConfigDict, setup: Setup) -> Callable:
        """The jitted `(state, frozen, batch) -> (state, metrics)`, state donated."""

    def batch(self, step: int, config: ml_collections.ConfigDict, mesh) -> dict:
        """The global batch of `step` as jax.Arrays (this process contributes its rows)."""

    def data_state(self, config: ml_collections.ConfigDict) -> dict:
        """The data position to checkpoint beside the state (JSON); the loop adds the step."""

    def restore_data(self, data: dict) -> None:
        """Resumes the data from a checkpoint's data item."""

    def log_values(self, config: ml_collections.ConfigDict, setup: Setup, done: int, steps: int, state: dict,
                   frozen: dict) -> dict[str, float]:
        """Values logged at a log step beside the step's metrics (validation, skipped images)."""

    def export(self, config: ml_collections.ConfigDict, setup: Setup, result: TrainResult, workdir: Path) -> None:
        """Writes the trained model where the task exports it (or nothing); called on every process."""


@dataclasses.dataclass
class TrainResult:
    metrics: dict[str, float]  # the last logged metrics
    params: Any  # trained parameters (sharded jax.Arrays)
    frozen: Any  # frozen parameters
    start_step: int = 0  # the step this run resumed from (0: from scratch)
    num_steps: int = 0  # the run's total steps; start_step == num_steps: it was already trained

    @property
    def already_trained(self) -> bool:
        return self.start_step >= self.num_steps


def num_steps(tcfg: ml_collections.ConfigDict, steps_per_epoch: int | None) -> int:
    """train.num_steps when set, else train.num_epochs of `steps_per_epoch` global batches."""
    if tcfg.num_steps > 0:
        return int(tcfg.num_steps)
    if not steps_per_epoch:
        raise CfirError("train.num_epochs needs the number of steps per epoch: pass steps_per_epoch")
    return int(math.ceil(tcfg.num_epochs * steps_per_epoch))


def run(config: ml_collections.ConfigDict, workdir: str | os.PathLike, task: Task, devices=None,
        progress: bool | None = None) -> TrainResult:
    """Runs (or resumes, from the latest checkpoint in `workdir`) `task`'s training, then its export. `progress`:
    show the progress bar (process 0; None: as `cfir_jax.core.progress.shown`)."""
    if tower_kind(config) != task.tower:
        raise CfirError(f"train.images={config.train.images!r} does not train the {task.tower!r} "
                        "tower: train.images='pixels' trains both towers (D-BEiT-3 Full), 'cache' the text tower")
    steps = num_steps(config.train, task.steps_per_epoch(config))
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    setup = make_setup(config, steps, devices, task.steps_per_epoch(config), tower=task.tower)
    _check_batch(config.train, setup.mesh.size)
    if jax.process_index() == 0:
        write_json_atomic(workdir / "config.json", portable_config(config, workdir.parent))
    manager = _checkpoint_manager(config.train, workdir)
    state, frozen = _start(config, setup, manager, task, workdir)
    start = int(jax.device_get(state["step"]))
    log = MetricsLog(workdir, start, config.train.tensorboard)
    last = log.last() if start >= steps else {}
    loop = _Loop(config, workdir, task, setup, manager, log, steps)
    show = (progress if progress is not None else shown()) and jax.process_index() == 0
    state, last = loop.train(state, frozen, start, last, show)
    result = TrainResult(last, state["params"], frozen, start, steps)
    task.export(config, setup, result, workdir)
    return result


def _check_batch(tcfg: ml_collections.ConfigDict, devices: int) -> None:
    """The batch (and each gradient-caching micro-batch) is split evenly over every device of the mesh."""
    if tcfg.global_batch % tcfg.grad_accum_steps:
        raise CfirError(f"global_batch {tcfg.global_batch} is not divisible by grad_accum_steps "
                        f"{tcfg.grad_accum_steps}")
    per_step = tcfg.global_batch // tcfg.grad_accum_steps
    if per_step % devices:
        raise CfirError(f"global_batch / grad_accum_steps = {per_step} is not divisible by the {devices} devices of "
                        "the mesh; choose a multiple")


def _checkpoint_manager(tcfg: ml_collections.ConfigDict, workdir: Path):
    options = ocp.CheckpointManagerOptions(max_to_keep=tcfg.keep_checkpoints, create=True,
                                           enable_async_checkpointing=tcfg.async_checkpoints)
    return ocp.CheckpointManager(workdir / "checkpoints", options=options, item_names=("state", "data", "config"))


def _start(config: ml_collections.ConfigDict, setup: Setup, manager, task: Task, workdir: Path) -> tuple[dict, dict]:
    """(state, frozen) to train from: the latest checkpoint (with the task's data state), else `train.init_model`,
    else the seed. The frozen parameters come from the init model on every (re)start."""
    tcfg = config.train
    latest = manager.latest_step()
    state, frozen = init_state(config, setup, None if latest is not None else (tcfg.init_model or None))
    if latest is None:
        return state, frozen
    if tcfg.init_model:
        _, frozen = restore_tower(tcfg.init_model, setup, config.model)
    restored = manager.restore(latest, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(setup.abstract_state), data=ocp.args.JsonRestore()))
    state = restored["state"]
    if restored["data"]["step"] != int(jax.device_get(state["step"])):
        raise CfirError(f"{workdir}: checkpoint {latest} is inconsistent (data step != state step)")
    task.restore_data(restored["data"])
    return state, frozen


@dataclasses.dataclass
class _Loop:
    """The steps of one run, with what they write: metrics, timing, checkpoints (and on SIGTERM, the last one)."""

    config: ml_collections.ConfigDict
    workdir: Path
    task: Task
    setup: Setup
    manager: Any  # orbax.checkpoint.CheckpointManager
    log: MetricsLog
    steps: int

    def save(self, state: dict, step: int, force: bool = False) -> None:
        data = {"step": step} | self.task.data_state(self.config)
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data),
            config=ocp.args.JsonSave(self.config.to_dict())), force=force)

    def train(self, state: dict, frozen: dict, start: int, last: dict[str, float], show: bool
              ) -> tuple[dict, dict[str, float]]:
        """Steps `start`..`steps`; closes the checkpoint manager, the bar and the log. Returns the final state and
        the last logged values."""
        tcfg, task, mesh = self.config.train, self.task, self.setup.mesh
        step_fn = task.make_step(self.config, self.setup)
        # step n/N, steps/s and ETA from tqdm; the loss and the throughput in the postfix at every log step.
        bar = progress_bar(total=self.steps, initial=start, show=show, unit="step", desc=task.desc)
        # Training time per epoch (the paper's T-t): timing.jsonl beside the metrics log, written by process 0.
        hardware = train_time.hardware_label(list(mesh.devices.flat))
        timer = train_time.SegmentTimer(self.workdir, start, hardware, task.timing_epoch(self.config),
                                        jax.process_index() == 0 and start < self.steps)
        t0, seen = time.time(), 0
        with _Preemption(self.manager) as preempt:
            for step in range(start, self.steps):
                state, metrics = step_fn(state, frozen, task.batch(step, self.config, mesh))
                seen += tcfg.global_batch
                done = step + 1
                if done % tcfg.log_every == 0 or done == self.steps:
                    values = _log_values(metrics, done)  # raises on a non-finite loss before any validation
                    last = values | task.log_values(self.config, self.setup, done, self.steps, state, frozen)
                    self.log.write(done, last)
                    timer.log(done)
                    rate = f"{seen / max(time.time() - t0, 1e-9):.1f}"
                    bar.set_postfix({"loss": f"{last['loss']:.4f}", task.rate: rate})
                bar.update(1)
                preempt.checkpoint(done, self.steps, tcfg.checkpoint_every,
                                   functools.partial(self.save, state),
                                   (self.manager, self.log, bar))
        self.manager.wait_until_finished()
        self.manager.close()
        bar.close()
        self.log.close()
        return state, last


def _log_values(metrics: dict, done: int) -> dict[str, float]:
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not math.isfinite(values["loss"]):
        raise FloatingPointError(f"non-finite loss {values['loss']} at step {done}")
    return values


def portable_config(config: ml_collections.ConfigDict, root: Path) -> dict:
    """The config as recorded in the run directory: model paths inside the workdir `root` relative to it, so a
    moved workdir's record still names its own stores."""
    record = json.loads(json.dumps(config.to_dict(), default=str))
    for key in ("init_model", "export_model"):
        value = record["train"].get(key)
        if value and value != "scratch":
            record["train"][key] = Layout(root).portable(value)
    return record
