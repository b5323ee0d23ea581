"""The D-BEiT-3 Full training loop: the Full step over batches from the image pipeline, with the pipeline's position
checkpointed by orbax beside the train state, so an interrupted run resumes to exactly the uninterrupted one.

`batches` is the image pipeline's iterator (`cfir_jax.data.image_pipeline.PairBatches`, or anything with its
interface): `next(batches)` gives this process's rows {"pixels" uint8 [b, S, S, 3], "doc_rows" int32 [b],
"image_rows" int32 [b], "valid" bool [b]}, `get_state()` a JSON-able position, `set_state(d)` restores it, `skipped`
counts unreadable images. The documents' tokens (`ids`, `mask` [documents, L]) are indexed by "doc_rows".
Unlike the text trainer, whose data order is a function of the step, the order here is the pipeline's own (grain's
shuffling, augmentation draws), so its state is saved as the checkpoint's "data" item. Orbax writes that JSON item
from process 0; PairBatches resumes any process from process 0's state (tests/test_image_pipeline.py), and a
2-process run trains the 1-process model (tests/test_full_train.py). `cfir_jax.commands.train.run_full` builds its
inputs from a workdir (train.py) and exports the trained model; `index.py --stages image_cache_full` re-encodes the
images with its tower.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.eval import train_time
from cfir_jax.stores.atomic_write import write_json_atomic
from cfir_jax.train.full_step import global_full_batch, make_full_step
from cfir_jax.train.monitor import MetricsLog, _Preemption
from cfir_jax.train.state import init_state, make_setup
from cfir_jax.train.trainer import TrainResult, _portable_config


def _num_steps(tcfg, steps_per_epoch: int | None) -> int:
    if tcfg.num_steps > 0:
        return int(tcfg.num_steps)
    if not steps_per_epoch:
        raise CfirError("train.num_epochs needs the number of steps per epoch: pass steps_per_epoch")
    return int(math.ceil(tcfg.num_epochs * steps_per_epoch))


def batches_per_epoch(batches) -> int:
    """The pipeline's global batches per epoch (PairBatches.steps_per_epoch; 1 for a source that has no epochs)."""
    return int(getattr(batches, "steps_per_epoch", 1) or 1)


def train_full(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    batches,
    ids: np.ndarray,
    mask: np.ndarray,
    steps_per_epoch: int | None = None,
    devices=None,
    progress: bool | None = None,
) -> TrainResult:
    """Runs (or resumes, from the workdir's latest checkpoint: train state and pipeline position) Full training;
    like the text trainer it shows a progress bar (process 0) and times its segments in timing.jsonl."""
    import orbax.checkpoint as ocp

    tcfg = config.train
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    steps = _num_steps(tcfg, steps_per_epoch)
    setup = make_setup(config, steps, devices, steps_per_epoch, tower="dual")
    per_step = tcfg.global_batch // tcfg.grad_accum_steps
    if tcfg.global_batch % tcfg.grad_accum_steps or per_step % setup.mesh.size:
        raise CfirError(
            f"global_batch {tcfg.global_batch} / grad_accum_steps {tcfg.grad_accum_steps} must be a "
            f"whole multiple of the {setup.mesh.size} devices of the mesh"
        )
    if jax.process_index() == 0:
        write_json_atomic(workdir / "config.json", _portable_config(config, workdir.parent))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=tcfg.keep_checkpoints, create=True, enable_async_checkpointing=tcfg.async_checkpoints
    )
    manager = ocp.CheckpointManager(workdir / "checkpoints", options=options, item_names=("state", "data", "config"))
    latest = manager.latest_step()
    state, frozen = init_state(config, setup, None if latest is not None else (tcfg.init_model or None))
    if latest is not None:
        restored = manager.restore(
            latest,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(setup.abstract_state), data=ocp.args.JsonRestore()),
        )
        state = restored["state"]
        if restored["data"]["step"] != int(jax.device_get(state["step"])):
            raise CfirError(f"{workdir}: checkpoint {latest} is inconsistent (data step != state step)")
        batches.set_state(restored["data"]["pipeline"])
    start = int(jax.device_get(state["step"]))
    log = MetricsLog(workdir, start, tcfg.tensorboard)
    step_fn = make_full_step(config, setup)

    def save(step: int, force: bool = False):
        data = {"step": step, "pipeline": batches.get_state(), "skipped": int(batches.skipped)}
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data),
                config=ocp.args.JsonSave(config.to_dict()),
            ),
            force=force,
        )

    from cfir_jax.core.progress import bar as progress_bar
    from cfir_jax.core.progress import shown

    show = (progress if progress is not None else shown()) and jax.process_index() == 0
    bar = progress_bar(total=steps, initial=start, show=show, unit="step", desc="train full")
    hardware = train_time.hardware_label(list(setup.mesh.devices.flat))
    timer = train_time.SegmentTimer(workdir, start, hardware, steps_per_epoch or batches_per_epoch(batches),
                                    jax.process_index() == 0 and start < steps)
    last: dict[str, float] = log.last() if start >= steps else {}
    t0, seen = time.time(), 0
    with _Preemption(manager) as preempt:
        for step in range(start, steps):
            state, metrics = step_fn(state, frozen, global_full_batch(next(batches), ids, mask, setup.mesh))
            seen += tcfg.global_batch
            done = step + 1
            if done % tcfg.log_every == 0 or done == steps:
                last = {k: float(v) for k, v in jax.device_get(metrics).items()} | {"skipped_images": batches.skipped}
                if not math.isfinite(last["loss"]):
                    raise FloatingPointError(f"non-finite loss {last['loss']} at step {done}")
                log.write(done, last)
                timer.log(done)
                bar.set_postfix(loss=f"{last['loss']:.4f}", images_s=f"{seen / max(time.time() - t0, 1e-9):.1f}")
            bar.update(1)
            preempt.checkpoint(done, steps, tcfg.checkpoint_every, save, (manager, log, bar))
    manager.wait_until_finished()
    manager.close()
    bar.close()
    log.close()
    return TrainResult(last, state["params"], frozen, start, steps)
