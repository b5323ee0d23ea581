"""What a training run reports and obeys besides the step: the metrics log and preemption (SIGTERM) handling."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import jax
import jax.experimental.multihost_utils

from cfir_jax.core.torch_free import without_torch
from cfir_jax.stores.atomic_write import write_text_atomic


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
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        if tensorboard:
            try:
                # tensorboardX imports torch whenever it is installed (seconds), for tensors this log never writes
                with without_torch():
                    # why: tensorboardX loads only when train.tensorboard writes events
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

    def checkpoint(self, done: int, steps: int, every: int, save, closing) -> None:
        """After step `done` of `steps`: saves every `every` steps, at the end, and on a SIGTERM; on a SIGTERM also
        closes `closing` (the checkpoint manager first: it waits for the async save on every process) and exits 0."""
        preempted = self.reached(done)
        if preempted or done % every == 0 or done == steps:
            save(done, force=preempted)
        if preempted:
            for thing in closing:
                thing.close()
            print(f"preemption (SIGTERM): saved checkpoint at step {done}, exiting", file=sys.stderr)
            sys.exit(0)

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
