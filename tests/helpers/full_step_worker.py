"""Subprocess entry point for the Full step's multi-device test (the device count is fixed per process).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python full_step_worker.py OUT.npz

Two Full steps with gradient caching (grad_accum_steps 2) from the same init on 1 device and on 8 devices (data=4 x
fsdp=2, every parameter axis the FSDP rules name sharded); losses and parameters after each run go to OUT.npz. One
accumulation count: that 2 equals 1 is test_full_step.py's one-device test, and each program compiled for 8 devices
costs the suite about 20 s.
"""

import os
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__)))]

from cfir_jax.core import compile_cache  # noqa: E402

# The suite's compiled programs are kept in its own cache (CFIR_CACHE_DIR, tests/conftest.py), as the commands keep
# theirs: a run that is killed and resumed, or run again beside the uninterrupted one, compiles its steps once.
if os.environ.get("CFIR_CACHE_DIR"):
    compile_cache.enable()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from train_fixtures import full_batch, full_config  # noqa: E402

from cfir_jax.core.config import FSDP_RULES  # noqa: E402
from cfir_jax.model.beit3 import param_path  # noqa: E402
from cfir_jax.training.full_step import batch_shardings, make_full_step  # noqa: E402
from cfir_jax.training.state import init_state, make_setup  # noqa: E402


def run(cfg, devices, n=2):
    setup = make_setup(cfg, 10, devices)
    state, frozen = init_state(cfg, setup, None)
    step = make_full_step(cfg, setup)
    if setup.mesh.shape["fsdp"] > 1:  # both towers' kernels are really FSDP-sharded
        for tower in ("A", "B"):
            assert "fsdp" in state["params"][tower]["layers"]["fc1"]["kernel"].sharding.spec, tower
    losses = []
    for i in range(n):
        batch = jax.device_put(full_batch(batch=16, seed=i, invalid=(3, 12)), batch_shardings(setup.mesh))
        state, metrics = step(state, frozen, batch)
        losses.append(float(metrics["loss"]))
    params = {
        param_path(p): np.asarray(v)
        for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(state["params"]))[0]
    }
    return np.array(losses), params


def main():
    assert jax.device_count() == 8, jax.devices()
    out = {}
    accum = 2
    for n, (data, fsdp) in ((1, (1, 1)), (8, (4, 2))):
        cfg = full_config(global_batch=16, grad_accum_steps=accum)
        cfg.mesh.update(data=data, fsdp=fsdp, logical_axis_rules=list(FSDP_RULES))
        losses, params = run(cfg, jax.devices()[:n])
        out[f"a{accum}_loss_{n}"] = losses
        out |= {f"a{accum}_{n}/{k}": v for k, v in params.items()}
    np.savez(sys.argv[1], **out)


if __name__ == "__main__":
    main()
