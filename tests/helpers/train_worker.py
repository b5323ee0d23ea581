"""Subprocess entry points for the trainer tests (device count and jax.distributed are fixed per process).

    python train_worker.py sharded OUT.npz            # one vs 8 devices (data x fsdp), in one process with 8
    python train_worker.py single OUT.npz             # the same two steps on one device
    python train_worker.py run WORKDIR OUT.npz STALL   # train; STALL > 0 blocks before that step (to be killed)
    python train_worker.py dist PID PORT OUT.npz       # one of 2 processes x 4 devices (jax.distributed)
    python train_worker.py distrun PID PORT WORKDIR OUT.npz STALL   # `run` as one of 2 processes x 4 devices
"""

import functools
import os
import sys
import time

sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__)))]

from cfir_jax.core import compile_cache  # noqa: E402

# The suite's compiled programs are kept in its own cache (CFIR_CACHE_DIR, tests/conftest.py), as the commands keep
# theirs: a run that is killed and resumed, or run again beside the uninterrupted one, compiles its steps once.
if os.environ.get("CFIR_CACHE_DIR"):
    compile_cache.enable()

import jax  # noqa: E402
import jax.experimental.multihost_utils  # noqa: E402
import numpy as np  # noqa: E402
from train_fixtures import planted_data, tiny_config  # noqa: E402

from cfir_jax.core.config import mesh_config  # noqa: E402
from cfir_jax.model.beit3 import param_path  # noqa: E402
from cfir_jax.training import loop  # noqa: E402
from cfir_jax.training.data import TrainData  # noqa: E402
from cfir_jax.training.state import init_state, make_setup  # noqa: E402
from cfir_jax.training.step import global_batch_arrays, make_train_step  # noqa: E402
from cfir_jax.training.tasks import TextTask  # noqa: E402


def flat_numpy(tree) -> dict:
    gather = (functools.partial(jax.experimental.multihost_utils.process_allgather, tiled=True)
              if jax.process_count() > 1 else jax.device_get)
    return {param_path(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(gather(tree))[0]}


def steps(cfg, devices, n=2):
    """n training steps from the same init on the given devices; returns (losses, params)."""
    setup = make_setup(cfg, 10, devices)
    state, frozen = init_state(cfg, setup, None)
    step_fn = make_train_step(cfg, setup)
    data = planted_data()
    losses = []
    for i in range(n):
        state, metrics = step_fn(state, frozen, global_batch_arrays(data, i, cfg, setup.mesh))
        losses.append(float(metrics["loss"]))
    return np.array(losses), flat_numpy(state["params"])


class StallingData(TrainData):
    """stall_at >= 0: block before that step (to be SIGKILLed); stall_at == -2: 0.5 s per batch (to be SIGTERMed)."""

    stall_at = -1

    def batch_rows(self, step, global_batch, seed):
        if step == self.stall_at:
            time.sleep(3600)  # the test kills us here
        if self.stall_at == -2:
            time.sleep(0.5)
        return super().batch_rows(step, global_batch, seed)


def stalling_data(d: TrainData, stall: int) -> StallingData:
    data = StallingData(**{f: getattr(d, f) for f in d.__dataclass_fields__})
    data.stall_at = stall
    return data


def initialize_two_processes(pid: int, port: str) -> None:
    """Process `pid` of 2, each with 4 CPU devices, on localhost (gloo collectives, JAX's preemption service)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    assert jax.device_count() == 8 and jax.local_device_count() == 4


def main():
    mode = sys.argv[1]
    if mode == "sharded":
        # data=4 x fsdp=2 with the large config's rules; pure data parallelism over 8 devices is the `dist` mode's
        # (2 processes x 4 devices), against the same one-device run
        cfg = tiny_config(global_batch=16)
        cfg.mesh.update(fsdp=2, data=4, logical_axis_rules=mesh_config("large").logical_axis_rules)
        one_loss, one = steps(tiny_config(global_batch=16), jax.devices()[:1])
        many_loss, many = steps(cfg, jax.devices())
        out = {"fsdp_loss_1": one_loss, "fsdp_loss_8": many_loss}
        for k in one:
            out[f"fsdp_1/{k}"], out[f"fsdp_8/{k}"] = one[k], many[k]
        np.savez(sys.argv[2], **out)
    elif mode == "single":
        loss, params = steps(tiny_config(global_batch=16), jax.devices()[:1])
        np.savez(sys.argv[2], loss=loss, **params)
    elif mode == "run":
        workdir, out, stall = sys.argv[2], sys.argv[3], int(sys.argv[4])
        cfg = tiny_config(num_steps=8, checkpoint_every=2 if stall != -2 else 100)
        result = loop.run(cfg, workdir, TextTask(stalling_data(planted_data(), stall)))
        np.savez(out, **flat_numpy(result.params))
    elif mode == "distrun":
        pid, port, workdir, out, stall = int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
        initialize_two_processes(pid, port)
        # No validation set: the evaluation pass is single-process code. Only the preemption saves mid-run.
        cfg = tiny_config(num_steps=8, global_batch=16, checkpoint_every=100)
        result = loop.run(cfg, workdir, TextTask(stalling_data(planted_data(with_eval=False), stall)))
        params = flat_numpy(result.params)  # every process takes part in the gather
        if pid == 0:
            np.savez(out, **params)
    elif mode == "dist":
        pid, port, out = int(sys.argv[2]), sys.argv[3], sys.argv[4]
        initialize_two_processes(pid, port)
        cfg = tiny_config(global_batch=16)
        loss, params = steps(cfg, jax.devices())
        if pid == 0:
            np.savez(out, loss=loss, **params)
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
